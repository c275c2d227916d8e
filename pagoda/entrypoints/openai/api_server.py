"""`python -m pagoda.entrypoints.openai.api_server --model MODEL [flags]`: vLLM's old entry
point, with the same flags as `pagoda serve` spelled every way `pagoda serve` takes them
(`--config FILE`, underscores, dotted config keys)."""

from __future__ import annotations

import argparse
import sys

from pagoda.server.config_file import expand_config_file
from pagoda.server.serve import add_serve_arguments, run_serve, vllm_spelling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.entrypoints.openai.api_server",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM-style flags).")
    add_serve_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    try:
        negatable = {o for o in parser._option_string_actions if o.startswith("--no-")}
        argv = expand_config_file(["serve", *argv], negatable)[1:]
    except ValueError as e:
        parser.error(str(e))
    return run_serve(parser.parse_args(vllm_spelling(argv)))


if __name__ == "__main__":
    sys.exit(main())
