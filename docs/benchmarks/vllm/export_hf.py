"""Write pagoda's smollm2 weights (the GGUF, dequantized by transformers) as a bf16 HF folder.

Run with pagoda's venv:  .venv/bin/python docs/benchmarks/vllm/export_hf.py /tmp/smol_hf
The folder is what `vllm serve` loads, so vLLM gets the same weights as pagoda and transformers.
(transformers refuses to save a model loaded from GGUF, hence the copy into a fresh model.)
"""
import copy
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda.models.loader import load_hf_reference, resolve_model_path

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol_hf"
src = load_hf_reference("smollm2", torch.bfloat16)
config = copy.deepcopy(src.config)
if hasattr(config, "quantization_config"):
    delattr(config, "quantization_config")
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(src.state_dict())
model.save_pretrained(out)
path = resolve_model_path("smollm2")
folder, name = path.rsplit("/", 1)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
ids = torch.tensor([[1, 504, 3458, 314, 253, 1616]])
with torch.no_grad():
    print("max |logit difference| vs the GGUF model:", (src(ids).logits - model(ids).logits).abs().max().item())
