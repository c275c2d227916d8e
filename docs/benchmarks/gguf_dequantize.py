"""The GGUF loader's dequantization (models/gguf_blocks.py) against the `gguf` package's, per file.

    .venv/bin/python docs/benchmarks/gguf_dequantize.py [MODEL]   (default: smollm2; gemma3-270m)

Dequantizes every tensor of a kind pagoda decodes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) both ways, checks the bits are equal, and prints each way's total time by kind.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import numpy as np
from gguf.quants import dequantize

from pagoda.models.gguf import _reader, dequantize_blocks
from pagoda.models.gguf_blocks import DECODED_KINDS
from pagoda.models.loader import resolve_model_path


def main() -> None:
    path = resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
    theirs: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for tensor in _reader(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in DECODED_KINDS:
            continue
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        start = time.perf_counter()
        want = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        theirs[kind] += time.perf_counter() - start
        start = time.perf_counter()
        got = dequantize_blocks(tensor.data, kind, shape[0]).reshape(shape)
        ours[kind] += time.perf_counter() - start
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), tensor.name
        count[kind] += 1
    print(f"{path}: {sum(count.values())} tensors, the same bits; gguf package {sum(theirs.values()):.2f} s, "
          f"pagoda {sum(ours.values()):.2f} s")
    for kind in sorted(count):
        print(f"  {kind}: {count[kind]} tensors, gguf package {theirs[kind]:.2f} s, pagoda {ours[kind]:.2f} s")

if __name__ == "__main__":
    main()
