"""`pagoda bench serve` from the command line: vLLM's flags -> workload + settings -> result.

The flags are `vllm bench serve`'s, so a vLLM user's scripts keep working; options vLLM has
that pagoda does not (multimodal datasets, LoRA, profiling) are simply absent. `--preset`
picks one of the brief's workloads (`datasets.PRESETS`); a flag given on the command line wins
over the preset, which wins over the defaults (`DEFAULTS`): workload flags parse to None
until `apply_preset` fills them in. A saved result holds the summary figures; per-request
arrays only with `--save-detailed` (as vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx

from pagoda.bench.datasets import (
    PRESETS,
    SampleRequest,
    jsonl_requests,
    length_range,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
)
from pagoda.bench.endpoints import first_model_id
from pagoda.bench.report import summarize
from pagoda.bench.serving import (
    LoadSettings,
    benchmark_result,
    default_result_filename,
    make_client,
    print_result,
    run_benchmark,
    save_result,
)

DATASET_ALIASES = {"random": "random", "prefix_repetition": "prefix_repetition",
                   "shared-prefix": "prefix_repetition", "custom": "custom", "jsonl": "custom"}
# What a workload flag is when neither the command line nor a preset sets it (vLLM's defaults).
DEFAULTS: dict[str, Any] = {
    "dataset_name": "random", "num_prompts": 1000, "random_input_len": 1024,
    "random_output_len": 128, "random_range_ratio": 0.0, "random_prefix_len": 0,
    "prefix_repetition_prefix_len": 256, "prefix_repetition_suffix_len": 256,
    "prefix_repetition_num_prefixes": 10, "prefix_repetition_output_len": 128,
    "max_concurrency": None, "ignore_eos": False,
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags (the subset pagoda implements)."""
    add = parser.add_argument
    add("--backend", default="openai", choices=["openai", "openai-chat", "vllm"],
        help="openai: /v1/completions; openai-chat: /v1/chat/completions.")
    add("--base-url", default=None, help="Server base URL (overrides --host/--port).")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default=None,
        help="API path (default /v1/completions, or /v1/chat/completions for openai-chat).")
    add("--header", metavar="KEY=VALUE", nargs="*", default=None, help="Extra HTTP headers.")
    add("--model", default=None, help="Model name (default: the first of /v1/models).")
    add("--tokenizer", default=None, help="Tokenizer for prompts and counts (default: --model).")
    add("--label", default=None, help="Prefix of the result file name (default: --backend).")
    add("--seed", type=int, default=0)
    add("--preset", choices=sorted(PRESETS), default=None,
        help="a named workload: " + "; ".join(f"{name}: {p.models}" for name, p in PRESETS.items())
             + ". Flags given here override it.")
    _add_dataset_args(parser)
    _add_load_args(parser)
    _add_output_args(parser)


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    def add(flag: str, **kwargs: Any) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        kwargs.setdefault("help", "")
        kwargs["help"] += f" (default {DEFAULTS[dest]})"
        parser.add_argument(flag, default=None, **kwargs)

    add("--dataset-name", choices=sorted(DATASET_ALIASES))
    parser.add_argument("--dataset-path", default=None,
                        help="JSONL file of {\"prompt\": ...} (custom).")
    add("--num-prompts", type=int)
    parser.add_argument("--input-len", type=int, default=None, help="Sets --random-input-len.")
    parser.add_argument("--output-len", type=int, default=None,
                        help="Sets --random-output-len / --custom-output-len / "
                             "--prefix-repetition-output-len.")
    add("--random-input-len", type=int)
    add("--random-output-len", type=int)
    add("--random-range-ratio", type=float)
    add("--random-prefix-len", type=int)
    add("--prefix-repetition-prefix-len", type=int)
    add("--prefix-repetition-suffix-len", type=int)
    add("--prefix-repetition-num-prefixes", type=int)
    add("--prefix-repetition-output-len", type=int)
    parser.add_argument("--custom-output-len", type=int, default=256)


