"""A request's token constraints, read from every field that can ask for one.

One output constraint may come from OpenAI's `response_format`, vLLM's `structured_outputs`,
or vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; asking
twice is a 400. `logit_bias` keys are token ids written as strings (OpenAI's shape). A field
this server does not implement is a 400 that names it: nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any

from pagoda.server.errors import bad_request
from pagoda.server.protocol import RequestModel, SamplingFields
from pagoda.structured_output import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "guidance", "llguidance")


def check_supported(req: RequestModel) -> None:
    """Refuses fields the schema does not know (e.g. best_of)."""
    unknown = req.unsupported_fields()
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown[:10])
        raise bad_request(f"Unsupported parameter(s): {names}. pagoda does not implement "
                          f"{'it' if len(unknown) == 1 else 'them'}.", unknown[0])


def structured_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from (for error messages)."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema.",
                              "response_format")
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        spec = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", spec))
    for name, kind in GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if req.guided_decoding_backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend {req.guided_decoding_backend!r} is not "
                          "available; pagoda uses llguidance ('guidance').",
                          "guided_decoding_backend")
    if not found:
        return None, "structured_outputs"
    if len(found) > 1:
        raise bad_request("Only one output constraint may be given; got "
                          f"{', '.join(name for name, _ in found)}.", found[1][0])
    param, spec = found[0]
    if req.guided_whitespace_pattern is not None:
        spec.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    try:
        return StructuredOutputsParams(**spec), param
    except (TypeError, ValueError) as e:
        raise bad_request(f"Invalid {param}: {e}", param) from e


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) with integer keys."""
    if not req.logit_bias:
        return None
    bias: dict[int, float] = {}
    invalid: list[str] = []
    for key, value in req.logit_bias.items():
        try:
            bias[int(key)] = value
        except ValueError:
            invalid.append(key[:40])
    if invalid:
        # NOTE: every bad key named at once, as vLLM's SamplingParams does (the first 10 here)
        more = f" and {len(invalid) - 10} more" if len(invalid) > 10 else ""
        raise bad_request(f"logit_bias keys must be token ids, got {invalid[:10]!r}{more}.", "logit_bias")
    return bias
