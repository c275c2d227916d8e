"""One streamed request to an OpenAI-compatible server, timed token by token.

A request succeeds when the server answers 200 and the stream carries no error event. TTFT
is measured from sending to the first chunk with non-empty text; each later non-empty chunk
adds one inter-token latency (ITL). Token counts come from the final usage chunk
(`stream_options.include_usage`) when the server sends one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestFuncInput:
    """What to send."""

    api_url: str
    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    chat: bool = False
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    """What came back, with client-side timings in seconds (perf_counter clock)."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    finish_reason: str | None = None
    status_code: int | None = None
    error: str = ""


def build_payload(req: RequestFuncInput) -> dict[str, Any]:
    """The JSON body: streamed, usage requested, greedy unless extra_body says otherwise."""
    payload: dict[str, Any] = {
        "model": req.model,
        "temperature": 0.0,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
    if req.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(req.extra_body)
    return payload


def chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """The text a stream chunk carries (None when it has no choices)."""
    choices = data.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _StreamState:
    """Accumulates one stream's events into a RequestFuncOutput."""

    def __init__(self, output: RequestFuncOutput, chat: bool) -> None:
        self.output = output
        self.chat = chat
        self.last_time = output.start_time

    def on_event(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            error = data["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise RuntimeError(f"error event in stream: {message}")
        text = chunk_text(data, self.chat)
        if text:
            if not self.output.generated_text:
                self.output.ttft = now - self.output.start_time
            else:
                self.output.itl.append(now - self.last_time)
            self.last_time = now
            self.output.generated_text += text
        choices = data.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            self.output.finish_reason = choices[0]["finish_reason"]
        usage = data.get("usage")
        if usage:
            self.output.output_tokens = usage.get("completion_tokens")
            self.output.usage_prompt_tokens = usage.get("prompt_tokens")


async def request_stream(client: httpx.AsyncClient, req: RequestFuncInput,
                         headers: dict[str, str] | None = None) -> RequestFuncOutput:
    """Sends one streamed request; never raises: failures come back with success=False."""
    output = RequestFuncOutput(prompt_len=req.prompt_len, start_time=time.perf_counter())
    state = _StreamState(output, req.chat)
    try:
        async with client.stream("POST", req.api_url, json=build_payload(req),
                                 headers=headers) as response:
            output.status_code = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:500]}")
            async for line in response.aiter_lines():
                event = _parse_sse_line(line)
                if event is None:
                    continue
                if event == "[DONE]":
                    break
                state.on_event(json.loads(event), time.perf_counter())
        output.latency = time.perf_counter() - output.start_time
        output.success = True
    except Exception as exc:  # noqa: BLE001 -- a failed request is data, not a crash
        output.latency = time.perf_counter() - output.start_time
        output.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return output


def _parse_sse_line(line: str) -> str | None:
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip() or None


async def first_model_id(client: httpx.AsyncClient, base_url: str,
                         headers: dict[str, str] | None = None) -> str:
    """The id of the first model the server lists at /v1/models."""
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no models.")
    return str(data[0]["id"])
