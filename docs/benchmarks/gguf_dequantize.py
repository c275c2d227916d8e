"""The GGUF loader's Q4_0/Q4_1/Q8_0 dequantization against the `gguf` package's, per file.

    .venv/bin/python docs/benchmarks/gguf_dequantize.py [MODEL]   (default: smollm2)

Dequantizes every Q4_0/Q4_1/Q8_0 tensor of the file both ways, checks the bits are equal,
and prints each way's total time.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from gguf.quants import dequantize

from pagoda.models.gguf import _reader, dequantize_blocks
from pagoda.models.loader import resolve_model_path


def main() -> None:
    path = resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
    theirs = ours = 0.0
    count = 0
    for tensor in _reader(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        start = time.perf_counter()
        want = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        theirs += time.perf_counter() - start
        start = time.perf_counter()
        got = dequantize_blocks(tensor.data, kind, shape[0]).reshape(shape)
        ours += time.perf_counter() - start
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), tensor.name
        count += 1
    print(f"{path}: {count} tensors, the same bits; gguf package {theirs:.2f} s, pagoda {ours:.2f} s")


if __name__ == "__main__":
    main()
