"""`pagoda serve`: vLLM-style flags, engine start-up, uvicorn, and a draining SIGTERM.

`add_serve_parser` adds the subcommand to the top-level CLI; `add_serve_arguments` gives the
same flags to `python -m pagoda.entrypoints.openai.api_server`. Flag values are checked
(through `EngineConfig`) before the model loads, so a typo fails in milliseconds with exit 2.
Once loaded, the KV pool report (`format_kv_memory_report`) is logged; `/kv_cache` serves it
later. `--engine-stall-timeout` is how long /health tolerates pending work without a step.

Shutdown: the first SIGTERM or SIGINT starts draining: new requests get 503, running ones
finish or hit `--drain-timeout`, then uvicorn stops and the process exits 0. A second signal
stops at once. If the engine loop dies, every open stream gets an error and the process exits
1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

import uvicorn

from pagoda.config import (
    BLOCK_SIZES,
    DEFAULT_MODEL,
    DTYPE_ALIASES,
    DTYPES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    QUANTIZATIONS,
    EngineConfig,
    ReasoningConfig,
    json_object,
    parse_bytes,
)
from pagoda.lora import LoRARequest, check_adapter
from pagoda.metrics import (
    LiveStatLogger,
    check_histogram_buckets,
    default_stat_loggers,
    format_kv_memory_report,
)
from pagoda.server.api import CorsPolicy, build_app
from pagoda.server.reasoning import END as REASONING_END
from pagoda.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from pagoda.server.reasoning import START as REASONING_START
from pagoda.server.request_logger import RequestLogger
from pagoda.server.response_store import DEFAULT_RESPONSES_STORE_SIZE, ResponseStore
from pagoda.server.serving import (
    CONTENT_FORMATS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerContext,
    load_chat_template,
)
from pagoda.server.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser

logger = logging.getLogger("pagoda.serve")

# flag dest -> EngineConfig.from_kwargs keyword
ENGINE_FLAGS = {
    "dtype": "dtype", "max_model_len": "max_model_len", "seed": "seed",
    "chat_template": "chat_template", "device": "device", "block_size": "block_size",
    "kv_cache_memory": "kv_cache_memory", "gpu_memory_utilization": "gpu_memory_utilization",
    "num_kv_blocks": "num_kv_blocks", "enable_prefix_caching": "enable_prefix_caching",
    "disable_hybrid_kv_cache_manager": "disable_hybrid_kv_cache_manager",
    "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
    "scheduling_policy": "scheduling_policy", "step_time_target_ms": "step_time_target_ms",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "max_num_partial_prefills": "max_num_partial_prefills",
    "max_long_partial_prefills": "max_long_partial_prefills",
    "max_num_scheduled_tokens": "max_num_scheduled_tokens", "max_num_active_seqs": "max_num_active_seqs",
    "watermark": "watermark", "scheduler_reserve_full_isl": "scheduler_reserve_full_isl",
    "stream_interval": "stream_interval",
    "tensor_parallel_size": "tensor_parallel_size",
    "enable_lora": "enable_lora", "max_lora_rank": "max_lora_rank", "max_cpu_loras": "max_cpu_loras",
    "max_loras": "max_loras",
    "pipeline_parallel_size": "pipeline_parallel_size", "nnodes": "nnodes",
    "node_rank": "node_rank", "dist_init_addr": "dist_init_addr", "core_process": "core_process",
    "max_n": "max_n", "max_prompt_chars": "max_prompt_chars",
    "max_stop_sequences": "max_stop_sequences", "max_stop_str_chars": "max_stop_str_chars",
    "max_logit_bias": "max_logit_bias", "max_queued_requests": "max_queued_requests",
    "max_guided_choices": "max_guided_choices", "max_grammar_bytes": "max_grammar_bytes",
    "max_grammar_rules": "max_grammar_rules", "max_schema_depth": "max_schema_depth",
    "max_schema_properties": "max_schema_properties",
    "grammar_compile_workers": "grammar_compile_workers",
    "grammar_compile_timeout": "grammar_compile_timeout",
    "grammar_compile_memory": "grammar_compile_memory",
    "speculative_config": "speculative_config", "watermark_config": "watermark_config",
    "quantization": "quantization",
    "quantization_group_size": "quantization_group_size", "kv_cache_dtype": "kv_cache_dtype",
    "max_logprobs": "max_logprobs", "tokenizer": "tokenizer", "logprobs_mode": "logprobs_mode",
    "generation_config": "generation_config",
    "override_generation_config": "override_generation_config", "hf_overrides": "hf_overrides",
}


def json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def histogram_buckets_arg(text: str) -> dict[str, list[float]]:
    """--custom-histogram-buckets: JSON checked as vLLM checks it."""
    try:
        return check_histogram_buckets(json.loads(text))
    except (json.JSONDecodeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human_int(text: str) -> int:
    """'2048', '8k' (8000) or '8K' (8192), as vLLM's --max-model-len accepts."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 2048 or 8k, got {text!r}") from None


