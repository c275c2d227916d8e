"""Shim conftest: maps the hub models the tests name to pagoda's local SmolLM2-135M-Instruct.

- get_tokenizer(<hub name>) / AutoTokenizer(.from_pretrained) in the test modules -> SmolLM2's tokenizer (the HF
  folder pagoda builds from its GGUF, ~/.cache/pagoda/gguf/SmolLM2-135M-Instruct.Q4_1-*).
- ModelConfig(<hub name>).get_vocab_size() in test modules -> SmolLM2's config (vocab 49152).
- hf_api().snapshot_download("typeof/zephyr-7b-beta-lora") -> a random local LoRA for SmolLM2.
"""
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _tok_dir() -> str:
    hits = sorted(glob.glob(os.path.expanduser("~/.cache/pagoda/gguf/SmolLM2-135M-Instruct.Q4_1-*")))
    if not hits:
        raise RuntimeError("no SmolLM2 HF folder under ~/.cache/pagoda/gguf (start pagoda once)")
    return hits[-1]


TOK_DIR = _tok_dir()
FAKE_LORA = os.path.join(ROOT, "fake_lora")  # NOTE: ROOT is the run directory (run.sh)
if not os.path.exists(os.path.join(FAKE_LORA, "adapter_model.safetensors")):
    subprocess.check_call([sys.executable, os.path.join(ROOT, "make_fake_lora.py"), FAKE_LORA])

from vllm import tokenizers as _vt  # noqa: E402

_real_get_tokenizer = _vt.get_tokenizer


def get_tokenizer(tokenizer_name=None, *args, **kwargs):
    return _real_get_tokenizer(TOK_DIR, *args, **kwargs)


class FakeModelConfig:
    def __init__(self, model=None, **kwargs):
        import json
        self.model = model
        self.hf_config = json.load(open(os.path.join(TOK_DIR, "config.json")))

    def get_vocab_size(self):
        return self.hf_config["vocab_size"]


class _FakeHfApi:
    def snapshot_download(self, repo_id=None, *a, **k):
        return FAKE_LORA


import vllm.transformers_utils.repo_utils as _ru  # noqa: E402

_ru.hf_api = lambda *a, **k: _FakeHfApi()


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or id(mod) in seen:
            continue
        seen.add(id(mod))
        if hasattr(mod, "get_tokenizer"):
            mod.get_tokenizer = get_tokenizer
        if hasattr(mod, "ModelConfig"):
            mod.ModelConfig = FakeModelConfig
        if hasattr(mod, "AutoTokenizer"):
            mod.AutoTokenizer = _LocalAutoTokenizer


class _LocalAutoTokenizer:
    """transformers' AutoTokenizer, any hub name read as SmolLM2's local folder."""

    @staticmethod
    def from_pretrained(name=None, *args, **kwargs):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name if name and os.path.isdir(name) else TOK_DIR, *args, **kwargs)
