"""vLLM's request log (`--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`,
`--enable-log-deltas`): what each generating request asked and what it answered.

At INFO a request's params when it is admitted and each choice's text and finish reason when it
ends (and, in a stream, each delta's text unless `--no-enable-log-deltas`); at DEBUG also the
prompt, its token ids and the output's token ids. Texts and id lists are cut to
`--max-log-len`. vLLM's words, so that log pipelines built for vLLM read pagoda's lines.
Nothing is logged unless the server is started with `--enable-log-requests`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.lora import LoRARequest
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLogger:
    """max_log_len: the most characters of a text (and ids of a list) a line shows (None: all);
    log_outputs: also the answers; log_deltas: a stream's deltas too (with `log_outputs`)."""

    max_log_len: int | None = None
    log_outputs: bool = False
    log_deltas: bool = True

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams | object, lora_request: LoRARequest | None) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s.", request_id,
                         self._cut(prompt), self._cut(prompt_token_ids))
        logger.info("Received request %s: params: %s, lora_request: %s.", request_id, params, lora_request)

    def log_output(self, request_id: str, text: str, token_ids: Sequence[int], finish_reason: str | None,
                   streaming: bool = False, delta: bool = False) -> None:
        """One choice's answer (or, `delta`, a stream's next piece of it)."""
        if not self.log_outputs or (delta and not self.log_deltas):
            return
        stream_info = (" (streaming delta)" if delta else " (streaming complete)") if streaming else ""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Generated response %s%s details: output_token_ids: %s", request_id, stream_info,
                         self._cut(list(token_ids)))
        logger.info("Generated response %s%s: output: %r, finish_reason: %s", request_id, stream_info,
                    self._cut(text), finish_reason)

    def _cut(self, value: str | list[int] | None) -> str | list[int] | None:
        return value if value is None or self.max_log_len is None else value[:self.max_log_len]