def byte_size(text: str) -> str:
    try:
        parse_bytes(text, "a size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer, 0 or more, got {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def json_arg(flag: str) -> Callable[[str], dict]:
    """An argparse type: a JSON object's text, as a dict (a clear error naming `flag`)."""
    def parse(text: str) -> dict:
        try:
            return json_object(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def positive_int(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def port_number(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}")
    return port


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every `serve` flag to `parser`."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"model to serve: HF directory, .gguf file or alias "
                             f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="read flags from a YAML file, as vLLM: each key a flag's name, each "
                             "value its value; flags on the command line win over the file's")
    add_network_arguments(parser)
    add_model_arguments(parser)
    add_cache_arguments(parser)
    add_parallel_arguments(parser)
    add_lora_arguments(parser)
    add_limit_arguments(parser)
    add_tool_arguments(parser)
    add_no_effect_arguments(parser)
    add_unsupported_arguments(parser)


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network and API")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=port_number, default=8000)
    net.add_argument("--api-key", action="extend", nargs="+", default=None,
                     help="require one of these keys on /v1 routes (also PAGODA_API_KEY)")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="names the API answers to; the first appears in responses")
    net.add_argument("--drain-timeout", "--shutdown-timeout", type=float, default=30.0,
                     help="seconds running requests may take to finish after SIGTERM (vLLM's "
                          "--shutdown-timeout; 0 cuts them at once)")
    net.add_argument("--log-level", default=None, type=str.lower,
                     choices=["debug", "info", "warning", "error", "critical"],
                     help="the level of pagoda's own log (default info), as vLLM's")
    net.add_argument("--log-error-stack", action=argparse.BooleanOptionalAction, default=False,
                     help="log the stack trace of each error response, as vLLM's")
    net.add_argument("--log-config-file", default=None, metavar="PATH",
                     help="a JSON file of Python logging configuration (logging.config.dictConfig), "
                          "applied at start, as vLLM's")
    net.add_argument("--enable-scale-out", action=argparse.BooleanOptionalAction, default=False,
                     help="serve vLLM's token-in, token-out routes (/v1/completions/render, "
                          "/v1/chat/completions/render, /inference/v1/generate, "
                          "/inference/v1/abort_requests); without it they answer 403, as vLLM's")
    net.add_argument("--tokens-only", action=argparse.BooleanOptionalAction, default=False,
                     help="vLLM's: --enable-scale-out with token ids only (no stop strings, no "
                          "output_mode text on /inference/v1/generate), and /abort_requests too")
    net.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                     help="serve GET /tokenizer_info (vLLM's): the tokenizer's configuration and class")
    net.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                     help="log each generating request's params when admitted (INFO; its prompt "
                          "and token ids at DEBUG), as vLLM")
    net.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                     help="with --enable-log-requests, also each answer's text and finish reason "
                          "(INFO; its token ids at DEBUG), as vLLM")
    net.add_argument("--enable-log-deltas", action=argparse.BooleanOptionalAction, default=True,
                     help="with --enable-log-outputs, also each streamed delta (vLLM's; on by default)")
    net.add_argument("--max-log-len", type=int, default=None, metavar="N",
                     help="the most characters of a prompt or answer (and ids of a list) a "
                          "request-log line shows (default: all)")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"])
    net.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                     help="no access-log line per HTTP call")
    net.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                     help="count the calls running the model, for GET /load (as vLLM)")
    net.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                     help="an ASGI middleware to add (repeatable), as vLLM: a class (app.add_middleware) "
                          "or an async function (an HTTP middleware), by its import path")
    net.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                     help="no access-log line for calls to these comma-separated paths, e.g. "
                          "'/health,/metrics' (as vLLM)")
    net.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                     help="every stream ends with a usage chunk, as if it asked with "
                          "stream_options.include_usage")
    net.add_argument("--disable-log-stats", action="store_true",
                     help="turn off the periodic engine stats log")
    net.add_argument("--custom-histogram-buckets", type=histogram_buckets_arg, default=None, metavar="JSON",
                     help="Prometheus histogram bounds by vLLM's bucket family, e.g. "
                          "'{\"request_latency\": [0.01, 0.05, 0.1, 0.5]}' (families: request_latency, "
                          "time_to_first_token, inter_token_latency, iteration_tokens, request_tokens, ...)")
    net.add_argument("--disable-web-ui", action="store_true",
                     help="do not serve the web page (chat and live stats) at /")
    net.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                     help="serve no /docs, /redoc or /openapi.json")
    net.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                     help='logprobs name each token "token_id:N", not by its text')
    net.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                     help="every response carries X-Request-Id (the request's own, or a new one)")
    net.add_argument("--responses-store-size", type=non_negative_int,
                     default=DEFAULT_RESPONSES_STORE_SIZE, metavar="N",
                     help="responses kept for previous_response_id and GET /v1/responses/{id}, "
                          f"the least recently used dropped first (default "
                          f"{DEFAULT_RESPONSES_STORE_SIZE}; 0 keeps none)")
    net.add_argument("--root-path", default=None,
                     help="the path prefix a proxy serves this server under (FastAPI's root_path)")
    net.add_argument("--allowed-origins", type=json_list, default=None, metavar="JSON",
                     help='origins a browser may call from, as vLLM (\'["https://a.example"]\' '
                          'or \'["*"]\'); default: no CORS headers, same-origin pages only '
                          "(vLLM allows every origin)")
    net.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON")
    net.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON")
    net.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False)
    net.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    net.add_argument("--ssl-certfile", default=None, help="... and this certificate chain")
    net.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates with")
    net.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                     help="client certificates: 0 not asked, 1 optional, 2 required (the ssl module's "
                          "CERT_NONE/OPTIONAL/REQUIRED, as vLLM)")
    net.add_argument("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites (OpenSSL's syntax)")
    net.add_argument("--h11-max-incomplete-event-size", type=int, default=None, metavar="BYTES",
                     help="the most bytes of an HTTP request's head before it is refused (uvicorn's)")
    net.add_argument("--engine-stall-timeout", type=positive_seconds, default=60.0,
                     metavar="SECONDS",
                     help="/health answers 503 when the engine has pending requests but has "
                          "not stepped for this long (default 60)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--dtype", choices=(*DTYPES, *DTYPE_ALIASES), default=None,
                       help="auto (bfloat16 where this CPU or GPU computes it, else float32), "
                            "float32 (float), bfloat16, float16 (half)")
    model.add_argument("--max-model-len", type=human_int, default=None)
    model.add_argument("--seed", type=int, default=None)
    model.add_argument("--chat-template", default=None, help="a Jinja template or a file path")
    model.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="how a message's content reaches the template: string (text parts "
                            "joined by newlines), openai (the list of parts), auto (openai when "
                            "the template loops over message['content'])")
    model.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                       help="let a request carry its own chat_template (refused otherwise, as vLLM)")
    model.add_argument("--default-chat-template-kwargs", type=json_arg("--default-chat-template-kwargs"), default=None, metavar="JSON",
                       help="keyword arguments every chat's template gets, under the request's "
                            "own chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    model.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction,
                       default=False, help="a request with tool_choice none renders its chat "
                                           "template without its tools (as vLLM)")
    model.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="the role of a chat answer when the request asks for a generation "
                            "prompt (add_generation_prompt, the default); otherwise the answer "
                            "continues the last message and takes its role (as vLLM)")
    model.add_argument("--tokenizer", default=None,
                       help="load the tokenizer from this directory, .gguf file or alias "
                            "(default: the model's own)")
    model.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    model.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                       help="where omitted sampling fields get their defaults: 'auto' (the "
                            "default: the model's generation_config.json), 'vllm' (none) or a "
                            "folder holding a generation_config.json")
    model.add_argument("--hf-overrides", type=json_arg("--hf-overrides"), default=None, metavar="JSON",
                       help="keys laid over the model's config.json, e.g. "
                            "'{\"max_position_embeddings\": 65536}' or a rope_scaling")
    model.add_argument("--rope-scaling", type=json_arg("--rope-scaling"), default=None, metavar="JSON",
                       help="the model's rope scaling (an --hf-overrides key, vLLM's older flag)")
    model.add_argument("--rope-theta", type=float, default=None,
                       help="the model's rope base (an --hf-overrides key, vLLM's older flag)")
    model.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help="generation-config keys over it, e.g. '{\"temperature\": 0.5}' "
                            "(temperature, top_p, top_k, min_p, repetition_penalty, "
                            "max_new_tokens)")
    model.add_argument("-q", "--quantization", choices=QUANTIZATIONS, default=None,
                       help="weight quantization: int8 (per channel), int4 (group-wise), gguf "
                            "(a quantized GGUF's blocks kept packed), fp8 (needs fp8 hardware), "
                            "gptq, awq (4-bit checkpoints, found from their config); "
                            "default: weights in --dtype (a quantized GGUF is dequantized)")
    model.add_argument("--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=None,
                       help="inputs per int4 scale (default 32)")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    cache = parser.add_argument_group("memory and scheduling")
    cache.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None)
    cache.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=byte_size, default=None,
                       help="KV pool size, e.g. 4GiB")
    cache.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=None,
                       help="share of the GPU's memory this engine may use for weights, activations and "
                            "KV (per engine, as vLLM; default 0.9)")
    cache.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                       help="KV blocks in the pool, overriding the memory-based size")
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                       help="K/V storage: auto (the model's dtype) or fp8 (= fp8_e4m3), "
                            "fp8_e5m2: one byte a value with a per-tensor scale, twice the tokens")
    cache.add_argument("--max-num-seqs", type=int, default=None)
    cache.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                       help="token budget of one step (default 512: sooner first tokens; raise it for throughput)")
    cache.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                       help="fcfs (default): arrival order, with the requests of a many-prompt "
                            "request taking turns with others; priority: each request's "
                            "`priority` field first (lower is sooner), as vLLM")
    cache.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="TOKENS",
                       help="the most prompt tokens one request computes in a step (vLLM's; 0, "
                            "the default: what the budget has), so long prompts leave room to others")
    cache.add_argument("--max-num-partial-prefills", type=int, default=None, metavar="N",
                       help="the most prompts prefilling at once (vLLM's, as its V0 ran it; 1, the "
                            "default: no limit); above 1, at most --max-long-partial-prefills of "
                            "them long (above --long-prefill-token-threshold, 4%% of the context "
                            "when 0), so short prompts go ahead of long ones")
    cache.add_argument("--max-long-partial-prefills", type=int, default=None, metavar="N",
                       help="of those, the most long prompts prefilling at once (vLLM's; default 1)")
    cache.add_argument("--max-num-scheduled-tokens", type=human_int, default=None, metavar="TOKENS",
                       help="the most tokens the scheduler issues in a step (vLLM's; default: "
                            "--max-num-batched-tokens)")
    cache.add_argument("--max-num-active-seqs", type=int, default=None, metavar="N",
                       help="the most requests running at once, at most --max-num-seqs (vLLM's; "
                            "default: --max-num-seqs): smaller decode batches")
    cache.add_argument("--watermark", type=float, default=None, metavar="FRACTION",
                       help="fraction of KV blocks a waiting or preempted request may not take "
                            "while others run (vLLM's; 0, the default: none)")
    cache.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=None,
                       help="admit a waiting request only when its whole sequence fits in the free "
                            "KV blocks, not just its first chunk (vLLM's; off by default, on in vLLM 0.32)")
    cache.add_argument("--stream-interval", type=int, default=None, metavar="TOKENS",
                       help="stream answers in chunks of at least TOKENS tokens, the first and last "
                            "at once (vLLM's; 1, the default: each step's tokens as soon as it "
                            "ends); a request's `stream_interval` may raise it for itself")
    cache.add_argument("--step-time-target-ms", type=float, default=None, metavar="MS",
                       help="cut each step's token budget to what the last steps' times say "
                            "ends within MS milliseconds (at most --max-num-batched-tokens): a "
                            "floor for first-token and inter-token latency under load, at some "
                            "throughput; off by default")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=None)
    cache.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction, default=None,
                       help="a model mixing global and sliding-window layers (Gemma 3): keep every "
                            "block of every layer in one pool, as vLLM's flag")
    cache.add_argument("--speculative-config", "-sc", default=None, metavar="JSON",
                       help='speculative decoding, as vLLM: \'{"method": "ngram", '
                            '"num_speculative_tokens": 4}\' or \'{"model": "PATH", '
                            '"num_speculative_tokens": 3}\'')
    cache.add_argument("--watermark-config", default=None, metavar="JSON",
                       help='vLLM\'s text watermark: \'{"algorithm": "gumbel", "key": 42}\' (keys: '
                            'algorithm gumbel|dual_key_gumbel, key, alpha, context_width, '
                            'deduplicate_contexts, deduplicate_contexts_max_history, prf); sampled '
                            'requests carry it unless they send "watermarking": false '
                            '(pagoda.watermark.WatermarkDetector finds it)')
    cache.add_argument("--spec-method", default=None, help="vLLM's shorthand: speculative_config's method")
    cache.add_argument("--spec-model", default=None, help="vLLM's shorthand: speculative_config's model")
    cache.add_argument("--spec-tokens", type=int, default=None,
                       help="vLLM's shorthand: speculative_config's num_speculative_tokens")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group("parallelism (torch.distributed; docs/scaling.md)")
    parallel.add_argument("-tp", "--tensor-parallel-size", type=int, default=None,
                          help="ranks sharing each layer; must divide the head counts")
    parallel.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None,
                          help="pipeline stages, each a contiguous share of the layers")
    parallel.add_argument("--nnodes", "-n", type=int, default=None,
                          help="machines the ranks spread over (default 1)")
    parallel.add_argument("--node-rank", "-r", type=int, default=None,
                          help="this machine's index; node 0 runs the server")
    parallel.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                          help="node 0's rendezvous address (needed with --nnodes > 1)")
    parallel.add_argument("--master-addr", default=None, metavar="HOST",
                          help="vLLM's spelling of node 0's address: --dist-init-addr HOST:PORT "
                               "with --master-port (default 29501)")
    parallel.add_argument("--master-port", type=int, default=None, metavar="PORT",
                          help="vLLM's spelling of the rendezvous port (with --master-addr)")
    parallel.add_argument("--headless", action="store_true",
                          help="a node other than 0: run its ranks only, no server")
    parallel.add_argument("--core-process", action="store_true", default=None,
                          help="run the engine core (scheduler, KV pool, model) in a process of "
                               "its own, apart from the HTTP server (docs/architecture.md)")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters (pagoda/lora.py)")
    lora.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                      help="serve LoRA adapters beside the base model (TP/PP too: each rank its slice)")
    lora.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                      help="adapters the API answers to by name (a request's `model`): NAME=PATH "
                           "or vLLM's JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    lora.add_argument("--max-lora-rank", type=int, default=None,
                      help="the largest adapter rank served (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept loaded at once, the least recently used dropped (default 8)")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="the most distinct adapters running at once (vLLM's per-batch limit; "
                           "default: none, where vLLM's is 1)")


