"""vLLM's `--config FILE.yaml`: a launch script's flags kept in a YAML file.

Each key is a flag's name and its value the flag's, as vLLM reads them: true gives `--key`,
false `--no-key` where the flag has that spelling (else nothing), a list `--key v1 v2 ...`, a
mapping its JSON (for the JSON-valued flags), anything else `--key value`. The file's flags go
right after `serve` and its positional model, so that the command line's own flags, parsed
later, win over the file's, and the file's over the defaults; a `model:` key serves as the model
when the command line names none.
"""

from __future__ import annotations

import json
from typing import Any


def expand_config_file(argv: list[str], negatable: set[str]) -> list[str]:
    """`serve ... --config FILE ...` with FILE's flags in its place (see the module's doc);
    other commands unchanged. `negatable`: the flags that have a `--no-` spelling.

    Raises:
        ValueError: two --config, none after it, a file that is not .yaml/.yml, cannot be read,
            or is not a mapping of flag names.
    """
    if not argv or argv[0] != "serve" or not any(_is_config(a) for a in argv):
        return argv
    found = [i for i, a in enumerate(argv) if _is_config(a)]
    if len(found) > 1:
        raise ValueError("--config: more than one config file given")
    index = found[0]
    if "=" in argv[index]:
        path, rest = argv[index].split("=", 1)[1], argv[index + 1:]
    elif index + 1 < len(argv):
        path, rest = argv[index + 1], argv[index + 2:]
    else:
        raise ValueError("--config: no file given")
    flags = config_flags(path, negatable)
    head = argv[1:index]
    model = head[:1] if head and not head[0].startswith("-") else []
    return ["serve", *model, *flags, *head[len(model):], *rest]


def config_flags(path: str, negatable: set[str]) -> list[str]:
    """The flags a YAML config file stands for, in its order."""
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config: {path!r} must be a .yaml or .yml file, as vLLM's")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config: Any = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config: cannot read {path!r}: {e}") from e
    if config is None:
        return []
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise ValueError(f"--config: {path!r} must be a mapping of flag names to values")
    out: list[str] = []
    for key, value in config.items():
        flag, negated = "--" + key, "--no-" + key.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else ([negated] if negated in negatable else [])
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _is_config(arg: str) -> bool:
    return arg == "--config" or arg.startswith("--config=")
