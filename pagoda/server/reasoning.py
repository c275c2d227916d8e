"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's thinking, between
`<think>` and `</think>`, goes to the message's `reasoning` (and, as vLLM still sends it,
`reasoning_content`), the rest to `content`.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 thinking models whose template opens
  the `<think>` itself): everything up to `</think>` is reasoning, whether or not the output
  opened it; an answer cut before `</think>` is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3 with
  `enable_thinking`); otherwise, as with `chat_template_kwargs: {"enable_thinking": false}`, it
  is all content.

One state machine splits both streams and whole answers (`split` feeds it the whole text), so
a stream's deltas always add up to the unstreamed answer. A tag split across deltas is held
back until it is complete or cannot be one.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """name: the flag's value; opens_in_reasoning: whether text before `</think>` is reasoning
    even when the output did not open with `<think>`."""

    name: str
    opens_in_reasoning: bool


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", opens_in_reasoning=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {sorted(REASONING_PARSERS)}") from None


class ReasoningStream:
    """One choice's text, delta by delta, split into (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._phase = "open"  # open -> reasoning -> content, or open -> content
        self._held = ""

    def step(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and content that `text` (the next delta) completes; `final` on the
        last delta releases anything held back."""
        held, self._held = self._held + text, ""
        reasoning = content = ""
        if self._phase == "open":
            stripped = held.lstrip()
            if not final and START.startswith(stripped):
                self._held = held  # NOTE: maybe the start of "<think>"
                return "", ""
            if stripped.startswith(START):
                self._phase, held = "reasoning", stripped[len(START):]
            else:
                self._phase = "reasoning" if self.parser.opens_in_reasoning else "content"
        if self._phase == "reasoning":
            before, found, after = held.partition(END)
            if found:
                reasoning, self._phase, held = before, "content", after
            else:
                keep = 0 if final else _partial_tag(held)
                reasoning, self._held = held[:len(held) - keep], held[len(held) - keep:]
                return reasoning, ""
        content = held
        return reasoning, content


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins `</think>` (0: none)."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content); None for a part the answer has none of."""
    reasoning, content = ReasoningStream(parser).step(text, final=True)
    saw_reasoning = parser.opens_in_reasoning or text.lstrip().startswith(START)
    return (reasoning if saw_reasoning else None), (content if content or not saw_reasoning else None)