def runtime_lora_updating() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (or PAGODA_ALLOW_RUNTIME_LORA_UPDATING): serve the
    routes that load and unload adapters while running."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true")
               for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGODA_ALLOW_RUNTIME_LORA_UPDATING"))


def lora_modules(specs: list[str] | None, enable_lora: bool | None) -> dict[str, LoRARequest]:
    """`--lora-modules`' adapters by name (ids from 1 in their order).

    Raises:
        ValueError: a malformed entry, a name given twice, or adapters without --enable-lora.
    """
    if not specs:
        return {}
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    found: dict[str, LoRARequest] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            entry = json_object(spec, "--lora-modules")
            name, path = entry.get("name"), entry.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH or a JSON object with name and path")
        if name in found:
            raise ValueError(f"--lora-modules names {name!r} twice")
        found[str(name)] = LoRARequest(str(name), len(found) + 1, str(path))
    return found


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The per-request limits; each refusal is a clear 4xx (see docs/architecture.md)."""
    limits = parser.add_argument_group("limits (what one request may ask)")
    limits.add_argument("--max-queued-requests", type=positive_int, default=None, metavar="N",
                        help="sequences that may wait to be scheduled (n counts); beyond it "
                             "requests get 429 with Retry-After (default 1024)")
    limits.add_argument("--max-n", type=positive_int, default=None,
                        help="most samples per prompt (default: --max-num-seqs)")
    limits.add_argument("--max-prompt-chars", type=positive_int, default=None,
                        help="longest prompt text, checked before tokenizing "
                             "(default: 32 x max-model-len)")
    limits.add_argument("--max-stop-sequences", type=positive_int, default=None,
                        help="most stop strings, and most stop token ids (default 64)")
    limits.add_argument("--max-stop-str-chars", type=positive_int, default=None,
                        help="longest stop string (default 1024)")
    limits.add_argument("--max-logit-bias", type=positive_int, default=None,
                        help="most logit_bias entries per request (default 1024)")
    limits.add_argument("--max-guided-choices", type=positive_int, default=None,
                        help="most strings in a choice constraint (default 2048)")
    limits.add_argument("--max-grammar-bytes", type=positive_int, default=None,
                        help="longest grammar, regex or choice list, in bytes (default 65536)")
    limits.add_argument("--max-grammar-rules", type=positive_int, default=None,
                        help="most rules in a Lark or GBNF grammar (default 1000)")
    limits.add_argument("--max-schema-depth", type=positive_int, default=None,
                        help="deepest nesting of a JSON schema, in objects and lists (default 128)")
    limits.add_argument("--max-schema-properties", type=positive_int, default=None,
                        help="most properties in a JSON schema, all objects together (default "
                             "2048; its enum values count against --max-guided-choices)")
    limits.add_argument("--grammar-compile-workers", type=non_negative_int, default=None,
                        help="processes that compile grammars, so a grammar that crashes or "
                             "hangs the compiler costs one of them, not the server (default 2; "
                             "0 compiles in the server's process)")
    limits.add_argument("--grammar-compile-timeout", type=positive_seconds, default=None,
                        help="longest one grammar may take to compile, in seconds of wall-clock "
                             "and of CPU time (default 10)")
    limits.add_argument("--grammar-compile-memory", type=non_negative_int, default=None,
                        help="address-space limit of each grammar-compiling process, in MiB "
                             "(default 2048; 0: none)")
    limits.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                        help="most logprobs / prompt_logprobs per request (default 20, as vLLM; "
                             "-1: the whole vocabulary, which a request asks for with -1)")
    limits.add_argument("--logprobs-mode", default=None, choices=LOGPROBS_MODES,
                        help="what logprobs report (vLLM's): raw_logprobs (default: the model's), "
                             "raw_logits, processed_logprobs (of the distribution sampled from: "
                             "penalties, temperature, top-k/top-p/min-p applied) or processed_logits")
    limits.add_argument("--max-request-body-bytes", type=byte_size,
                        default=str(DEFAULT_MAX_REQUEST_BODY_BYTES),
                        help="larger bodies get 413 (default 16MiB)")


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's pair for `tool_choice="auto"`: both, or "auto" is a 400."""
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                       help='let tool_choice "auto" (and tools without a tool_choice) answer '
                            "freely, the calls taken out of the text by --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, metavar="{" + ",".join(TOOL_PARSERS) + "}",
                       help="the model's tool-call format: hermes (<tool_call> JSON: Qwen, "
                            "Hermes), llama3_json, mistral ([TOOL_CALLS]), pythonic "
                            "([f(x=1)]: Llama 3.2/4)")
    tools.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a reasoning model's <think>...</think> into the message's "
                            "`reasoning` (and `reasoning_content`): deepseek_r1 (R1, QwQ, "
                            "Qwen3 thinking models: all up to </think>), qwen3 (only an answer "
                            "that opens with <think>)")
    tools.add_argument("--reasoning-config", default=None, metavar="JSON",
                       help='vLLM\'s: {"reasoning_start_str": ..., "reasoning_end_str": ...}, what '
                            "opens a model's thinking and what is forced to close it when a "
                            "request's thinking_token_budget runs out (a transition phrase may "
                            "come before the end tag); unset ones are --reasoning-parser's tags")