def _add_load_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--request-rate", type=float, default=float("inf"),
        help="Requests per second (Poisson arrivals); inf sends all at once.")
    add("--burstiness", type=float, default=1.0)
    add("--max-concurrency", type=int, default=None)
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
        help="Generate exactly the asked length (default: off, on with --preset).")
    add("--num-warmups", type=int, default=0)
    add("--ready-check-timeout-sec", type=int, default=600)
    add("--temperature", type=float, default=None, help="Default: greedy.")
    add("--top-p", type=float, default=None)
    add("--top-k", type=int, default=None)
    add("--min-p", type=float, default=None)
    add("--request-timeout", type=float, default=6 * 3600.0, help="Seconds per request.")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--percentile-metrics", default="ttft,tpot,itl,e2el")
    add("--metric-percentiles", default="99")
    add("--goodput", nargs="+", default=None, metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000.")
    add("--save-result", action="store_true")
    add("--save-detailed", action="store_true",
        help="Also save per-request arrays (latencies, ITLs, texts, errors).")
    add("--result-dir", default=None)
    add("--result-filename", default=None)
    add("--metadata", metavar="KEY=VALUE", nargs="*", default=None)
    add("--disable-tqdm", action="store_true")


def apply_preset(args: argparse.Namespace, keys: Any = DEFAULTS) -> argparse.Namespace:
    """Fills each workload flag in `keys` left unset (None): from --preset, else `DEFAULTS`."""
    preset = PRESETS[args.preset] if getattr(args, "preset", None) else None
    chosen = {**preset.dataset, "num_prompts": preset.num_prompts,
              "max_concurrency": preset.max_concurrency, "ignore_eos": True} if preset else {}
    for dest in keys:
        if getattr(args, dest, None) is None:
            setattr(args, dest, chosen.get(dest, DEFAULTS[dest]))
    return args


def _pairs(items: list[str] | None, sep: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, found, value = item.partition(sep)
        if not found:
            raise ValueError(f"expected KEY{sep}VALUE, got {item!r}.")
        out[key.strip()] = value.strip()
    return out


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def is_chat(args: argparse.Namespace) -> bool:
    return args.backend == "openai-chat" or (args.endpoint or "").endswith("chat/completions")


def build_settings(args: argparse.Namespace, model: str) -> LoadSettings:
    """LoadSettings from the parsed flags; `model` is the resolved model name."""
    chat = is_chat(args)
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "min_p": args.min_p}
    return LoadSettings(
        api_url=base_url_of(args) + endpoint, model=model, chat=chat,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=bool(args.ignore_eos),
        num_warmups=args.num_warmups, ready_check_timeout_s=args.ready_check_timeout_sec,
        seed=args.seed, extra_body={k: v for k, v in sampling.items() if v is not None},
        headers=_pairs(args.header, "="), disable_tqdm=args.disable_tqdm)


def build_requests(args: argparse.Namespace, tokenizer: Any,
                   num_prompts: int | None = None) -> list[SampleRequest]:
    """The workload the flags describe (deterministic for a given --seed)."""
    name = DATASET_ALIASES[args.dataset_name]
    num = num_prompts if num_prompts is not None else args.num_prompts
    if name == "random":
        in_len = args.input_len if args.input_len is not None else args.random_input_len
        out_len = args.output_len if args.output_len is not None else args.random_output_len
        return random_requests(tokenizer, num, length_range(in_len, args.random_range_ratio),
                               length_range(out_len, args.random_range_ratio), seed=args.seed,
                               prefix_len=args.random_prefix_len)
    if name == "prefix_repetition":
        out_len = args.output_len or args.prefix_repetition_output_len
        return shared_prefix_requests(tokenizer, num, args.prefix_repetition_num_prefixes,
                                      args.prefix_repetition_prefix_len,
                                      args.prefix_repetition_suffix_len, out_len, seed=args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl.")
    return jsonl_requests(tokenizer, args.dataset_path, num,
                          args.output_len or args.custom_output_len)


def resolve_model(args: argparse.Namespace) -> str:
    """--model, or the first model the server lists."""
    if args.model:
        return str(args.model)

    async def fetch() -> str:
        async with make_client(None, timeout_s=30.0) as client:
            return await first_model_id(client, base_url_of(args), _pairs(args.header, "="))

    try:
        return asyncio.run(fetch())
    except (httpx.HTTPError, RuntimeError) as exc:
        raise SystemExit(f"Cannot list the models at {base_url_of(args)}/v1/models ({exc}); "
                         "is the server up? Or pass --model.") from exc


def tokenizer_for(args: argparse.Namespace, model: str) -> Any:
    """The tokenizer named by --tokenizer (default: the model), with a hint when it fails."""
    name = args.tokenizer or model
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"Cannot load a tokenizer for {name!r} ({exc}); pass --tokenizer "
                         "with a Hugging Face folder, a .gguf file or 'smollm2'.") from exc


def percentile_args(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    return metrics, percentiles


def run_serve(args: argparse.Namespace, settings: LoadSettings, requests: list[SampleRequest],
              tokenizer: Any) -> dict[str, Any]:
    """Runs one benchmark and returns vLLM's result dict (printed, not saved)."""
    metrics, percentiles = percentile_args(args)
    goodput = {k: float(v) for k, v in _pairs(args.goodput, ":").items()} or None
    outputs, duration = asyncio.run(run_benchmark(settings, requests))

    result = benchmark_result(settings, outputs, duration, percentiles, token_counter(tokenizer), goodput)
    result["tokenizer_id"] = args.tokenizer or settings.model
    result["label"] = args.label
    result["preset"] = args.preset
    result.update(_pairs(args.metadata, "="))
    print_result(result, settings, metrics, percentiles)
    return result


def token_counter(tokenizer: Any) -> Any:
    """Counts a text's tokens (no special tokens), for servers that report no usage."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def main(args: argparse.Namespace) -> dict[str, Any]:
    """The `bench serve` handler."""
    apply_preset(args)
    model = resolve_model(args)
    tokenizer = tokenizer_for(args, model)
    settings = build_settings(args, model)
    result = run_serve(args, settings, build_requests(args, tokenizer), tokenizer)
    if args.save_result or args.result_filename:
        name = args.result_filename or default_result_filename(
            args.label or args.backend, settings, result["date"])
        saved = result if args.save_detailed else summarize(result)
        path = save_result(saved, f"{args.result_dir}/{name}" if args.result_dir else name)
        print(f"Saved result to {path}")
    return result

