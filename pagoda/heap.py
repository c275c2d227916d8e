"""Handing freed heap memory back to the operating system, and keeping Python's cyclic
collector off the objects that live as long as the engine.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated), so after a
burst of large requests the process's RSS stays at its peak although Python freed everything.
`trim()` asks every arena to release what it can (`malloc_trim(0)`); the engine loop calls it
when it goes idle. Elsewhere than glibc it does nothing.

`freeze_objects()` moves every object alive once an engine is built (the model's modules, the
tokenizer, the engine's tables) into the collector's permanent generation, as vLLM's
`freeze_gc_heap` does after start-up: the collector's full passes, which a busy engine loop sets
off every few thousand allocations, then walk only what was made since (1-2% of a long prefill's
time on SmolLM2 went to walking them, docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


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


def freeze_objects() -> int:
    """Collects, then freezes every object alive (`gc.freeze`); returns how many are frozen.

    What an earlier call froze is unfrozen first, so that a process that builds engines one after
    another (tests, notebooks) still collects the cycles of those it dropped."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