def _table_flags(spec: str, why: str) -> list[tuple[str, str, str]]:
    """Table rows for flags sharing one reason: each name (its short spellings after "/", as
    "--data-parallel-rank/-dpn"), then "?" for a boolean flag or "*" for a list (a value otherwise)."""
    kinds = {"?": "bool", "*": "list"}
    return [(name.rstrip("?*").replace("/", " "), kinds.get(name[-1], "value"), why) for name in spec.split()]


def _refused_flags(spec: str, why: str) -> list[tuple[str, str, str | None, str]]:
    """Refused-flag rows sharing one reason, as `_table_flags`; "=VALUE" names the value that
    asks for nothing."""
    rows = []
    for token in spec.split():
        name, _, harmless = token.partition("=")
        flag, kind, _ = _table_flags(name, why)[0]
        rows.append((flag, kind, harmless or None, why))
    return rows


# vLLM flags that launch scripts pass and that mean nothing to pagoda: (flag, how it parses,
# why it has no effect). Each is accepted, and named in one log line at start when given.
NO_EFFECT_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--enforce-eager", "bool", "pagoda captures no CUDA graphs, so every step already runs eagerly"),
    ("--enable-prompt-tokens-details", "bool", "usage always carries prompt_tokens_details.cached_tokens"),
    ("--trust-remote-code", "bool", "pagoda runs its own code for each architecture it supports; a "
                                    "checkpoint's Python code is never executed"),
    ("--disable-log-requests", "bool", "requests are logged only with --enable-log-requests (vLLM's default)"),
    ("--disable-frontend-multiprocessing", "bool", "the API server and the engine core share one "
                                                   "process already, unless --core-process"),
    ("--disable-custom-all-reduce", "bool", "tensor parallelism reduces with torch.distributed"),
    ("--disable-async-output-proc", "bool", "outputs are processed once per step in the engine loop"),
    ("--async-scheduling", "bool", "the engine loop schedules each step after the last one's outputs"),
    ("--enable-chunked-prefill", "bool", "prefills are always chunked under --max-num-batched-tokens"),
    ("--swap-space", "value", "preempted requests are recomputed, never swapped to host memory"),
    ("--max-seq-len-to-capture", "value", "pagoda captures no CUDA graphs"),
    ("--cuda-graph-sizes", "list", "pagoda captures no CUDA graphs"),
    ("--max-cudagraph-capture-size", "value", "pagoda captures no CUDA graphs"),
    ("--compilation-config -cc -O", "value", "pagoda compiles no graphs (no torch.compile, no CUDA graphs)"),
    ("--disable-cascade-attn", "bool", "pagoda has no cascade attention"),
    ("--attention-backend", "value", "the attention backend follows the device: the native CPU "
                                     "kernels where they load, else torch's"),
    ("--model-impl", "value", "pagoda runs its own implementation of each architecture"),
    ("--guided-decoding-backend", "value", "structured outputs always compile with llguidance"),
    ("--distributed-executor-backend", "value", "parallel workers are torch.distributed processes "
                                                "(docs/scaling.md)"),
    ("--tokenizer-mode", "value", "the model's own tokenizer is used (tokenizer.json, or the GGUF's)"),
    ("--load-format", "value", "the format follows the model path (an HF directory or a .gguf file)"),
    ("--download-dir", "value", "pagoda loads local models and aliases, never downloads"),
    ("--revision", "value", "pagoda loads local models and aliases, never downloads"),
    ("--tokenizer-revision", "value", "pagoda loads local models and aliases, never downloads"),
    ("--hf-token", "value", "pagoda loads local models and aliases, never downloads"),
    ("--use-tqdm-on-load", "bool", "weights load without a progress bar"),
    ("--max-parallel-loading-workers", "value", "weights load in one pass"),
    ("--limit-mm-per-prompt", "value", "pagoda serves text-only models"),
    ("--mm-processor-kwargs", "value", "pagoda serves text-only models"),
    ("--disable-mm-preprocessor-cache", "bool", "pagoda serves text-only models"),
    ("--preemption-mode", "value", "a preempted request is always recomputed, never swapped"),
    ("--prefix-caching-hash-algo", "value", "prefix-cache blocks are keyed by pagoda's own chained "
                                            "hashes of their token ids"),
    ("--task", "value", "one server both generates and pools (embeddings, pooling, score, rerank)"),
    ("--runner", "value", "one server both generates and pools (embeddings, pooling, score, rerank)"),
    ("--language-model-only", "bool", "pagoda serves text-only models: only a language model loads"),
    ("--mm-processor-cache-gb", "value", "pagoda serves text-only models"),
    ("--mm-processor-cache-type", "value", "pagoda serves text-only models"),
    ("--mm-encoder-tp-mode", "value", "pagoda serves text-only models"),
    ("--media-io-kwargs", "value", "pagoda serves text-only models"),
    ("--allowed-local-media-path", "value", "pagoda serves text-only models"),
    ("--allowed-media-domains", "list", "pagoda serves text-only models"),
    ("--interleave-mm-strings", "bool", "pagoda serves text-only models"),
    ("--skip-mm-profiling", "bool", "pagoda serves text-only models"),
    ("--trust-request-mm-kwargs", "bool", "pagoda serves text-only models"),
    ("--numa-bind", "bool", "pagoda binds neither memory nor threads to NUMA nodes; run it under "
                            "numactl to bind it"),
    ("--numa-bind-nodes", "list", "pagoda binds neither memory nor threads to NUMA nodes; run it under "
                                  "numactl to bind it"),
    ("--numa-bind-cpus", "list", "pagoda binds neither memory nor threads to NUMA nodes; run it under "
                                  "numactl or taskset to bind it"),
    ("--enable-expert-parallel -ep", "bool", "mixture-of-experts layers split every expert across the "
                                             "tensor-parallel ranks (the same outputs)"),
    ("--enable-eplb", "bool", "pagoda has no expert parallelism to balance"),
    ("--safetensors-load-strategy", "value", "weights load in one pass"),
    ("--model-loader-extra-config", "value", "weights load in one pass, with no loader options"),
    ("--ignore-patterns", "list", "pagoda reads only the checkpoint's safetensors (or the GGUF file)"),
    ("--pt-load-map-location", "value", "weights load onto the serving device"),
    ("--show-hidden-metrics-for-version", "value", "none of pagoda's metrics is hidden"),
    ("--kv-cache-metrics", "bool", "the KV cache's usage and prefix-cache metrics are always exported "
                                   "(no sampled block-residency metrics)"),
    ("--cudagraph-metrics", "bool", "pagoda captures no CUDA graphs"),
    ("--cudagraph-capture-sizes", "list", "pagoda captures no CUDA graphs"),
    ("--mamba-cache-dtype", "value", "pagoda runs no Mamba models"),
    ("--mamba-ssm-cache-dtype", "value", "pagoda runs no Mamba models"),
    ("--mamba-block-size", "value", "pagoda runs no Mamba models"),
    ("--optimization-level", "value", "pagoda compiles no graphs (no torch.compile, no CUDA graphs)"),
    ("--performance-mode", "value", "pagoda has one performance mode"),
    ("--structured-outputs-config", "value", "structured outputs always compile with llguidance, in "
                                             "the grammar sandbox (--grammar-compile-*)"),
    ("--attention-config -ac", "value", "the attention backend follows the device"),
    ("--kernel-config", "value", "pagoda picks its CPU kernels by measurement at load"),
    ("--additional-config", "value", "pagoda has no platform plugins to configure"),
    ("--aggregate-engine-logging", "bool", "one engine logs its stats"),
    *_table_flags("--moe-backend --linear-backend --sparse-indexer-topk-backend --gdn-prefill-backend --kda-prefill-backend --kda-decode-backend --enable-flashinfer-autotune? --ir-op-priority --enable-flash-late-interaction?",
                  "pagoda runs its own CPU kernels, picked by measurement at load: no GPU kernel backends to choose"),
    *_table_flags("--all2all-backend --enable-dbo? --ubatch-size --dbo-decode-token-threshold --dbo-prefill-token-threshold --eplb-config --expert-placement-strategy --enable-ep-weight-filter?",
                  "pagoda has no expert parallelism: mixture-of-experts layers split across the tensor-parallel ranks"),
    *_table_flags("--dcp-comm-backend --dcp-q-replicate? --dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size",
                  "pagoda has no context parallelism"),
    *_table_flags("--mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path --mm-encoder-fp8-scale-save-margin --video-pruning-rate --video-pruning-method --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb --mm-device-do-normalize? --disable-chunked-mm-input?",
                  "pagoda serves text-only models"),
    *_table_flags("--mamba-backend --mamba-ssu-algorithm --enable-mamba-cache-stochastic-rounding? --mamba-cache-philox-rounds --mamba-cache-mode --enable-mamba-shared-prefix-checkpoint? --replayssm-buffer-len --use-replayssm?",
                  "pagoda runs no Mamba models"),
    *_table_flags("--kv-offloading-backend --offload-backend --cpu-offload-params* --offload-group-size --offload-num-in-group --offload-prefetch-step --offload-params*",
                  "neither weights nor the KV cache are offloaded (--cpu-offload-gb and --kv-offloading-size are refused)"),
    *_table_flags("--sleep-mode-offload-cudagraph? --sleep-preserve-parameter-names*",
                  "sleep mode is not supported (--enable-sleep-mode is refused)"),
    *_table_flags("--enable-cumem-allocator? --enable-nccl-comm-suspend? --enable-layerwise-nvtx-tracing?",
                  "pagoda uses torch's own allocator and torch.distributed, with no CUDA-specific tracing"),
    *_table_flags("--safetensors-prefetch-num-threads --safetensors-prefetch-block-size --code-revision --config-format --allow-deprecated-quantization?",
                  "weights load in one pass from local files (config.json or the GGUF's metadata), never downloaded"),
    *_table_flags("--distributed-timeout-seconds --cpu-distributed-timeout-seconds --ray-workers-use-nsight?",
                  "parallel workers are torch.distributed processes with torch's own timeouts, no Ray"),
    *_table_flags("--data-parallel-supervisor-port --dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold --dp-sync-interval --disable-nccl-for-dp-synchronization? --elastic-ep-max-dp-size",
                  "one server is one engine (no data-parallel supervisor)"),
    *_table_flags("--cohere-is-reasoning-model? --cohere-format",
                  "pagoda serves no Cohere routes"),
    ("--anthropic-disabled-thinking-effort", "value", "/v1/messages maps thinking.type disabled to "
                                                       "reasoning_effort none"),
    *_table_flags("--kv-cache-metrics-sample --jit-monitor-mode --jit-monitor-verbose? --fail-on-environ-validation?",
                  "pagoda has no such monitor (no sampled KV residency metrics, no JIT at serve time, no VLLM_* environment)"),
    *_table_flags("--enable-hc-sp? --engram-config --swa-bounded-replay? --kv-sharing-fast-prefill? --prefix-cache-retention-interval",
                  "pagoda runs none of the models these serve (HyperConnection, n-gram embeddings, "
                  "DeepSeek-V4.1's bounded replay, YOCO KV sharing, Mamba checkpoints)"),
    *_table_flags("--enable-shm-tensor-arena? --ec-manager-config", "pagoda serves text-only models"),
    ("--enable-batch-sharded-sampling", "bool", "with tensor parallelism the last rank samples the whole "
                                                "batch and sends token ids"),
    ("--prefill-schedule-interval", "value", "one server is one engine (no data-parallel ranks to align)"),
    ("--prefix-match-unit", "value", "prefix-cache hits land on whole KV blocks (--block-size)"),
    ("--long-prefill-token-threshold-adaptive", "bool", "the scheduler already shares each step's "
                                                        "prefill budget between requests (fair admission)"),
    ("--renderer-num-workers", "value", "chat templates and tokenizing run on the server's thread pool"),
    ("--enable-offline-docs", "bool", "/docs loads FastAPI's page assets from their CDN as usual "
                                      "(no vendored copy); --disable-fastapi-docs turns it off"),
    *_table_flags("--fingerprint-mode --fingerprint-value", "responses carry no system_fingerprint (as vLLM's "
                                                            "--fingerprint-mode none)"),
    ("--enable-logging-iteration-details", "bool", "the stats log gives steps' throughput every interval; "
                                                   "per-step figures are on /metrics"),
)

