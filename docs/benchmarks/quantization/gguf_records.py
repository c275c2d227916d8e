"""How exactly `--quantization gguf` holds a GGUF's weights: each tensor in its record format
(layers/quantization/gguf.py) against the `gguf` package's dequantization, beside the bf16
copy that loading without quantization makes.

    .venv/bin/python docs/benchmarks/quantization/gguf_records.py [MODEL]   (default: gemma3-270m)

Per GGUF kind: tensors, how many the records hold bit for bit, the largest relative rounding
of a record's scale and offset (f16 in int4 records), the largest |error| over the tensor's
max |w|, the RMS error over the tensor's RMS, and the bf16 copy's two. Tensors of more than
16M weights (an LM head) are skipped: their kinds are checked on the others.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from gguf.quants import dequantize

from pagoda.layers.quantization.gguf import PREFERRED, packed_method, to_format
from pagoda.models.gguf import _reader
from pagoda.models.gguf_blocks import decode
from pagoda.models.loader import resolve_model_path


def _rounding(x: torch.Tensor) -> float:
    """The largest relative change of `x` rounded to f16."""
    return ((x.half().float() - x).abs() / x.abs().clamp_min(1e-30)).max().item()


def main() -> None:
    path = resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m")
    rows: dict[str, list[float]] = {}
    for tensor in _reader(path).tensors:
        kind = tensor.tensor_type.name
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        if kind not in PREFERRED or len(shape) != 2 or shape[0] * shape[1] > 1 << 24:
            continue
        want = torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
                                .reshape(shape).copy())
        fmt = PREFERRED[kind]
        codes, scale, offset = to_format(decode(tensor.data, kind, shape[0]), fmt)
        got = packed_method(fmt, codes, scale, offset).dequantize(torch.float32)
        scales = _rounding(scale) if fmt.scheme == "int4" else 0.0
        offsets = _rounding(offset) if fmt.scheme == "int4" and offset is not None else 0.0
        bf16 = want.bfloat16().float()
        top, rms = want.abs().max().item(), want.norm().item()
        row = [1.0, float(torch.equal(got, want)), scales, offsets, (got - want).abs().max().item() / top,
               (got - want).norm().item() / rms, (bf16 - want).abs().max().item() / top, (bf16 - want).norm().item() / rms]
        old = rows.get(kind)
        rows[kind] = row if old is None else [old[0] + 1, old[1] + row[1], *map(max, old[2:], row[2:])]
    print(f"{path}")
    print(f"{'kind':5} {'records':20} {'tensors':>7} {'exact':>5}  {'f16 scale / offset':>18}  "
          f"{'max err/max|w|':>14} {'rms err/rms':>11}  {'bf16: max err':>13} {'rms err':>8}")
    for kind, r in sorted(rows.items()):
        print(f"{kind:5} {PREFERRED[kind].describe():20} {int(r[0]):7} {int(r[1]):5}  {r[2]:8.2g} / {r[3]:<7.2g}  "
              f"{r[4]:14.2g} {r[5]:11.2g}  {r[6]:13.2g} {r[7]:8.2g}")

if __name__ == "__main__":
    main()
