"""Build a small random PEFT LoRA adapter for SmolLM2-135M (stand-in for typeof/zephyr-7b-beta-lora)."""
import json
import os
import sys

import torch
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
r, hidden, kv = 8, 576, 192
g = torch.Generator().manual_seed(0)
t = {}
for i in range(30):
    for mod, o in (("q_proj", hidden), ("v_proj", kv)):
        p = f"base_model.model.model.layers.{i}.self_attn.{mod}"
        t[f"{p}.lora_A.weight"] = (torch.randn(r, hidden, generator=g) * 0.01).contiguous()
        t[f"{p}.lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.01).contiguous()
save_file(t, f"{out}/adapter_model.safetensors")
json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
           "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False}, open(f"{out}/adapter_config.json", "w"), indent=1)
print(out)