# vLLM flags for features pagoda does not have: given with a value that asks for the feature,
# the server refuses to start and says so (rather than "unrecognized arguments", or silently
# serving without it). (flag and its short spellings, how it parses, the value that asks for
# nothing, why)
UNSUPPORTED_FLAGS: tuple[tuple[str, str, str | None, str], ...] = (
    ("--data-parallel-size -dp", "value", "1", "one server is one engine; for data parallelism run "
                                               "replicas behind a load balancer (docs/scaling.md)"),
    ("--api-server-count -asc", "value", "1", "one API server process serves each engine"),
    ("--cpu-offload-gb", "value", "0", "weights are not offloaded"),
    ("--enable-sleep-mode", "bool", None, "sleep mode (releasing the weights and the KV pool) is "
                                          "not supported"),
    ("--enable-prompt-embeds", "bool", None, "prompts are text or token ids; embeddings as prompts "
                                             "are not supported"),
    ("--logits-processors", "list", None, "custom logits processors are not supported"),
    ("--kv-transfer-config", "value", None, "KV transfer between instances is not supported"),
    ("--fully-sharded-loras", "bool", None, "LoRA adapters are served in one process (no tensor "
                                            "parallelism to shard them over)"),
    ("--lora-target-modules", "list", None, "each adapter adapts the modules its adapter_config.json "
                                            "names; restricting them is not supported"),
    ("--uds", "value", None, "the server listens on TCP (--host, --port), not on a Unix socket"),
    ("--grpc", "bool", None, "the server speaks HTTP only"),
    ("--otlp-traces-endpoint", "value", None, "OpenTelemetry tracing is not supported"),
    ("--collect-detailed-traces", "list", None, "OpenTelemetry tracing is not supported"),
    ("--disable-sliding-window", "bool", None, "sliding-window layers always attend within their "
                                               "window, as the model was trained"),
    ("--skip-tokenizer-init", "bool", None, "the tokenizer always loads (prompts may still be token ids)"),
    ("--scheduler-cls", "value", None, "the scheduler is pagoda's own"),
    ("--worker-extension-cls", "value", None, "workers take no extension classes"),
    ("--kv-offloading-size", "value", None, "the KV cache is not offloaded"),
    ("--kv-events-config", "value", None, "KV cache events are not published"),
    ("--worker-cls", "value", "auto", "workers are pagoda's own"),
    *_refused_flags("--data-parallel-rank/-dpn=0 --data-parallel-start-rank/-dpr=0 --data-parallel-size-local/-dpl=1 --data-parallel-address/-dpa --data-parallel-rpc-port/-dpp --data-parallel-backend/-dpb=mp --data-parallel-hybrid-lb/-dph? --data-parallel-external-lb/-dpe? --data-parallel-multi-port-external-lb/-dpm? --enable-elastic-ep?",
                  "one server is one engine; for data parallelism run replicas behind a load balancer (docs/scaling.md)"),
    *_refused_flags("--decode-context-parallel-size/-dcp=1 --prefill-context-parallel-size/-pcp=1",
                  "context parallelism is not supported"),
    *_refused_flags("--lora-dtype=auto --enable-tower-connector-lora? --default-mm-loras --specialize-active-lora? --enable-mixed-moe-lora-format? --enable-moe-shared-loras? --max-lora-cls-labels",
                  "only text LoRA adapters in the model's dtype are served (--enable-lora)"),
    *_refused_flags("--tool-parser-plugin --reasoning-parser-plugin --io-processor-plugin --model-class-overrides",
                  "plugins are not loaded: parsers and models are pagoda's own (--tool-call-parser, --reasoning-parser)"),
    ("--diffusion-config -dc", "value", None, "pagoda serves no diffusion language models"),
    ("--kv-cache-dtype-skip-layers", "list", None, "the fp8 KV cache covers every layer"),
    ("--aux-output-config", "value", None, "responses carry no auxiliary outputs (routed experts)"),
    *_refused_flags("--enable-per-request-metrics? --per-request-spec-decode-metrics=none",
                    "responses carry no per-request metrics (they are on /metrics)"),
    ("--enable-mfu-metrics", "bool", None, "model FLOPs utilization metrics are not exported"),
    ("--use-fp64-gumbel", "bool", None, "sampling draws fp32 exponential noise"),
    ("--tool-strict-level", "value", "auto", "tool calls are constrained by tool_choice (required or "
                                             "named), per request"),
    ("--logging-config", "value", None, "use --log-level and --log-config-file"),
    *_refused_flags("--tool-server --grpc-port --enable-ssl-refresh? --hf-config-path --quantization-config --enable-return-routed-experts? --return-sampling-mask? --enable-trace-replay? --device-ids --enable-fault-tolerance? --fault-tolerance-config --ec-transfer-config --weight-transfer-config --convert=auto --profiler-config --pooler-config --enable-mm-embeds? --mm-encoder-only? --max-num-queued-reqs --max-num-queued-tokens --sse-keep-alive-interval=0 --h11-max-header-count=256",
                  "not supported by pagoda"),
)


