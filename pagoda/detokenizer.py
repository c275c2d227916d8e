"""Incremental detokenization and stop strings, per sequence.

Text grows through `tokenizers`' DecodeStream, which holds back a token until it completes a
UTF-8 character, so a multi-byte character split across tokens never appears half-decoded.
Stop strings are searched in the newly grown tail, once more than `min_tokens` tokens were
generated (as vLLM); the matched string is cut from the text unless
`include_stop_str_in_output`. While running, the last `len(longest stop) - 1`
characters are held back from deltas so a stop string never leaks into a stream.
With special tokens kept and `spaces_between_special_tokens` off (vLLM's), an added token that
follows another is written as its bare text, without the space the decoder may put first.
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import SamplingParams

_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.text = ""
        self.num_emitted_chars = 0
        self.stop_reason: str | None = None
        self.num_tokens = 0
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self._backend: Any = getattr(tokenizer, "_tokenizer", None)
        self._stream: Any = None
        self._added: dict[int, str] = {}  # NOTE: bare texts, where spaces between them are off
        self._last_added = False
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)  # type: ignore[assignment]
            for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
                self._stream.step(self._backend, token_id)
            if not (params.skip_special_tokens or params.spaces_between_special_tokens):
                self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}

    def add_token(self, token_id: int) -> bool:
        """Appends one token's text; returns True if a stop string matched."""
        if self._stream is None or self.stop_reason is not None:
            return False
        self.num_tokens += 1
        piece = self._stream.step(self._backend, token_id)
        if self._added:
            added = self._added.get(token_id)
            if added is not None and self._last_added:
                piece = added
            self._last_added = added is not None
        if not piece:
            return False
        start = max(len(self.text) - self.hold_back, 0)
        self.text += piece
        if self.num_tokens <= self.params.min_tokens:
            return False
        return self._check_stop(start)

    def _check_stop(self, start: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        self.stop_reason = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """The text not yet emitted (holding back a possible stop-string prefix unless finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta
