"""vLLM's `thinking_token_budget`: a reasoning model thinks at most N tokens, then its end of
thinking is forced.

The engine's `ReasoningConfig` names the strings that open and (when a budget runs out) close
the thinking; `ThinkingTokens` holds them tokenized, with the reasoning parser's own end of
thinking (`natural_end`), which ends a section the model closes itself. A request's
`ThinkingBudget` is then a pure function of its tokens so far (prompt and output): inside a
section (opened by the first `start` after the last end of thinking, a `start` inside it
changing nothing, as vLLM counts), after `budget` tokens of it (never before the output begins:
a prompt that already thought too long is closed at once), the next tokens must be `end`'s, one
a step. A section opened later gets the whole budget again.
Stateless, so a worker that holds a request's history (`SamplingParams.reads_history`) forces
the same tokens as the engine would, and preemption or recompute changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingTokens:
    """The engine's reasoning markers, tokenized: `start` opens a section, `end` is forced
    when a budget runs out, `natural_end` is what the model writes to close one."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    natural_end: tuple[int, ...]


@dataclass(frozen=True)
class ThinkingBudget:
    budget: int
    tokens: ThinkingTokens

    def forced_token(self, tokens: list[int], num_prompt_tokens: int) -> int | None:
        """The token the next position must hold (None: any)."""
        marks = self.tokens
        closed = max(_after(tokens, marks.natural_end), _after(tokens, marks.end))
        start = first_index(tokens, marks.start, closed)
        if start < 0:
            return None
        forced_at = max(start + len(marks.start) + self.budget, num_prompt_tokens)
        written = len(tokens) - forced_at
        if written < 0 or written >= len(marks.end):
            return None  # NOTE: within the budget, or past the forced end (then closed above)
        return marks.end[written]


def _after(tokens: list[int], seq: tuple[int, ...]) -> int:
    """The position after the last `seq` in `tokens` (0: none)."""
    at = last_index(tokens, seq)
    return 0 if at < 0 else at + len(seq)


def first_index(tokens: list[int], seq: tuple[int, ...], lo: int = 0) -> int:
    """The first position at or after `lo` where `tokens` holds `seq` (-1: none)."""
    m, n = len(seq), len(tokens)
    first = list(seq)
    at = lo
    while True:
        try:
            at = tokens.index(seq[0], at, n - m + 1)
        except ValueError:
            return -1
        if tokens[at:at + m] == first:
            return at
        at += 1


def last_index(tokens: list[int], seq: tuple[int, ...], lo: int = 0) -> int:
    """The last position at or after `lo` where `tokens` holds `seq` (-1: none).

    NOTE: list.index on the reversed list scans in C: a long prompt without the sequence costs
    a copy and one scan, not a Python loop over every token each step."""
    m, n = len(seq), len(tokens)
    if m == 0 or n - lo < m:
        return -1
    reverse = tokens[::-1]
    first = list(seq)
    at = 0  # NOTE: a position in `reverse`; tokens[n - 1 - at] is seq's last token
    while True:
        try:
            at = reverse.index(seq[-1], at, n - lo - m + 1)
        except ValueError:
            return -1
        begin = n - at - m
        if tokens[begin:begin + m] == first:
            return begin
        at += 1