def add_no_effect_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("accepted for vLLM launch scripts, no effect here (logged at start)")
    for flag, kind, why in NO_EFFECT_FLAGS:
        _add_table_flag(group, flag, kind, why)


def add_unsupported_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM features pagoda lacks (refused at start when asked for)")
    for flag, kind, harmless, why in UNSUPPORTED_FLAGS:
        _add_table_flag(group, flag, kind, why + (f" (only {harmless} is accepted)" if harmless else ""))


def _add_table_flag(group: Any, flag: str, kind: str, text: str) -> None:
    """One flag of the tables above (its name, then any short spellings): "bool" (--x / --no-x,
    as vLLM's boolean flags), "value" or "list" (one value or several)."""
    names = flag.split()
    if kind == "bool":
        group.add_argument(*names, action=argparse.BooleanOptionalAction, default=None, help=text)
    else:
        group.add_argument(*names, default=None, metavar="VALUE", nargs="+" if kind == "list" else None,
                           help=text)


def _flag_value(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag.split()[0].lstrip("-").replace("-", "_"), None)


def vllm_spelling(argv: list[str]) -> list[str]:
    """vLLM's parser's spelling rules: an option named with underscores (`--max_model_len`,
    `--max_model_len=512`) is the dashed one; a JSON config flag may come key by key
    (`--compilation-config.mode 3`, `--structured-outputs-config.backend=xgrammar`, a `+` after
    the key for a comma-separated list), the keys merged into one JSON object as vLLM merges
    them. Values are left as they are."""
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            rest = argv[i - 1:]
            break
        key, sep, value = arg.partition("=")
        name, dot, path = key.partition(".")
        if not arg.startswith("--"):
            out.append(arg)
        elif not dot:
            out.append(key.replace("_", "-") + sep + value)
        elif not path or (not sep and i >= len(argv)):
            out.append(arg)  # NOTE: not a key, or no value: argparse names it
        else:
            if not sep:
                value, i = argv[i], i + 1
            _merge_dotted(dotted.setdefault(name.replace("_", "-"), {}), path, value)
    for name, tree in dotted.items():
        out += [name, json.dumps(tree)]
    return out + rest


