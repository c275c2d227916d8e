"""The offline API: `LLM(model, **engine_args).generate(prompts, params)`, `.chat(...)`, and
the pooled ones, `.embed(prompts)` and `.encode(prompts)` (pooling.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from pagoda.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    live_beams,
)
from pagoda.engine import LLMEngine
from pagoda.lora import LoRARequest
from pagoda.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagoda.pooling import PoolingParams
from pagoda.sampling_params import SamplingParams

Prompt = str | list[int]
# vLLM's TextPrompt / TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids} (a token prompt
# may carry its text under "prompt" too; the ids are what runs).
PromptDict = Mapping[str, Any]
_NOT_SERVED = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")
Salted = tuple[Prompt, str | None]  # a prompt and its cache salt (vLLM's `cache_salt`)


def merge_delta(into: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulates a delta RequestOutput into a cumulative one."""
    if into is None:
        into = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
    by_index = {o.index: o for o in into.outputs}
    for d in delta.outputs:
        o = by_index.get(d.index)
        if o is None:
            o = by_index[d.index] = CompletionOutput(d.index, "", [], [] if d.logprobs is not None else None)
        o.text += d.text
        o.token_ids.extend(d.token_ids)
        if d.logprobs is not None and o.logprobs is not None:
            o.logprobs.extend(d.logprobs)
        o.cumulative_logprob = d.cumulative_logprob
        o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason
    into.outputs = sorted(by_index.values(), key=lambda o: o.index)
    into.finished, into.metrics, into.error = delta.finished, delta.metrics, delta.error
    into.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        into.prompt_logprobs = delta.prompt_logprobs
    into.pooled = delta.pooled if delta.pooled is not None else into.pooled
    return into


class LLM:
    """An engine for batch generation in-process.

    Args:
        model: a Hugging Face directory, a .gguf file, or 'smollm2' (the default).
        **engine_args: vLLM-style engine arguments (dtype, block_size, max_model_len, ...).
    """

    def __init__(self, model: str = "smollm2", **engine_args: object) -> None:
        engine_args.setdefault("log_stats", False)
        engine_args.setdefault("max_num_batched_tokens", 4096)
        self.engine = LLMEngine.from_engine_args(model, (), **engine_args)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer (the Hugging Face one this engine tokenizes with)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the params of a prompt given none, with the model's generation-config
        defaults (generation_config.py; plain SamplingParams under generation_config='vllm')."""
        return self.engine.generation_defaults.sampling_params()

    def generate(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt (a text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}` dicts); returns outputs in the prompts' order.

        Without `sampling_params`, `get_default_sampling_params()`. `priority` (one per
        prompt, lower is sooner) needs `scheduling_policy="priority"`. `lora_request`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model); needs
        `enable_lora=True`."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_list(sampling_params, SamplingParams, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts.")
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(prompt_list))
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompt_list)} prompts.")
        ids = [self.engine.add_request(None, p, sp, priority=pr, cache_salt=salt, lora_request=lora)
               for (p, salt), sp, pr, lora in zip(prompt_list, params, priorities, loras, strict=True)]
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 8)

    def beam_search(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (pagoda/beam_search.py): per prompt, the best
        `params.beam_width` sequences, best first."""
        prompt_list = _as_prompt_list(prompts)
        if any(salt is not None for _, salt in prompt_list):
            raise ValueError("Prompt field 'cache_salt' is not supported by beam_search.")
        searches = [BeamSearch(self._token_ids(p), params, self.engine.eos_token_ids)
                    for p, _ in prompt_list]
        step = params.step_params()
        for _ in range(params.max_tokens):
            if not (live := live_beams(searches)):
                break
            outputs = self.generate([beam.tokens for _, beam in live], step, use_tqdm=False)
            advance_all(searches, live, [(out.outputs[0].logprobs or [{}])[0] for out in outputs])
        return [search.result(self.tokenizer) for search in searches]

    def embed(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one embedding per prompt (`.outputs.embedding`), in order."""
        return [PoolingRequestOutput(out.request_id, EmbeddingOutput(vector), out.prompt_token_ids)
                for out, vector in self._pool(prompts, pooling_params, use_tqdm)]

    def encode(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool | None = None) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: each prompt's pooled vector (`.outputs.data`), in order."""
        return [PoolingRequestOutput(out.request_id, PoolingOutput(vector), out.prompt_token_ids)
                for out, vector in self._pool(prompts, pooling_params, use_tqdm)]

    def _pool(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None,
              use_tqdm: bool | None) -> list[tuple[RequestOutput, list[float]]]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_list(pooling_params, PoolingParams, len(prompt_list))
        engine = self.engine
        ids = [engine.add_processed(engine.processor.process_pooling(engine.new_id(), p, pp,
                                                                     cache_salt=salt))
               for (p, salt), pp in zip(prompt_list, params, strict=True)]
        results = self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 8)
        failed = next((out for out in results if out.pooled is None), None)
        if failed is not None:
            raise RuntimeError(f"Request {failed.request_id} failed: {failed.error}")
        return [(out, out.pooled or []) for out in results]

    def _token_ids(self, prompt: Prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.engine.processor.tokenize(prompt)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates (with
        `lora_request`'s adapter, as `generate`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            list(self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
                    if delta.finished:
                        bar.update(1)
        finally:
            bar.close()
            if self.engine.runner is not None:  # NOTE: None when the core has its own process
                self.engine.runner.restore_threads()
        return [results[i] for i in ids]


def _as_prompt_list(prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict]) -> list[Salted]:
    if isinstance(prompts, (str, Mapping)):
        return [_as_prompt(prompts)]
    if prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
        return [(prompts, None)]  # type: ignore[list-item]
    return [_as_prompt(p) for p in prompts]  # type: ignore[arg-type]


def _as_prompt(prompt: Prompt | PromptDict) -> Salted:
    """A text, a list of token ids, or vLLM's prompt dicts as one of them, with the dict's
    `cache_salt` (ValueError for a field pagoda does not serve: none is dropped silently)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unserved = [k for k in _NOT_SERVED if prompt.get(k) is not None]
    if unserved:
        raise ValueError(f"Prompt field {unserved[0]!r} is not supported: pagoda serves text "
                         "prompts ('prompt') and token ids ('prompt_token_ids').")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", *_NOT_SERVED})
    if unknown:
        raise ValueError(f"Unknown prompt field {unknown[0]!r}: a prompt dict takes 'prompt' "
                         "(text) or 'prompt_token_ids' (a list of token ids), and 'cache_salt'.")
    salt = prompt.get("cache_salt")
    if (ids := prompt.get("prompt_token_ids")) is not None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError("'prompt_token_ids' must be a list of token ids.")
        return list(ids), salt
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError("A prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids).")
    return text, salt


P = TypeVar("P", SamplingParams, PoolingParams)


def _as_list(params: P | Sequence[P] | None, kind: type[P], n: int) -> list[P]:
    """One params object per prompt (the default's when None, the same one for all)."""
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    assert not isinstance(params, (SamplingParams, PoolingParams))
    if len(params) != n:
        raise ValueError(f"Got {len(params)} {kind.__name__} for {n} prompts.")
    return list(params)
