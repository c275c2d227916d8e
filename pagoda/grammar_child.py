"""A grammar-compiling child process, and the grammar text every constraint becomes.

`grammar_text` turns one constraint (kind and spec, as `StructuredOutputsParams` holds them)
into llguidance's grammar text; the engine calls it in process or, through
`GrammarSandbox`, here. Run as a script, this file
is one sandbox worker (`python -I grammar_child.py MEMORY_MIB CPU_SECONDS [IMPORT_PATH]`,
IMPORT_PATH the parent's `sys.path` joined by `os.pathsep`): it reads the
tokenizer once, then answers JSON lines: for each constraint it converts and compiles it
against the tokenizer, and replies `{"grammar": text}` or `{"error": message}`. A native crash
or a runaway compile kills only this process; the parent answers the request with a 400 and
starts a fresh child. Each compile may use CPU_SECONDS of CPU time (all its threads together;
0: no limit), beyond which the kernel ends the process (SIGXCPU).

Invariant: this module imports nothing from pagoda (nor torch), so a child starts in well
under a second and its address-space limit stays small.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems",
               "anyOf", "oneOf")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` whose objects allow only the properties they name: `additionalProperties:
    false` wherever `properties` (or `patternProperties`) is given and `additionalProperties` is
    not, as vLLM's default (xgrammar's strict mode) compiles a schema. An `allOf` and its parts
    are left open, since each part names only its share of the properties. Walked without
    recursion."""
    root: Any = {"_": schema}
    stack: list[tuple[Any, Any, bool]] = [(root, "_", False)]
    while stack:
        parent, key, open_ = stack.pop()
        value = parent[key]
        if isinstance(value, list):
            parent[key] = value = list(value)
            stack.extend((value, i, open_) for i in range(len(value)))
        elif isinstance(value, dict):
            parent[key] = value = dict(value)
            if not open_ and "additionalProperties" not in value and "allOf" not in value and (
                    isinstance(value.get("properties"), dict) or isinstance(value.get("patternProperties"), dict)):
                value["additionalProperties"] = False
            for name in _SCHEMA_MAPS:
                if isinstance(value.get(name), dict):
                    value[name] = members = dict(value[name])
                    stack.extend((members, k, False) for k, v in members.items() if isinstance(v, dict))
            stack.extend((value, name, False) for name in _SUBSCHEMAS if isinstance(value.get(name), (dict, list)))
            if isinstance(value.get("allOf"), list):
                stack.append((value, "allOf", True))
    return root["_"]


def grammar_text(kind: str, spec: Any, disable_any_whitespace: bool = True,
                 whitespace_pattern: str | None = None) -> str:
    """llguidance's grammar for one constraint; raises on an invalid one."""
    from llguidance import LLMatcher

    if kind in ("json", "json_object"):
        schema: Any = spec if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        schema = closed_objects(schema) if kind == "json" else schema
        options: dict[str, Any] = {"whitespace_flexible": not disable_any_whitespace}
        if whitespace_pattern is not None:
            options["whitespace_pattern"] = whitespace_pattern
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))  # type: ignore[arg-type]
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec))
    if kind == "choice":
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec)))
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        return str(LLMatcher.grammar_from_lark(any_to_lark(spec)))
    raise ValueError(f"unknown constraint kind {kind!r}")


def compile_one(tokenizer: Any, request: dict[str, Any]) -> dict[str, str]:
    """One request's reply: the grammar text if it compiles, else the library's error."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(request["kind"], request["spec"], request["disable_any_whitespace"],
                            request["whitespace_pattern"])
        matcher = LLMatcher(tokenizer, text, log_level=0)
    except Exception as e:  # noqa: BLE001 - the constraint is the user's: any failure is theirs
        return {"error": str(e) or type(e).__name__}
    if matcher.is_error():
        return {"error": str(matcher.get_error())}
    return {"grammar": text}


def _die_with_parent() -> None:
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # NOTE: not Linux: the child still ends when its stdin closes


def limit_cpu(seconds: int) -> None:
    """Lets this process use `seconds` more CPU-seconds (soft RLIMIT_CPU: SIGXCPU, which ends it,
    once its total passes the limit). The hard limit stays, so that later calls can raise it."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + seconds  # NOTE: + 1: the limit counts whole seconds
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _serve(memory_mib: int, cpu_seconds: int) -> None:
    import resource

    from llguidance import LLTokenizer

    if memory_mib > 0:
        limit = memory_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    init = json.loads(sys.stdin.readline())
    tokenizer = LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if cpu_seconds > 0:
            limit_cpu(cpu_seconds)
        print(json.dumps(compile_one(tokenizer, json.loads(line))), flush=True)


def main() -> None:
    """The child's main: limits, tokenizer, then one reply per request line until EOF."""
    _die_with_parent()
    if len(sys.argv) > 3:
        import os

        sys.path[:] = sys.argv[3].split(os.pathsep)
    # NOTE: compiled on a thread, as the parent compiles on one: the same stack limit.
    thread = threading.Thread(target=_serve, args=(int(sys.argv[1]), int(sys.argv[2])), name="grammar-compile")
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