def _merge_dotted(tree: dict[str, Any], path: str, text: str) -> None:
    """One `--flag.a.b VALUE` into the flag's tree: the value as JSON where it parses (a number,
    true, a list), else a size such as 80g, else the text; `a.b+` splits it at commas."""
    keys = path.split(".")
    value: Any
    if keys[-1].endswith("+"):
        keys[-1], value = keys[-1][:-1], text.split(",")
    else:
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = human_int(text)
            except argparse.ArgumentTypeError:
                value = text
    for key in keys[:-1]:
        if not isinstance(tree.get(key), dict):
            tree[key] = {}
        tree = tree[key]
    tree[keys[-1]] = value


def unsupported_flag_error(args: argparse.Namespace) -> str | None:
    """Why the server cannot start as asked, for the first unsupported feature asked for."""
    for flag, _, harmless, why in UNSUPPORTED_FLAGS:
        value = _flag_value(args, flag)
        if value in (None, False, "", harmless) or (harmless is not None and _same_number(value, harmless)):
            continue
        return f"{flag.split()[0]}: {why}"
    return None


def _same_number(value: str, expected: str) -> bool:
    try:
        return float(value) == float(expected)
    except ValueError:
        return False


def no_effect_lines(args: argparse.Namespace) -> list[str]:
    """One line for each no-effect vLLM flag given, saying why it changes nothing."""
    lines = []
    for flag, _, why in NO_EFFECT_FLAGS:
        value = _flag_value(args, flag)
        if value is None:
            continue
        name = flag.split()[0]
        shown = name if value is True else f"--no-{name[2:]}" if value is False else f"{name} {value}"
        lines.append(f"{shown}: accepted for vLLM launch scripts, no effect here: {why}")
    return lines


def cors_policy(args: argparse.Namespace) -> CorsPolicy | None:
    """The CORS policy the flags ask for; None without --allowed-origins."""
    if args.allowed_origins is None:
        return None
    return CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                      args.allow_credentials)


def request_logger(args: argparse.Namespace) -> RequestLogger | None:
    """vLLM's request log, None without --enable-log-requests.

    Raises:
        ValueError: --enable-log-outputs without --enable-log-requests (vLLM's rule).
    """
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs requires --enable-log-requests")
    if not args.enable_log_requests:
        return None
    return RequestLogger(args.max_log_len, args.enable_log_outputs, args.enable_log_deltas)


def auto_tool_parser(args: argparse.Namespace) -> ToolParser | None:
    """The parser of tool_choice "auto", None without --enable-auto-tool-choice (as vLLM,
    --tool-call-parser alone changes nothing).

    Raises:
        ValueError: the flag without a parser, or a parser name nobody registered.
    """
    if not args.enable_auto_tool_choice:
        return None
    if args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return get_tool_parser(args.tool_call_parser)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `serve` to the top-level CLI's subparsers; dispatch with `run_serve(args)`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible server",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM-style flags).")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


def resolve_model(args: argparse.Namespace) -> str:
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return str(args.model or args.model_tag or DEFAULT_MODEL)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {key: getattr(args, dest) for dest, key in ENGINE_FLAGS.items()
              if getattr(args, dest, None) is not None}
    if args.disable_log_stats:
        kwargs["log_stats"] = False
    shorthand = {key: value for key, value in (("method", args.spec_method), ("model", args.spec_model),
                                                ("num_speculative_tokens", args.spec_tokens)) if value is not None}
    if shorthand:
        spec = json_object(args.speculative_config or {}, "--speculative-config")
        if clash := sorted(set(shorthand) & set(spec)):
            raise ValueError(f"--spec-* and --speculative-config both give {clash}; give each once")
        kwargs["speculative_config"] = {**spec, **shorthand}
    if "dist_init_addr" not in kwargs and (args.master_addr or args.master_port):
        kwargs["dist_init_addr"] = f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29501}"
    reasoning = reasoning_config(args.reasoning_parser, args.reasoning_config)
    if reasoning is not None:
        kwargs["reasoning_config"] = reasoning
    rope = {key: value for key, value in (("rope_scaling", args.rope_scaling), ("rope_theta", args.rope_theta))
            if value is not None}
    if rope:
        kwargs["hf_overrides"] = {**rope, **kwargs.get("hf_overrides", {})}
    return kwargs


def reasoning_config(parser: str | None, flag: str | None) -> ReasoningConfig | None:
    """The engine's reasoning markers (vLLM's `--reasoning-config`, its unset strings filled with
    the reasoning parser's tags, which also end a section the model closes itself)."""
    config = ReasoningConfig.parse(flag) if flag is not None else None
    if parser is None:
        return config
    config = config or ReasoningConfig()
    return dataclasses.replace(config, reasoning_start_str=config.reasoning_start_str or REASONING_START,
                               reasoning_end_str=config.reasoning_end_str or REASONING_END,
                               natural_end_str=config.natural_end_str or REASONING_END)


def import_middleware(path: str) -> Any:
    """`--middleware`'s object: a class or an async function, by its import path.

    Raises:
        ValueError: not importable, or neither a class nor an async function.
    """
    import importlib
    import inspect

    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {path}: cannot import it ({e})") from e
    if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
        raise ValueError(f"--middleware {path}: expected an ASGI middleware class or an async function "
                         "(request, call_next)")
    return obj


def add_middlewares(app: Any, middlewares: list[Any]) -> None:
    """Adds `--middleware`'s objects in their order: classes as ASGI middleware, functions as
    HTTP middleware (vLLM's rule)."""
    import inspect

    for obj in middlewares:
        if inspect.isclass(obj):
            app.add_middleware(obj)
        else:
            app.middleware("http")(obj)


