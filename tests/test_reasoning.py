"""Reasoning parsers: <think>...</think> split into reasoning and content, whole or streamed."""

from __future__ import annotations

import random

import pytest

from pagoda.server.reasoning import REASONING_PARSERS, ReasoningStream, get_reasoning_parser, split

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("parser, text, expected", [
    (R1, "<think>plan a</think>The answer", ("plan a", "The answer")),
    (R1, "plan a</think>The answer", ("plan a", "The answer")),  # the template opened it
    (R1, "<think>cut short", ("cut short", None)),  # no end: all reasoning, as vLLM
    (R1, "\n<think>x</think>", ("x", None)),
    (QWEN3, "<think>plan</think>\n\nDone", ("plan", "\n\nDone")),
    (QWEN3, "No thinking here", (None, "No thinking here")),  # enable_thinking=False
    (QWEN3, "a</think>b", (None, "a</think>b")),  # only an answer that opens with <think>
    (QWEN3, "<think>cut", ("cut", None)),
    (QWEN3, "<thi", (None, "<thi")),
    (R1, "a </thin", ("a </thin", None)),
])
def test_whole_answers(parser, text, expected):
    assert split(parser, text) == expected


@pytest.mark.parametrize("parser", [R1, QWEN3])
@pytest.mark.parametrize("text", ["<think>step one, <b>two</b> </th</think>ans</think>wer",
                                  "  <think></think>", "plain <think>not at the start</think>",
                                  "reason </ think> </think>< /think>", "<", "</think>"])
def test_streamed_deltas_add_up_to_the_whole_answer(parser, text):
    rng = random.Random(len(text))
    whole = split(parser, text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, reasoning, content = ReasoningStream(parser), "", ""
        for i, piece in enumerate(pieces):
            r, c = stream.step(piece, i == len(pieces) - 1)
            assert "</think>" not in r  # a tag is never half-sent as reasoning
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == ((whole[0] or ""), (whole[1] or "")), pieces


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("granite")
