"""Streamed chunks (server/chunks.py) against the pydantic models they replace.

The real `stream_completion` / `stream_chat`, framed by `sse`, run on a scripted engine; each
chunk's JSON must equal what the protocol.py model built for it serializes
(`model_dump_json`): the same keys, the same None fields present (`logprobs`, `usage`,
`stop_reason`) or left out (a `DeltaMessage`'s), an infinite logprob as null. A plain text
chunk, the common one, keeps the very bytes pydantic wrote.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.server import protocol, tool_parsers, tools
from pagoda.server.chat import ChatInputs, num_logprobs_of, stream_chat
from pagoda.server.completions import stream_completion
from pagoda.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
    CompletionRequest,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    PromptTokensDetails,
    UsageInfo,
)
from pagoda.server.serving import Generation, Prompt, ServerContext
from pagoda.server.streaming import sse
from pagoda.server.tool_parsers import HermesToolParser
from pagoda.server.tools import plan_tools

REQUEST_ID, CREATED, MODEL = "cmpl-test", 1_700_000_000, "tiny"
PROMPT_TEXT, PROMPT_IDS = "Hi there", [1, 2, 3]
USAGE_ON = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


class ScriptedEngine:
    """Replays scripted deltas, one engine output each; the last one finishes the request."""

    def __init__(self, deltas: list[CompletionOutput]) -> None:
        self.deltas = deltas
        self.tokenizer = SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids))

    async def generate_request(self, req: Any) -> AsyncIterator[RequestOutput]:
        for i, delta in enumerate(self.deltas):
            yield RequestOutput(req.request_id, None, req.prompt_token_ids, [delta],
                                i == len(self.deltas) - 1)

    async def abort(self, request_id: str) -> None:
        """Nothing runs."""


def generation(deltas: list[CompletionOutput], n: int = 1) -> Generation:
    ctx = ServerContext(engine=ScriptedEngine(deltas),  # type: ignore[arg-type]
                        served_model_names=[MODEL], model_path=MODEL, max_model_len=64)
    request = SimpleNamespace(request_id=REQUEST_ID, prompt_token_ids=PROMPT_IDS,
                              sampling_params=SimpleNamespace(n=n))
    gen = Generation(ctx, REQUEST_ID, [Prompt(PROMPT_IDS, PROMPT_TEXT)], [request])  # type: ignore[list-item]
    gen.created = CREATED
    return gen


def event_data(chunks: AsyncIterator[str]) -> list[str]:
    """The stream as `sse` frames it: each event's data, up to the closing [DONE]."""
    async def collect() -> str:
        return "".join([frame async for frame in sse(chunks)])

    frames = asyncio.run(collect()).split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert all(frame.startswith("data: ") for frame in frames[:-2])
    return [frame[len("data: "):] for frame in frames[:-2]]


def events(chunks: AsyncIterator[str]) -> list[Any]:
    return [json.loads(data) for data in event_data(chunks)]


def completion_events(deltas: list[CompletionOutput], **request: Any) -> list[Any]:
    req = CompletionRequest(prompt=PROMPT_TEXT, stream=True, **request)
    return events(stream_completion(generation(deltas), req, MODEL))


def chat_events(deltas: list[CompletionOutput], n: int = 1, **request: Any) -> list[Any]:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=n,
                                **request)
    inputs = ChatInputs(plan_tools(req, HermesToolParser()), {}, "", Prompt(PROMPT_IDS), None)
    return events(stream_chat(generation(deltas, n), req, MODEL, num_logprobs_of(req), inputs))


def as_json(models: list[CompletionStreamResponse] | list[ChatCompletionStreamResponse]) -> list[Any]:
    return [json.loads(model.model_dump_json()) for model in models]


def usage(num_completion: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=len(PROMPT_IDS), completion_tokens=num_completion,
                     total_tokens=len(PROMPT_IDS) + num_completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=0))


def completion_chunk(choices: list[CompletionStreamChoice],
                     usage_info: UsageInfo | None = None) -> CompletionStreamResponse:
    return CompletionStreamResponse(id=REQUEST_ID, created=CREATED, model=MODEL, choices=choices,
                              usage=usage_info)


def chat_chunk(choices: list[ChatCompletionStreamChoice],
               usage_info: UsageInfo | None = None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id=REQUEST_ID, created=CREATED, model=MODEL,
                                        choices=choices, usage=usage_info)


def role_chunk(index: int = 0, usage_info: UsageInfo | None = None
               ) -> ChatCompletionStreamResponse:
    return chat_chunk([ChatCompletionStreamChoice(
        index=index, delta=DeltaMessage(role="assistant", content=""))], usage_info)


