"""GGUFIndex: a GGUF file's scalar metadata and tensor table, read in milliseconds.

The `gguf` package's `GGUFReader` turns every metadata value into numpy views, the 49,152
vocabulary strings and merges of SmolLM2 included: 4.4 s on a Zen 3, paid by every process
that loads the model. Weights need only the scalars (architecture, head counts) and the
tensor table, so this reads those with `struct` and steps over arrays by their lengths. The
tensors are the same views `GGUFReader` gives (`data`: float arrays in the file's shape,
quantized ones as raw bytes [rows, bytes a row]), so `gguf.quants.dequantize` takes them.

Invariant: nothing is copied; the file stays mapped while a view of it lives.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF", little-endian
# value types: (struct format, size) for scalars; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its name, GGML type, dims in GGUF order (fastest first) and data view."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFIndex:
    """The scalar fields (`fields`: key -> value; arrays are skipped) and `tensors` of a file."""

    def release_pages(self) -> None:
        """Drops the file's pages from this process's resident memory (the loaded model holds
        its own copies; a later read faults them back in from the page cache): Gemma 3's
        240 MiB file otherwise stayed in a served model's RSS for as long as the index lived."""
        mapped = getattr(self._map, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def __init__(self, path: str) -> None:
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        magic, version = struct.unpack_from("<II", self._buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic).")
        if version & 0xFFFF == 0 or version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (or byte order) is not supported.")
        num_tensors, num_fields = struct.unpack_from("<QQ", self._buf, 8)
        self.fields: dict[str, Any] = {}
        offset = 24
        for _ in range(num_fields):
            key, offset = self._string(offset)
            (kind,), offset = struct.unpack_from("<I", self._buf, offset), offset + 4
            value, offset = self._value(kind, offset)
            self.fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name, offset = self._string(offset)
            (n_dims,) = struct.unpack_from("<I", self._buf, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offset + 4)
            kind, start = struct.unpack_from("<IQ", self._buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, start))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, data_start + start) for name, dims, kind, start in infos]

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, offset)
        end = offset + 8 + length
        return bytes(self._buf[offset + 8:end]).decode("utf-8", "replace"), end

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(offset)
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return struct.unpack_from(fmt, self._buf, offset)[0], offset + size
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", self._buf, offset)
            offset += 12
            if item in _SCALARS:
                return None, offset + count * _SCALARS[item][1]
            for _ in range(count):
                _, offset = self._value(item, offset)
            return None, offset
        raise ValueError(f"unknown GGUF value type {kind}")

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        ggml_type = GGMLQuantizationType(kind)
        np_dims = tuple(reversed(dims))
        n_elems = int(np.prod(dims))
        plain = _PLAIN_DTYPES.get(ggml_type.name)
        if plain is not None:
            data = self._map[start:start + n_elems * np.dtype(plain).itemsize].view(plain).reshape(np_dims)
        else:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            data = self._map[start:start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
        return GGUFTensor(name, ggml_type, tuple(dims), data)
