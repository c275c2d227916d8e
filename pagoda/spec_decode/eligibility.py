"""Which requests may draft this step, and how many tokens.

Verification compares the target's rows with the drafts as plain sampling would see them, so
a request drafts only when its logits need nothing position by position that verification
does not provide: no logit_bias or allowed_token_ids, no penalties or bad words, no logprobs to report,
min_tokens reached. A grammar is fine: drafts are cut to the prefix it accepts, and each
verification row gets the grammar's mask after the drafts before it. A request must be
decoding (one token to compute) and keep room for the drafts plus the token the
verification adds, inside max_tokens and the context.
"""

from __future__ import annotations

from pagoda.request import Request, RequestStatus


def draft_limit(request: Request, num_tokens: int) -> int:
    """How many tokens `request` may draft now (0: none)."""
    p = request.sampling_params
    if (request.status is not RequestStatus.RUNNING or p.logit_bias or p.allowed_token_ids
            or p.reads_history
            or p.logprobs is not None or request.num_output_tokens < p.min_tokens
            or request.num_tokens - request.num_computed_tokens != 1):
        return 0
    # NOTE: max_tokens already stops at the context length (Request._max_tokens).
    room = request.max_tokens - request.num_output_tokens - 1
    return max(0, min(num_tokens, room))


def trim_to_grammar(drafts: dict[Request, list[int]]) -> None:
    """Cuts each constrained request's drafts to the prefix its grammar accepts."""
    for request, tokens in drafts.items():
        if tokens and request.grammar is not None:
            del tokens[request.grammar.valid_prefix(tokens):]
