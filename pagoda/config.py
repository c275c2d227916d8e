"""Engine configuration: frozen dataclasses that validate themselves.

Each component receives only the sub-config it uses. `EngineConfig.from_kwargs` is the one
place that turns user-facing keyword arguments (the offline API's and the CLI's) into them;
an unknown keyword is an error naming the known ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagoda.generation_config import check_generation_values, check_source

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # NOTE: vLLM's spellings of two of them
QUANTIZATIONS = ("int8", "int4", "gguf", "fp8", "gptq", "awq")
INT4_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_MODEL = "smollm2"
DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}.")


def parse_bytes(text: str | int, name: str = "kv_cache_memory") -> int:
    """Parses a size like '4GiB', '512MB', '1e9' or an int into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"{name} must look like '4GiB' or a byte count, got {text!r}.")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def json_object(value: dict | str, name: str, secret: bool = False) -> dict:
    """A dict, or a JSON object's text (the CLI's form), as a dict.

    Raises:
        ValueError: naming `name`, when the text is not JSON or not an object; the text is
            quoted in the message unless it is `secret` (a config holding a key).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            shown = f"{e.msg} (column {e.colno})" if secret else f"got {value!r}: {e}"
            raise ValueError(f"{name} must be JSON, {shown}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object" + ("." if secret else f", got {value!r}."))
    return value


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    Attributes:
        model: a Hugging Face directory, a .gguf file, or the alias 'smollm2'.
        dtype: 'auto', 'float32', 'bfloat16' or 'float16'.
        max_model_len: context length; None takes the model's own.
        seed: base seed for requests that give none.
        chat_template: a Jinja template (text or a file path) overriding the tokenizer's.
        device: 'auto', 'cpu' or 'cuda'.
        quantization: None (weights in `dtype`; a quantized GGUF is dequantized), 'int8'
            (per-channel), 'int4' (group-wise), 'gguf' (a GGUF's Q4_0/Q4_1/Q8_0 blocks kept
            packed), 'fp8' (e4m3, where the hardware has fp8 products), or 'gptq' / 'awq' (a
            4-bit checkpoint's own, found from its config when None).
        quantization_group_size: inputs per int4 scale/offset group (32, 64 or 128).
        tokenizer: where the tokenizer comes from (a directory, .gguf file or alias), when not
            from `model` (vLLM's --tokenizer).
        logprobs_mode: vLLM's: what `logprobs` report: 'raw_logprobs' (the model's, before any
            processing; the default), 'raw_logits', 'processed_logprobs' (of the distribution
            sampled from: constraints, penalties, temperature, top-k/top-p/min-p applied) or
            'processed_logits'.
        generation_config: where requests' sampling defaults come from (vLLM's
            --generation-config, generation_config.py): 'auto' (the model's
            generation_config.json), 'vllm' (none) or a folder holding one.
        override_generation_config: generation-config keys laid over it (a dict, or its JSON).
        hf_overrides: keys laid over the model's config (vLLM's --hf-overrides; a dict, or its
            JSON), e.g. {"rope_scaling": {...}} or {"max_position_embeddings": 65536}.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    chat_template: str | None = None
    device: str = "auto"
    quantization: str | None = None
    quantization_group_size: int = 32
    tokenizer: str | None = None
    generation_config: str = "auto"
    override_generation_config: dict[str, float | int] = field(default_factory=dict)
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        check_source(self.generation_config)
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               f"must be one of {LOGPROBS_MODES}")
        object.__setattr__(self, "hf_overrides", json_object(self.hf_overrides, "hf_overrides"))
        override = json_object(self.override_generation_config, "override_generation_config")
        object.__setattr__(self, "override_generation_config",
                           check_generation_values(override, "override_generation_config"))
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {DTYPES}")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
               self.quantization, f"must be None or one of {QUANTIZATIONS}")
        _check(self.quantization_group_size in INT4_GROUP_SIZES, "quantization_group_size",
               self.quantization_group_size, f"must be one of {INT4_GROUP_SIZES}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len",
               self.max_model_len, "must be positive")
        _check(self.device in ("auto", "cpu", "cuda"), "device", self.device,
               "must be 'auto', 'cpu' or 'cuda'")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: pool size on CPU (and on CUDA when set).
        gpu_memory_utilization: share of the GPU's memory this engine may use (CUDA).
        num_kv_blocks: a fixed number of blocks, overriding both of the above.
        enable_prefix_caching: share full blocks between requests by content hash.
        cache_dtype: K/V storage: 'auto' (the model's dtype), or one byte a value with a
            per-tensor scale: 'fp8' / 'fp8_e4m3' (e4m3fn) or 'fp8_e5m2' (engine argument
            `kv_cache_dtype`, as vLLM).
        disable_hybrid_kv_cache_manager: keep one pool for every layer of a model mixing
            global and sliding-window layers, each holding every token (vLLM's name); by
            default the sliding-window layers hold only the blocks their window sees.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        _check(self.cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.cache_dtype,
               f"must be one of {KV_CACHE_DTYPES}")
        _check(self.block_size in BLOCK_SIZES, "block_size", self.block_size,
               f"must be one of {BLOCK_SIZES}")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be positive")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        _check(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks",
               self.num_kv_blocks, "must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: filled in from the model when the engine starts.
        scheduling_policy: "fcfs" (arrival order, groups in turn) or "priority" (vLLM's: a request's
            `priority`, lower first, then as fcfs; preemption takes the worst first).
        step_time_target_ms: when set, each step's token budget is cut to what the last steps'
            times say ends within this many milliseconds (step_cost.py), never above
            `max_num_batched_tokens`: a latency floor for first tokens and inter-token gaps
            under load, at some throughput. None: the fixed budget.
        long_prefill_token_threshold: vLLM's: when above 0, the most prompt tokens one request
            computes in a step, so a long prompt leaves the rest of the budget to others (0: a
            request takes what the budget has), and the length above which a prompt is long
            (`max_long_partial_prefills`).
        max_num_partial_prefills: vLLM's (V0's semantics; vLLM V1 refuses more than 1): the most
            prompts partially prefilled at once; above 1, at most `max_long_partial_prefills`
            of them long, so short prompts go ahead of a long one's queue, and a prompt's chunk
            a step is capped at `long_prefill_token_threshold` (4% of `max_model_len` when 0,
            as vLLM). 1 (the default): no limit, as before.
        max_long_partial_prefills: vLLM's: of those, the most long ones (at most
            `max_num_partial_prefills`).
        max_num_scheduled_tokens: vLLM's: the most tokens the scheduler issues in a step, below
            `max_num_batched_tokens` (None: that budget).
        max_num_active_seqs: vLLM's: the most requests admitted to run, at most `max_num_seqs`
            (None: `max_num_seqs`), so decode batches stay smaller.
        watermark: vLLM's: the fraction of KV blocks a waiting (or preempted) request may not
            take while others run, headroom against repeated preemption (0: none).
        scheduler_reserve_full_isl: vLLM's: a waiting request is admitted only when its whole
            sequence fits in the free blocks, not just its first chunk (fewer preemptions under
            memory pressure). Off by default, unlike vLLM 0.32: pagoda admits on the first
            chunk and preempts by recompute when the pool runs short.
        stream_interval: vLLM's: a streamed answer's tokens go out in chunks of at least this
            many (its first and last at once); a request's own `stream_interval` may raise it
            for itself, never lower it. 1: every step's tokens as soon as it ends.
    """

    max_num_seqs: int = 256
    # NOTE: 512, not vLLM's 2048: 16 prompts arriving together are prefilled 4 at a time, so
    # the first answers start 4x sooner (c=16 TTFT p50 0.81 s vs 1.56 s here, same output
    # tok/s; docs/benchmarks.md). The offline LLM, which wants throughput, uses 4096.
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    scheduling_policy: str = "fcfs"
    step_time_target_ms: float | None = None
    long_prefill_token_threshold: int = 0
    max_num_scheduled_tokens: int | None = None
    max_num_active_seqs: int | None = None
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = False
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    stream_interval: int = 1

    @property
    def partial_prefills(self) -> bool:
        """Whether `max_num_partial_prefills` limits concurrent prefills (above 1)."""
        return self.max_num_partial_prefills > 1

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step, and the length above which a
        prompt is long (0: no cap): `long_prefill_token_threshold`, or with partial prefills
        and none set 4% of `max_model_len` (vLLM's default)."""
        if self.long_prefill_token_threshold or not self.partial_prefills:
            return self.long_prefill_token_threshold
        return max(1, int(self.max_model_len * 0.04))

    @property
    def step_tokens(self) -> int:
        """The most tokens one step schedules."""
        return min(self.max_num_batched_tokens, self.max_num_scheduled_tokens or self.max_num_batched_tokens)

    @property
    def admission_limit(self) -> int:
        """The most requests running at once."""
        return self.max_num_active_seqs or self.max_num_seqs

    def __post_init__(self) -> None:
        _check(self.max_num_scheduled_tokens is None or self.max_num_scheduled_tokens > 0,
               "max_num_scheduled_tokens", self.max_num_scheduled_tokens, "must be positive")
        _check(self.max_num_active_seqs is None or 0 < self.max_num_active_seqs <= self.max_num_seqs,
               "max_num_active_seqs", self.max_num_active_seqs, f"must be in [1, max_num_seqs={self.max_num_seqs}]")
        _check(0.0 <= self.watermark < 1.0, "watermark", self.watermark, "must be in [0, 1)")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               self.long_prefill_token_threshold, "must be 0 (off) or positive")
        _check(self.max_num_partial_prefills >= 1, "max_num_partial_prefills",
               self.max_num_partial_prefills, "must be at least 1")
        _check(1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
               "max_long_partial_prefills", self.max_long_partial_prefills,
               f"must be in [1, max_num_partial_prefills={self.max_num_partial_prefills}]")
        _check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
               self.scheduling_policy, "must be fcfs or priority")
        _check(self.stream_interval >= 1, "stream_interval", self.stream_interval, "must be at least 1")
        _check(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "must be positive")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens",
               self.max_num_batched_tokens, "must be positive")
        _check(self.max_model_len > 0, "max_model_len", self.max_model_len, "must be positive")
        _check(self.step_time_target_ms is None or self.step_time_target_ms > 0,
               "step_time_target_ms", self.step_time_target_ms, "must be positive")


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of the engine; each limit is a `pagoda serve` flag.

    Attributes:
        max_n: most samples per prompt; None takes max_num_seqs.
        max_prompt_chars: longest prompt text, checked before tokenizing; None takes
            32 characters per token of the context length.
        max_stop_sequences: most stop strings, and most stop token ids, per request.
        max_stop_str_chars: longest stop string.
        max_logit_bias: most entries in a request's logit_bias.
        max_queued_requests: most sequences waiting to be scheduled (a request with n
            samples counts n); beyond it the server answers 429.
        max_guided_choices: most strings in a `choice` constraint.
        max_grammar_bytes: longest grammar, regex or choice list (in UTF-8 bytes).
        max_grammar_rules: most rules in a Lark or GBNF grammar.
        max_schema_depth: deepest nesting of a JSON schema (objects and arrays).
        max_schema_properties: most properties in a JSON schema (every `properties` object's
            names, summed); its `enum` values, summed, count against max_guided_choices.
        grammar_compile_workers: processes that compile grammars (0: compile in the engine's
            own process, unprotected).
        grammar_compile_timeout: longest one grammar may take to compile, in seconds, both of
            wall-clock time and of CPU time (a sandboxed compile's threads together).
        grammar_compile_memory: each compiling process's address-space limit, in MiB (0: none).
        max_logprobs: most logprobs / prompt_logprobs one request may ask for (vLLM's 20);
            -1 allows the whole vocabulary (a request's -1).
    The grammar limits are checked before anything compiles: a 3,000-rule grammar crashed
    the grammar library's native code, and a 60,000-entry choice held a worker for a minute.
    What passes them still compiles in a separate process (`GrammarSandbox`).
    """

    max_n: int | None = None
    max_prompt_chars: int | None = None
    max_stop_sequences: int = 64
    max_stop_str_chars: int = 1024
    max_logit_bias: int = 1024
    max_queued_requests: int = 1024
    max_guided_choices: int = 2048
    max_grammar_bytes: int = 65536
    max_grammar_rules: int = 1000
    max_schema_depth: int = 128
    max_schema_properties: int = 2048
    grammar_compile_workers: int = 2
    grammar_compile_timeout: float = 10.0
    grammar_compile_memory: int = 2048
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompt_chars"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, value, "must be positive")
        for name in ("max_stop_sequences", "max_stop_str_chars", "max_logit_bias",
                     "max_queued_requests", "max_guided_choices", "max_grammar_bytes",
                     "max_grammar_rules", "max_schema_depth", "max_schema_properties",
                     "grammar_compile_timeout"):
            value = getattr(self, name)
            _check(value > 0, name, value, "must be positive")
        for name in ("grammar_compile_workers", "grammar_compile_memory"):
            value = getattr(self, name)
            _check(value >= 0, name, value, "must be 0 or more")
        _check(self.max_logprobs >= -1, "max_logprobs", self.max_logprobs,
               "must be -1 (the whole vocabulary) or 0 or more")

    def resolved(self, max_num_seqs: int, max_model_len: int) -> LimitsConfig:
        """A copy with the defaults that depend on the engine filled in."""
        return dataclasses.replace(
            self, max_n=self.max_n or max_num_seqs,
            max_prompt_chars=self.max_prompt_chars or 32 * max_model_len)


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys (`--speculative-config '<json>'`).

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model" (implied by `model`).
        num_speculative_tokens: drafted tokens per request and step (k).
        prompt_lookup_max / prompt_lookup_min: the n-gram sizes tried, longest first.
        model: the draft model (a directory, .gguf or alias) for "draft_model".
        disable_by_batch_size: no drafting in steps with at least this many running requests.
        quantization: the draft model's weight quantization (as `ModelConfig.quantization`);
            None: the target's.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and self.method == "ngram":
            object.__setattr__(self, "method", "draft_model")
        _check(self.method in SPEC_METHODS, "method", self.method, f"must be one of {SPEC_METHODS}")
        _check(self.method != "draft_model" or self.model is not None, "model", self.model,
               "must name the draft model for method 'draft_model'")
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
               self.num_speculative_tokens, "must be in [1, 16]")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               self.prompt_lookup_min, f"must be in [1, prompt_lookup_max={self.prompt_lookup_max}]")
        _check(self.disable_by_batch_size is None or self.disable_by_batch_size > 0,
               "disable_by_batch_size", self.disable_by_batch_size, "must be positive")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
               self.quantization, f"must be None or one of {QUANTIZATIONS}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's form) or None; unknown keys are an error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown speculative_config key(s) {unknown}; known: {sorted(known)}.")
        return cls(**value)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism over torch.distributed, on one machine or several.

    Attributes:
        tensor_parallel_size: ranks sharing each layer (heads, MLP columns, vocabulary).
        pipeline_parallel_size: stages, each running a contiguous share of the layers.
        nnodes: machines the T x P ranks spread over (equally).
        node_rank: this machine's index; node 0 runs the engine and the server.
        dist_init_addr: host:port of the rendezvous (node 0's address; any free port).
        core_process: run the engine core (scheduler, KV pool, model or its workers) in a
            process of its own, the frontend talking to it over a pipe (core_client.py);
            default: in the frontend's process.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    core_process: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, value, "must be at least 1")
        _check(0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank,
               f"must be in [0, nnodes={self.nnodes})")
        _check(self.world_size % self.nnodes == 0, "nnodes", self.nnodes,
               f"must divide tensor_parallel_size x pipeline_parallel_size = {self.world_size}")
        _check(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr",
               self.dist_init_addr, "must be set (host:port of node 0) when nnodes > 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (lora.py): off unless `enable_lora`.

    Attributes:
        max_lora_rank: the largest rank an adapter may have (vLLM's default 16).
        max_cpu_loras: adapters kept loaded at once (the least recently used dropped).
        max_loras: the most distinct adapters the running requests may use at once (vLLM's
            per-batch limit: a waiting request of another adapter waits while it is reached,
            those behind it go on); None, the default, sets none (vLLM's default 1 counts
            its GPU's adapter slots, which pagoda's per-row updates do not need).
    """

    enable_lora: bool = False
    max_lora_rank: int = 16
    max_cpu_loras: int = 8
    max_loras: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank, "must be >= 1")
        _check(self.max_cpu_loras >= 1, "max_cpu_loras", self.max_cpu_loras, "must be >= 1")
        _check(self.max_loras is None or self.max_loras >= 1, "max_loras", self.max_loras, "must be >= 1")


WATERMARK_ALGORITHMS = ("gumbel", "dual_key_gumbel")
WATERMARK_DEDUPLICATION = ("none", "single_turn", "all")


@dataclass(frozen=True)
class WatermarkConfig:
    """vLLM's text watermark (`--watermark-config '{"algorithm": "gumbel", "key": 42}'`;
    watermark.py generates and detects it).

    Attributes:
        key: the secret key (0 to 2^64 - 1); never logged, shown or echoed in an error.
        algorithm: "gumbel" or "dual_key_gumbel".
        alpha: dual-key only: the probability of key B for a token.
        context_width: the generated tokens before a token that seed its noise.
        deduplicate_contexts: "single_turn" (default): a context already seen in this answer
            samples without the watermark; "all": the prompt's contexts count too, and the
            first `context_width` tokens sample without it; "none": never deduplicated.
        deduplicate_contexts_max_history: the most recent positions searched (None: all).
        prf: the pseudorandom function ("philox", vLLM's only one).
        allow_target_only_watermarking: vLLM's escape for speculative decoding; pagoda's draft
            methods (ngram, draft_model) are ones vLLM refuses with a watermark, and so does pagoda.
    """

    key: int = field(repr=False)
    algorithm: str = "gumbel"
    alpha: float = 0.1
    context_width: int = 4
    deduplicate_contexts: str = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192
    prf: str = "philox"
    allow_target_only_watermarking: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.key, int) and not isinstance(self.key, bool) and 0 <= self.key <= 2**64 - 1):
            raise ValueError("watermark_config: key must be an integer in [0, 2^64 - 1].")
        _check(self.algorithm in WATERMARK_ALGORITHMS, "watermark_config: algorithm", self.algorithm,
               f"must be one of {WATERMARK_ALGORITHMS}")
        _check(0.0 <= self.alpha <= 1.0, "watermark_config: alpha", self.alpha, "must be in [0, 1]")
        _check(isinstance(self.context_width, int) and self.context_width >= 1,
               "watermark_config: context_width", self.context_width, "must be a positive integer")
        _check(self.deduplicate_contexts in WATERMARK_DEDUPLICATION, "watermark_config: deduplicate_contexts",
               self.deduplicate_contexts, f"must be one of {WATERMARK_DEDUPLICATION}")
        history = self.deduplicate_contexts_max_history
        _check(history is None or (isinstance(history, int) and history >= 1),
               "watermark_config: deduplicate_contexts_max_history", history,
               "must be a positive integer or null")
        _check(self.prf == "philox", "watermark_config: prf", self.prf, "must be 'philox'")

    @classmethod
    def parse(cls, value: WatermarkConfig | dict | str | None) -> WatermarkConfig | None:
        """From a dict, a JSON string (the CLI's form) or None; unknown keys are an error.
        NOTE: the text is never echoed (it holds the key)."""
        if value is None or isinstance(value, WatermarkConfig):
            return value
        value = json_object(value, "watermark_config", secret=True)
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"Unknown watermark_config key(s) {unknown}; known: {sorted(known)}.")
        if "key" not in value:
            raise ValueError("watermark_config needs 'key': the secret the watermark is keyed by.")
        return cls(**value)

    @property
    def weak_deduplication(self) -> bool:
        """vLLM warns: Gumbel-max without (enough) deduplication breeds repetition loops."""
        history = self.deduplicate_contexts_max_history
        return self.deduplicate_contexts == "none" or (history is not None and history < 1024)


