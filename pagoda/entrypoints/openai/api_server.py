"""`python -m pagoda.entrypoints.openai.api_server --model MODEL [flags]`: vLLM's old entry
point, with the same flags as `pagoda serve`."""

from __future__ import annotations

import argparse
import sys

from pagoda.server.serve import add_serve_arguments, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.entrypoints.openai.api_server",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM-style flags).")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
