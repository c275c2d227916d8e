"""Pydantic models of vLLM's token-in, token-out API (`/inference/v1/generate` and the render
routes' answer): `GenerateRequest`, as vLLM 0.32 spells it.

`sampling_params` is vLLM's `SamplingParams` as JSON (its non-default fields, as vLLM writes
them): the fields pagoda's `SamplingParams` shares are taken by name, vLLM's own ones are
accepted at vLLM's default value, and anything else is a 400 that names it
(`tokens.sampling_params_of`). The multimodal and KV-transfer members vLLM's render may write
as null are accepted as null and refused otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.sampling_params import INT64_MAX, INT64_MIN
from pagoda.server.protocol import RepetitionDetection, RequestModel, StreamOptions

# NOTE: vLLM's members for what pagoda does not serve (multimodal inputs, KV and encoder-cache
# transfer, render's reasoning-parser state): null is "none", anything else a 400
NULL_ONLY = ("token_offsets", "features", "content_parts", "reasoning_parser_kwargs",
             "kv_transfer_params", "ec_transfer_params")


class GenerateRequest(RequestModel):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    # NOTE: vLLM's: True: an output constraint holds from the first token; otherwise, with
    # --reasoning-parser, only after the end of thinking
    reasoning_ended: bool | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    token_offsets: Any = None
    features: Any = None
    content_parts: Any = None
    reasoning_parser_kwargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    def unsupported_fields(self) -> list[str]:
        return sorted([*super().unsupported_fields(),
                       *(name for name in NULL_ONLY if getattr(self, name) is not None)])


class GenerateSamplingParams(BaseModel):
    """The `sampling_params` fields pagoda shares with vLLM, typed as vLLM's `SamplingParams`
    reads them (pydantic's lax rules, as the other routes'), so a wrong type is a 400 before the
    engine sees it. `structured_outputs` stays a dict: `tokens.py` reads vLLM's form of it."""

    model_config = ConfigDict(extra="forbid")

    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None
    watermarking: bool | None = None
    bad_words: list[str] | None = None
    repetition_detection: RepetitionDetection | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    thinking_token_budget: int | None = None
