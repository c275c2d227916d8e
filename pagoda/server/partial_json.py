"""Reading JSON that is still being generated: where values end, what an object holds so far.

The tool-call parsers stream a call's arguments as the model writes them, so they need to
know, on a prefix of the output, which spans are whole and where a value is still open. These
scanners walk the raw text (strings and escapes respected, nesting counted) and never
rewrite it: a span they report is the model's own text. They check structure only as far as
they need to; the finished text is validated with `json.loads` by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The first index at or after `i` that is not JSON whitespace."""
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the string opening at `text[i]` (a quote), None while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at `text[i]`, None while it may go on."""
    if text[i] == '"':
        return string_end(text, i)
    if text[i] not in "{[":
        j = i
        while j < len(text) and text[j] not in ",}]" + WHITESPACE:
            j += 1
        return j if j < len(text) else None  # NOTE: "12" may still become "123"
    depth, j = 0, i
    while j < len(text):
        if text[j] == '"':
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if text[j] in "{[":
            depth += 1
        elif text[j] in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


@dataclass
class ObjectScan:
    """An object read so far: each key's value span (end None while open), and its end."""

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None

    def text_of(self, text: str, key: str) -> str | None:
        """The raw text of `key`'s value so far (all of it once whole), None if absent."""
        if key not in self.members:
            return None
        start, end = self.members[key]
        return text[start:end if end is not None else len(text)]

    def value_of(self, text: str, key: str) -> object | None:
        """`key`'s decoded value once it is whole, else None."""
        start, end = self.members.get(key, (0, None))
        return json.loads(text[start:end]) if end is not None else None


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object opening at `text[i]`, as far as the text goes.

    Raises:
        ValueError: the text there is not (the beginning of) a JSON object.
    """
    if text[i] != "{":
        raise ValueError(f"expected an object at {i}")
    scan, j = ObjectScan(), skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        key_end = string_end(text, j)
        colon = skip_ws(text, key_end) if key_end is not None else len(text)
        if colon >= len(text):
            break
        if text[colon] != ":":
            raise ValueError(f"expected ':' at {colon}")
        start = skip_ws(text, colon + 1)
        if start >= len(text):
            break
        end = value_end(text, start)
        scan.members[json.loads(text[j:key_end])] = (start, end)
        if end is None:
            break
        j = skip_ws(text, end)
    return scan
