"""The model's recommended sampling defaults: vLLM's `--generation-config`.

`generation_config` "auto" reads the model folder's `generation_config.json` (its
`config.json` when there is none, as transformers' `GenerationConfig.from_model_config`);
"vllm" reads nothing; any other value is a folder holding a `generation_config.json`.
`override_generation_config` is laid over what was read. Of the result only vLLM's six keys
count (`GENERATION_KEYS`), and, as vLLM's `to_diff_dict`, a value equal to transformers' own
default counts as unset. They become `GenerationDefaults`: the defaults of every request
that does not set them (a server request's omitted field, the offline API's omitted
`SamplingParams`), `max_new_tokens` as the default `max_tokens`. A GGUF file carries no
generation config: under "auto" it has no defaults.

Invariant: the defaults are valid `SamplingParams` values; a file that holds others is
refused when the engine starts, naming the file, the key and the value.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")

GENERATION_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# NOTE: transformers' GenerationConfig defaults; vLLM reads the file through `to_diff_dict`,
# which leaves out a value equal to them (a file's top_k 50 sets nothing).
HF_DEFAULTS: dict[str, float | int] = {"repetition_penalty": 1.0, "temperature": 1.0,
                                       "top_k": 50, "top_p": 1.0}
GENERATION_CONFIG_FILE = "generation_config.json"
OVERRIDDEN_WARNING = (
    "Default sampling parameters have been overridden by the model's Hugging Face generation "
    "config recommended from the model creator. If this is not intended, please relaunch the "
    "server with `--generation-config vllm`.")


def check_generation_values(values: dict[str, Any], where: str) -> dict[str, float | int]:
    """Checks generation-config values: only `GENERATION_KEYS`, numbers that `SamplingParams`
    accepts.

    Raises:
        ValueError: naming `where`, the key and the value.
    """
    unknown = sorted(set(values) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(GENERATION_KEYS)}.")
    for key, value in values.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if key in ("top_k", "max_new_tokens") and not is_int:
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}.")
        if not is_int and not isinstance(value, float):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}.")
    # NOTE: imported here: config.py imports this module, and sampling_params imports config
    # (through structured_output).
    from pagoda.sampling_params import SamplingParams

    try:
        SamplingParams(**_as_sampling_fields(values))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return dict(values)


def _as_sampling_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Generation-config keys as `SamplingParams` keywords (max_new_tokens -> max_tokens)."""
    fields = dict(values)
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    return fields


def check_source(source: str) -> None:
    """Checks a `generation_config` value: 'auto', 'vllm', or a folder with the file.

    Raises:
        ValueError: a missing folder, or one without generation_config.json.
    """
    if source in ("auto", "vllm"):
        return
    if not os.path.isdir(source):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"{GENERATION_CONFIG_FILE}, got {source!r} (no such folder).")
    if not os.path.isfile(os.path.join(source, GENERATION_CONFIG_FILE)):
        raise ValueError(f"generation_config folder {source!r} has no {GENERATION_CONFIG_FILE}.")


def read_generation_config(folder: str) -> dict[str, float | int]:
    """The six keys of a folder's generation_config.json (else its config.json), without
    those equal to transformers' defaults; {} when the folder has neither.

    Raises:
        ValueError: a file that is not a JSON object, or holds invalid values for the keys.
    """
    for name in (GENERATION_CONFIG_FILE, "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return _read_keys(path)
    return {}


def _read_keys(path: str) -> dict[str, float | int]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    values = {key: data[key] for key in GENERATION_KEYS
              if data.get(key) is not None and data[key] != HF_DEFAULTS.get(key)}
    return check_generation_values(values, path)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for requests that leave them out (vLLM's `default_sampling_params`).

    Attributes:
        params: `SamplingParams` keywords (temperature, top_p, top_k, min_p,
            repetition_penalty; max_tokens from max_new_tokens).
        max_tokens_cap: a bound on every request's max_tokens (vLLM's `override_max_tokens`:
            max_new_tokens given by `override_generation_config` or a generation-config
            folder, not by the model's own file).
        source: where they came from: 'model', 'vllm' or the folder.
    """

    params: dict[str, float | int] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    source: str = "vllm"

    def fill(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A request's `SamplingParams` keywords with the defaults of those it left out
        (max_tokens apart: see `max_tokens`)."""
        defaults = {k: v for k, v in self.params.items() if k != "max_tokens" and k not in fields}
        return {**fields, **defaults}

    def max_tokens(self, requested: int | None, room: int) -> int:
        """vLLM's `get_max_tokens`: the request's max_tokens, else the default's, bounded by
        the room the context leaves (`room`) and by `max_tokens_cap`."""
        chosen = requested if requested is not None else self.params.get("max_tokens")
        return min(v for v in (room, int(chosen) if chosen is not None else None,
                               self.max_tokens_cap) if v is not None)

    def sampling_params(self) -> SamplingParams:
        """vLLM's `LLM.get_default_sampling_params()`: SamplingParams with these defaults."""
        from pagoda.sampling_params import SamplingParams

        return SamplingParams(**self.params)  # type: ignore[arg-type]


def load_generation_defaults(source: str, override: dict[str, float | int],
                             model_folder: str | None) -> GenerationDefaults:
    """vLLM's `ModelConfig.get_diff_sampling_param`, logging its warning when they apply.

    Args:
        source: 'auto', 'vllm' or a folder (`ModelConfig.generation_config`).
        override: `ModelConfig.override_generation_config`, laid over what was read.
        model_folder: the model's folder under 'auto'; None for a GGUF file.
    """
    read: dict[str, float | int] = {}
    if source == "auto":
        read = read_generation_config(model_folder) if model_folder is not None else {}
    elif source != "vllm":
        read = _read_keys(os.path.join(source, GENERATION_CONFIG_FILE))
    config = {**read, **override}
    params = _as_sampling_fields(config)
    cap_from = override if source in ("auto", "vllm") else config
    cap = cap_from.get("max_new_tokens")
    if params:
        logger.warning(OVERRIDDEN_WARNING)
    return GenerationDefaults(params, int(cap) if cap is not None else None,
                              "model" if source == "auto" else source)