def content_chunk(text: str, index: int = 0, **choice: Any) -> ChatCompletionStreamResponse:
    return chat_chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text),
                                                  **choice)])


@pytest.fixture
def call_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tool-call ids "call-fixed", for both the named stream's and a parsed call's."""
    monkeypatch.setattr(tools, "random_id", lambda prefix: f"{prefix}-fixed")
    monkeypatch.setattr(tool_parsers, "random_id", lambda prefix: f"{prefix}-fixed")
    monkeypatch.setattr(protocol, "random_id", lambda prefix: f"{prefix}-fixed")


# ---- /v1/completions ----------------------------------------------------------------------


def test_completion_text_deltas_and_finish():
    deltas = [CompletionOutput(0, ' héllo "✓"\n\t\\', [5]),
              CompletionOutput(0, "!", [6], finish_reason="stop", stop_reason="END"),
              CompletionOutput(0, "", [2], finish_reason="stop", stop_reason=2)]
    assert completion_events(deltas) == as_json([
        completion_chunk([CompletionStreamChoice(index=0, text=' héllo "✓"\n\t\\')]),
        completion_chunk([CompletionStreamChoice(index=0, text="!", finish_reason="stop",
                                                   stop_reason="END")]),
        completion_chunk([CompletionStreamChoice(index=0, text="", finish_reason="stop",
                                                   stop_reason=2)])])


def test_completion_echo_prefixes_the_first_delta_only():
    deltas = [CompletionOutput(0, " a", [5]),
              CompletionOutput(0, " b", [6], finish_reason="length")]
    assert completion_events(deltas, echo=True) == as_json([
        completion_chunk([CompletionStreamChoice(index=0, text=PROMPT_TEXT + " a")]),
        completion_chunk([CompletionStreamChoice(index=0, text=" b",
                                                   finish_reason="length")])])


def test_completion_logprobs_with_an_infinite_one():
    deltas = [CompletionOutput(0, " a", [5], logprobs=[
                  {5: Logprob(5, -0.25, 1, " a"), 7: Logprob(7, -1.5, 2, " b")}]),
              CompletionOutput(0, "!", [6], finish_reason="length", logprobs=[
                  {6: Logprob(6, float("-inf"), 3, "!"), 8: Logprob(8, -0.125, 1, "?")}])]
    first = CompletionLogProbs(text_offset=[0], token_logprobs=[-0.25], tokens=[" a"],
                               top_logprobs=[{" a": -0.25}])
    second = CompletionLogProbs(text_offset=[2], token_logprobs=[float("-inf")], tokens=["!"],
                                top_logprobs=[{"?": -0.125, "!": float("-inf")}])
    streamed = completion_events(deltas, logprobs=1)
    assert streamed[1]["choices"][0]["logprobs"]["token_logprobs"] == [None]
    assert streamed == as_json([
        completion_chunk([CompletionStreamChoice(index=0, text=" a", logprobs=first)]),
        completion_chunk([CompletionStreamChoice(index=0, text="!", logprobs=second,
                                                   finish_reason="length")])])


def test_completion_continuous_usage_then_the_usage_chunk():
    deltas = [CompletionOutput(0, " a", [5]),
              CompletionOutput(0, " b", [6], finish_reason="length")]
    assert completion_events(deltas, **USAGE_ON) == as_json([
        completion_chunk([CompletionStreamChoice(index=0, text=" a")], usage(1)),
        completion_chunk([CompletionStreamChoice(index=0, text=" b", finish_reason="length")],
                         usage(2)),
        completion_chunk([], usage(2))])


def test_completion_include_usage_only_in_the_last_chunk():
    deltas = [CompletionOutput(0, " a", [5], finish_reason="length")]
    streamed = completion_events(deltas, stream_options={"include_usage": True})
    assert streamed == as_json([
        completion_chunk([CompletionStreamChoice(index=0, text=" a", finish_reason="length")]),
        completion_chunk([], usage(1))])


# ---- /v1/chat/completions -----------------------------------------------------------------


def test_chat_role_content_and_finish_chunks():
    deltas = [CompletionOutput(0, "Hél", [5]), CompletionOutput(0, "", [9]),
              CompletionOutput(0, 'lo "x"', [6]),
              CompletionOutput(0, "", [2], finish_reason="stop", stop_reason=2)]
    assert chat_events(deltas) == as_json([
        role_chunk(), content_chunk("Hél"), content_chunk('lo "x"'),
        content_chunk("", finish_reason="stop", stop_reason=2)])


def test_chat_role_chunk_per_choice():
    deltas = [CompletionOutput(1, "b", [6]), CompletionOutput(0, "a", [5], finish_reason="stop"),
              CompletionOutput(1, "", [2], finish_reason="stop", stop_reason="END")]
    assert chat_events(deltas, n=2) == as_json([
        role_chunk(0), role_chunk(1), content_chunk("b", index=1),
        content_chunk("a", index=0, finish_reason="stop"),
        content_chunk("", index=1, finish_reason="stop", stop_reason="END")])


def test_chat_logprobs_with_an_infinite_one():
    deltas = [CompletionOutput(0, " a", [5], logprobs=[
                  {5: Logprob(5, -0.25, 1, " a"), 7: Logprob(7, -1.5, 2, " b")}]),
              CompletionOutput(0, "!", [6], finish_reason="length",
                               logprobs=[{8: Logprob(8, -0.125, 1, "?")}])]
    first = ChatCompletionLogProbs(content=[ChatLogProbsContent(
        token=" a", logprob=-0.25, bytes=[32, 97],
        top_logprobs=[ChatLogProb(token=" a", logprob=-0.25, bytes=[32, 97])])])
    second = ChatCompletionLogProbs(content=[ChatLogProbsContent(
        token="<6>", logprob=float("-inf"), bytes=list(b"<6>"),
        top_logprobs=[ChatLogProb(token="?", logprob=-0.125, bytes=[63])])])
    streamed = chat_events(deltas, logprobs=True, top_logprobs=1)
    assert streamed[2]["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    assert streamed == as_json([
        role_chunk(), content_chunk(" a", logprobs=first),
        content_chunk("!", logprobs=second, finish_reason="length")])


def test_chat_named_tool_call_deltas(call_ids: None):
    deltas = [CompletionOutput(0, '{"city":', [5]),
              CompletionOutput(0, ' "Paris"}', [6], finish_reason="stop")]
    first = DeltaToolCall(index=0, id="call-fixed", type="function", function=DeltaFunctionCall(
        name="get_weather", arguments='{"city":'))
    second = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=' "Paris"}'))
    streamed = chat_events(deltas, tools=[WEATHER_TOOL],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert streamed == as_json([
        role_chunk(),
        chat_chunk([ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(tool_calls=[first]))]),
        chat_chunk([ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(tool_calls=[second]), finish_reason="stop")])])


def test_chat_auto_tool_call_at_the_finish(call_ids: None):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    deltas = [CompletionOutput(0, "Sure. ", [5]),
              CompletionOutput(0, call, [6], finish_reason="stop")]
    tool_call = DeltaToolCall(index=0, id="call-fixed", type="function", function=DeltaFunctionCall(
        name="get_weather", arguments='{"city": "Paris"}'))
    assert chat_events(deltas, tools=[WEATHER_TOOL], tool_choice="auto") == as_json([
        role_chunk(), content_chunk("Sure. "),
        chat_chunk([ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(tool_calls=[tool_call]), finish_reason="tool_calls")])])


def test_chat_continuous_usage_then_the_usage_chunk():
    deltas = [CompletionOutput(0, "a", [5]), CompletionOutput(0, "b", [6], finish_reason="stop")]
    expected = [role_chunk(usage_info=usage(0)), content_chunk("a"),
                content_chunk("b", finish_reason="stop"), chat_chunk([], usage(2))]
    expected[1].usage, expected[2].usage = usage(1), usage(2)
    assert chat_events(deltas, **USAGE_ON) == as_json(expected)


# ---- the common path's bytes --------------------------------------------------------------


def test_plain_text_chunks_keep_their_bytes():
    text = ' héllo "✓"\n\t\\ \x00 \u2028 😀'
    completion = event_data(stream_completion(
        generation([CompletionOutput(0, text, [5], finish_reason="stop", stop_reason=2)]),
        CompletionRequest(prompt=PROMPT_TEXT, stream=True), MODEL))
    assert completion == [completion_chunk([CompletionStreamChoice(
        index=0, text=text, finish_reason="stop", stop_reason=2)]).model_dump_json()]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    chat = event_data(stream_chat(generation([CompletionOutput(0, text, [5])]), req, MODEL, None,
                                  ChatInputs(plan_tools(req, HermesToolParser()), {}, "", Prompt(PROMPT_IDS), None)))
    assert chat == [role_chunk().model_dump_json(), content_chunk(text).model_dump_json()]
