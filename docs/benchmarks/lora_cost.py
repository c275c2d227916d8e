"""What serving a LoRA adapter costs: the same batch with no adapter, with one adapter on half
of its requests, and on all of them (a random rank-R adapter on every projection of every
layer, PEFT's layout), alternating rounds in one process.

    .venv/bin/python docs/benchmarks/lora_cost.py [--model smollm2] [--rank 16] [--streams 16]
        [--tokens 64] [--rounds 3]

In bf16 the adapted rows' updates run inside the one-call native stack (pagoda/csrc/decoder.cpp),
so the figure is the price of the low-rank products there (layer by layer with hooks before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagoda import LLM, LoRARequest, SamplingParams

SHAPES = {"q_proj": ("self_attn", "q", "h"), "k_proj": ("self_attn", "kv", "h"), "v_proj": ("self_attn", "kv", "h"),
          "o_proj": ("self_attn", "h", "q"), "gate_proj": ("mlp", "i", "h"), "up_proj": ("mlp", "i", "h"),
          "down_proj": ("mlp", "h", "i")}


def write_adapter(out: Path, dims: dict[str, int], layers: int, rank: int) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for name, (block, n_out, n_in) in SHAPES.items():
            stem = f"base_model.model.model.layers.{i}.{block}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, dims[n_in], generator=g) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(dims[n_out], rank, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, enable_lora=True, max_lora_rank=args.rank, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    d = model.dims
    dims = {"h": d.hidden_size, "i": model.layers[0].mlp.down_proj.in_features,
            "q": d.num_heads * d.head_dim, "kv": d.num_kv_heads * d.head_dim}
    folder = Path(tempfile.mkdtemp(prefix="lora_cost_"))
    write_adapter(folder, dims, d.num_layers, args.rank)
    lora = LoRARequest("cost", 1, str(folder))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    cases = {"no adapter": [None] * args.streams,
             "adapter on half": [lora if i % 2 else None for i in range(args.streams)],
             "adapter on all": [lora] * args.streams}
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=[lora, None])  # NOTE: warm-up, loads it
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, loras in cases.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            times[name].append(time.perf_counter() - start)
    out_tokens = args.streams * args.tokens
    base = statistics.median(times["no adapter"])
    print(f"{args.model}: {args.streams} streams x {args.tokens} tokens (prompts of 128), rank {args.rank} "
          f"on all 7 projections, median of {args.rounds} rounds")
    for name, runs in times.items():
        t = statistics.median(runs)
        print(f"{name:16s} {t:7.2f} s  {out_tokens / t:7.1f} out tok/s  {base / t:5.2f}x  "
              f"(runs {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
