"""Handing freed heap memory back to the operating system.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated), so after a
burst of large requests the process's RSS stays at its peak although Python freed everything.
`trim()` asks every arena to release what it can (`malloc_trim(0)`); the engine loop calls it
when it goes idle. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Returns freed heap pages to the OS; True if anything was released."""
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