def uvicorn_tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's TLS and h11 flags as uvicorn.Config's keywords (those given)."""
    kwargs: dict[str, Any] = {"ssl_cert_reqs": args.ssl_cert_reqs}
    if args.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = args.ssl_ca_certs
    if args.ssl_ciphers:
        kwargs["ssl_ciphers"] = args.ssl_ciphers
    if args.h11_max_incomplete_event_size is not None:
        # NOTE: a limit of h11's parser: given, the server takes h11 over httptools (uvicorn's
        # choice where httptools is installed), which would not apply it.
        kwargs["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
        kwargs["http"] = "h11"
    return kwargs


class AccessLogFilter(logging.Filter):
    """Drops uvicorn's access-log lines for some paths (`--disable-access-log-for-endpoints`):
    a record's args are (client, method, path with any query, HTTP version, status)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = set(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).split("?", 1)[0] not in self.paths


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key's keys and PAGODA_API_KEY's; vLLM's VLLM_API_KEY where no --api-key is given
    (vLLM's rule: the flag takes precedence)."""
    keys = list(args.api_key or []) or [os.environ.get("VLLM_API_KEY", "")]
    keys.append(os.environ.get("PAGODA_API_KEY", ""))
    return [k for k in keys if k]


def run_serve(args: argparse.Namespace) -> int:
    """Validates the flags, loads the model, serves until SIGTERM; returns the exit code."""
    try:
        model = resolve_model(args)
        config = EngineConfig.from_kwargs(model, **engine_kwargs(args))
        auto_tool_parser(args)
        request_logger(args)
        middlewares = [import_middleware(path) for path in args.middleware]
        if (refused := unsupported_flag_error(args)) is not None:
            raise ValueError(refused)
    except ValueError as e:
        print(f"pagoda serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.log_level:
        logging.getLogger("pagoda").setLevel(args.log_level.upper())
    if args.log_config_file and (problem := apply_log_config(args.log_config_file)) is not None:
        print(f"pagoda serve: error: --log-config-file {args.log_config_file}: {problem}", file=sys.stderr)
        return 2
    for line in no_effect_lines(args):
        logger.info("%s", line)
    if args.headless or config.parallel.node_rank > 0:
        from pagoda.executor import run_headless

        return run_headless(config)
    return run_event_loop(_serve(args, model, config, middlewares))


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Runs the server's coroutine on uvloop where it is installed (as vLLM does), else asyncio's
    own loop. With uvloop (and httptools, which uvicorn then takes for HTTP/1.1 on its own) a
    streamed token costs the server's thread about half the Python work (docs/performance.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def apply_log_config(path: str) -> str | None:
    """Applies a JSON logging configuration (dictConfig); returns what is wrong with it, if anything."""
    import logging.config

    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            return "expected a JSON object (a logging.config.dictConfig dictionary)"
        logging.config.dictConfig(config)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as e:
        return str(e) or type(e).__name__
    return None


def _load_engine(model: str, config: EngineConfig, name: str, args: argparse.Namespace,
                 live: LiveStatLogger | None = None) -> Any:
    from pagoda.async_engine import AsyncLLM

    loggers = default_stat_loggers(name, config, live, args.custom_histogram_buckets)
    return AsyncLLM.from_engine_args(model=model, stat_loggers=loggers,
                                     stall_timeout=args.engine_stall_timeout,
                                     **engine_kwargs(args))


async def _serve(args: argparse.Namespace, model: str, config: EngineConfig,
                 middlewares: list[Any] | None = None) -> int:
    names = args.served_model_name or [model]
    try:
        loras = lora_modules(args.lora_modules, args.enable_lora)
    except ValueError as e:
        print(f"pagoda serve: error: {e}", file=sys.stderr)
        return 1
    try:
        for lora in loras.values():  # NOTE: a missing or too-large adapter is refused before the model loads
            check_adapter(lora, config.lora.max_lora_rank)
    except (ValueError, OSError) as e:
        print(f"pagoda serve: error: --lora-modules: {e}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    live = LiveStatLogger()
    try:
        engine = _load_engine(model, config, names[0], args, live)
    except (ValueError, OSError) as e:
        print(f"pagoda serve: error: cannot load {model!r}: {e}", file=sys.stderr)
        return 1
    try:
        for lora in loras.values():  # NOTE: as vLLM: every --lora-modules adapter loads before serving
            await engine.add_lora(lora)
    except (ValueError, OSError) as e:
        engine.shutdown()
        print(f"pagoda serve: error: --lora-modules: {e}", file=sys.stderr)
        return 1
    try:
        ctx = ServerContext(engine=engine, served_model_names=names, model_path=model, lora_requests=loras,
                            max_model_len=engine.config.model.max_model_len,
                            chat_template=load_chat_template(config.model.chat_template),
                            chat_template_content_format=args.chat_template_content_format,
                            trust_request_chat_template=args.trust_request_chat_template,
                            default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                            response_role=args.response_role,
                            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                            enable_server_load_tracking=args.enable_server_load_tracking,
                            enable_scale_out=args.enable_scale_out or args.tokens_only,
                            tokens_only=args.tokens_only,
                            enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
                            force_include_usage=args.enable_force_include_usage,
                            tool_parser=auto_tool_parser(args),
                            reasoning_parser=(get_reasoning_parser(args.reasoning_parser)
                                              if args.reasoning_parser else None),
                            api_keys=api_keys(args),
                            max_request_body_bytes=parse_bytes(args.max_request_body_bytes),
                            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                            request_logger=request_logger(args),
                            response_store=ResponseStore(args.responses_store_size),
                            generation_defaults=engine.generation_defaults)
        if ctx.generation_defaults.params:
            logger.info("Using default sampling params from %s: %s",
                        ctx.generation_defaults.source, ctx.generation_defaults.params)
        logger.info("engine ready in %.1f s (max_model_len %d)", time.perf_counter() - started,
                    ctx.max_model_len)
        logger.info("%s", format_kv_memory_report(engine.kv_report()))
        app = build_app(ctx, live, web_ui=not args.disable_web_ui,
                        request_id_headers=args.enable_request_id_headers,
                        api_docs=not args.disable_fastapi_docs, cors=cors_policy(args),
                        log_error_stack=args.log_error_stack, runtime_lora=runtime_lora_updating(),
                        root_path=args.root_path or "")
        add_middlewares(app, middlewares or [])
        quiet_paths = [p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()]
        if quiet_paths:
            logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(quiet_paths))
        uv_config = uvicorn.Config(app, host=args.host, port=args.port,
                                   log_level=args.uvicorn_log_level, lifespan="off",
                                   access_log=not args.disable_uvicorn_access_log,
                                   timeout_graceful_shutdown=2,
                                   ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                   **uvicorn_tls_kwargs(args))
        server = DrainingServer(uv_config, ctx, args.drain_timeout)
        await server.serve()
    finally:
        engine.shutdown()
    if engine.dead_reason is not None and server.engine_died:
        logger.critical("exiting with status 1: the engine died (%s)", engine.dead_reason)
        return 1
    return 0


CUT_GRACE_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, drain_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None
        self.cut_at: float | None = None
        self.engine_died = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: uvicorn re-raises captured signals after serving, which would turn a clean
        # drain into death by SIGTERM; so nothing is captured here.
        if self.ctx.draining or not self.started:
            self.should_exit = True
            self.force_exit = self.ctx.draining
            return
        logger.info("received %s: draining %d request(s), up to %.0f s",
                    signal.Signals(sig).name, self.ctx.num_active_requests, self.drain_timeout)
        self.ctx.draining = True
        self.drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.ctx.engine.dead_reason is not None and not self.engine_died:
            # NOTE: fail loudly: a supervisor (systemd, Kubernetes) restarts a process that
            # exits; one that answers 503 forever needs a human.
            logger.critical("the engine loop died (%s); stopping the server",
                            self.ctx.engine.dead_reason)
            self.engine_died = self.should_exit = True
        if self.drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self.drain_started
            if self.ctx.num_active_requests == 0 or (self.cut_at is not None
                                                     and time.monotonic() - self.cut_at > CUT_GRACE_S):
                logger.info("drained after %.1f s; %d request(s) left", waited,
                            self.ctx.num_active_requests)
                self.should_exit = True
            elif waited > self.drain_timeout and self.cut_at is None:
                # NOTE: the open streams end with an error event and [DONE] (non-streamed
                # requests with a 503) before the server stops, so that no cut answer passes
                # for a finished one; uvicorn gets CUT_GRACE_S to write them.
                self.ctx.engine.cut_streams(f"the server is shutting down (--drain-timeout {self.drain_timeout:g} s "
                                            "expired)")
                self.cut_at = time.monotonic()
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            web_ui = bool(getattr(getattr(self.config.app, "state", None), "web_ui", False))
            docs = getattr(self.config.app, "docs_url", None) is not None
            print(banner(self.config.host, self.config.port, self.ctx, web_ui, docs), flush=True)


def banner(host: str, port: int, ctx: ServerContext, web_ui: bool = False, docs: bool = True) -> str:
    shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    url = f"http://{shown}:{port}"
    auth = " -H 'Authorization: Bearer $PAGODA_API_KEY'" if ctx.api_keys else ""
    body = json.dumps({"model": ctx.model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    links = ", ".join(([f"web page: {url}/"] if web_ui else []) + ([f"docs: {url}/docs"] if docs else []))
    return (f"pagoda is serving {ctx.model_name!r} at {url}/v1{f' ({links})' if links else ''}\n"
            f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")