@dataclass(frozen=True)
class ReasoningConfig:
    """vLLM's `--reasoning-config`: the strings that open a reasoning model's thinking and that
    are forced to close it when a request's `thinking_token_budget` runs out (they may add a
    transition phrase before the end tag). The server fills unset ones from
    `--reasoning-parser`'s tags; a budget needs both.

    Attributes:
        reasoning_start_str: what opens the thinking (e.g. "<think>").
        reasoning_end_str: what is forced to close it (e.g. "</think>").
        natural_end_str: what the model writes to close it itself ("": reasoning_end_str).
    """

    reasoning_start_str: str = ""
    reasoning_end_str: str = ""
    natural_end_str: str = ""

    @classmethod
    def parse(cls, value: ReasoningConfig | dict | str | None) -> ReasoningConfig | None:
        """From a dict, a JSON string (the CLI's form) or None; unknown keys are an error."""
        if value is None or isinstance(value, ReasoningConfig):
            return value
        value = dict(json_object(value, "reasoning_config"))
        # NOTE: vLLM's key; the parser is the server's --reasoning-parser
        value.pop("reasoning_parser", None)
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"Unknown reasoning_config key(s) {unknown}; known: {sorted(known)}.")
        if not all(isinstance(v, str) for v in value.values()):
            raise ValueError("reasoning_config: its values must be strings.")
        return cls(**value)

    @property
    def enabled(self) -> bool:
        """Whether a thinking budget can be enforced (both strings known)."""
        return bool(self.reasoning_start_str and self.reasoning_end_str)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None
    watermark: WatermarkConfig | None = None
    reasoning: ReasoningConfig | None = None
    log_stats: bool = True

    def __post_init__(self) -> None:
        if self.watermark is not None and self.speculative is not None:
            raise ValueError(
                f"watermark_config cannot be combined with speculative decoding here: its drafts "
                f"({self.speculative.method}) would not be watermarked (vLLM refuses these methods "
                f"with a watermark too; it watermarks drafts of eagle/mtp models only).")

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: object) -> EngineConfig:
        """Builds the config from flat vLLM-style keyword arguments.

        Raises:
            ValueError: on an unknown keyword or an invalid value.
        """
        if "kv_cache_memory" in kwargs:
            kwargs["kv_cache_memory_bytes"] = parse_bytes(kwargs.pop("kv_cache_memory"))  # type: ignore[arg-type]
        if "kv_cache_dtype" in kwargs:
            kwargs["cache_dtype"] = kwargs.pop("kv_cache_dtype")
        parts: dict[str, dict[str, object]] = {}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                  "parallel": ParallelConfig, "limits": LimitsConfig, "lora": LoRAConfig}
        known = {f.name: part for part, c in owners.items() for f in dataclasses.fields(c)}
        top: dict[str, object] = {}
        for key, value in kwargs.items():
            if key == "log_stats":
                top[key] = value
            elif key == "speculative_config":
                top["speculative"] = SpeculativeConfig.parse(value)  # type: ignore[arg-type]
            elif key == "watermark_config":
                top["watermark"] = WatermarkConfig.parse(value)  # type: ignore[arg-type]
            elif key == "reasoning_config":
                top["reasoning"] = ReasoningConfig.parse(value)  # type: ignore[arg-type]
            elif key in known and key != "max_model_len":
                parts.setdefault(known[key], {})[key] = value
            elif key == "max_model_len":
                parts.setdefault("model", {})[key] = value
            else:
                names = sorted([*known, "log_stats", "kv_cache_memory", "kv_cache_dtype",
                                "speculative_config", "watermark_config", "reasoning_config"])
                raise ValueError(f"Unknown engine argument {key!r}; known arguments: {names}.")
        parts.setdefault("model", {})["model"] = model
        built = {part: owners[part](**values) for part, values in parts.items()}  # type: ignore[arg-type]
        return cls(**built, **top)  # type: ignore[arg-type]

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """Returns a copy whose scheduler and limits know the resolved context length."""
        scheduler = dataclasses.replace(self.scheduler, max_model_len=max_model_len)
        model = dataclasses.replace(self.model, max_model_len=max_model_len)
        limits = self.limits.resolved(self.scheduler.max_num_seqs, max_model_len)
        return dataclasses.replace(self, scheduler=scheduler, model=model, limits=limits)
