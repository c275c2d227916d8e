"""The JSON of streamed chunks, written without a pydantic model per chunk.

A stream's chunks share their id, object, created and model: `ChunkEncoder` encodes them once,
and each chunk adds only its choice and usage. Plain values (text, indices, reasons) go
through the standard library's encoder; the rare parts (logprobs, tool-call deltas, usage)
through their own pydantic model's JSON, so that their shape has one definition.
Invariant: a chunk is JSON-equal to what `CompletionResponse` / `ChatCompletionStreamResponse`
(protocol.py) would serialize for it (tests/test_server_stream_chunks.py).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

NULL = "null"
# NOTE: compact and not ASCII-escaped, as pydantic writes it: the bytes stay those of before.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode



def role_delta(role: str) -> str:
    """A chat stream's first delta: the answer's role, empty content."""
    return f'{{"role":{_encode(role)},"content":""}}'


def value_json(value: str | int | None) -> str:
    return NULL if value is None else _encode(value)


def event_json(event: dict[str, Any]) -> str:
    """A Responses stream event (plain values and dumped models), as compact as a chunk."""
    return _encode(event)


def part_json(part: BaseModel | None) -> str:
    """A rare part in its model's JSON, or null.

    NOTE: pydantic's JSON serializer, not `json` on `model_dump()`: it writes an infinite
    logprob as null, where `json` would write `-Infinity`, which is not JSON.
    """
    return NULL if part is None else part.model_dump_json()


def content_delta(text: str) -> str:
    """The chat delta of plain content: `DeltaMessage(content=text)` (None fields left out)."""
    return f'{{"content":{_encode(text)}}}'


def reasoning_delta(text: str) -> str:
    """The chat delta of reasoning (--reasoning-parser), under vLLM's two names."""
    encoded = _encode(text)
    return f'{{"reasoning":{encoded},"reasoning_content":{encoded}}}'


def ids_members(**values: list[int] | str | None) -> str:
    """vLLM's `token_ids` / `prompt_token_ids` / `prompt_text` as extra members
    (`,"token_ids":[...]`), the ones given only: a stream that did not ask for them keeps its
    bytes."""
    return "".join(f',"{name}":{_encode(value)}' for name, value in values.items() if value is not None)


def completion_choice(index: int, text: str, logprobs: str = NULL,
                      finish_reason: str | None = None,
                      stop_reason: int | str | None = None, extra: str = "") -> str:
    """A `CompletionResponseChoice`; `logprobs` and `extra` (`ids_members`) are already JSON."""
    return _choice(index, f'"text":{_encode(text)}', logprobs, finish_reason, stop_reason, extra)


def chat_choice(index: int, delta: str, logprobs: str = NULL, finish_reason: str | None = None,
                stop_reason: int | str | None = None, extra: str = "") -> str:
    """A `ChatCompletionStreamChoice`; `delta`, `logprobs` and `extra` are already JSON."""
    return _choice(index, f'"delta":{delta}', logprobs, finish_reason, stop_reason, extra)


def _choice(index: int, body: str, logprobs: str, finish_reason: str | None,
            stop_reason: int | str | None, extra: str = "") -> str:
    return (f'{{"index":{index},{body},"logprobs":{logprobs},'
            f'"finish_reason":{value_json(finish_reason)},"stop_reason":{value_json(stop_reason)}'
            f'{extra}}}')


class ChunkEncoder:
    """One stream's chunks: the constant head encoded once, then a choice and usage each."""

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        head = _encode({"id": request_id, "object": object_name, "created": created,
                        "model": model})
        self._head = head[:-1] + ',"choices":['

    def encode(self, choice: str | None, usage: str = NULL, extra: str = "") -> str:
        """A chunk with one choice (its JSON), or with none (the final usage chunk); `extra`:
        more members of the chunk, already JSON (`ids_members`)."""
        return f'{self._head}{choice or ""}],"usage":{usage}{extra}}}'
