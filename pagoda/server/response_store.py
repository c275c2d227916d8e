"""The responses a server keeps, for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded: at most `max_size` responses (`--responses-store-size`), the least recently used
dropped first; 0 keeps none (a request's `store` is then a no-op, as in vLLM without its
store). Each entry is the response object's JSON and the conversation it ended, as chat
messages without the request's `instructions` (OpenAI's rule: they do not carry over to a
response that continues it). In memory, in the server's process: a restart forgets them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_RESPONSES_STORE_SIZE = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """An LRU map of response id -> `StoredResponse`; the server's event loop is its only
    user, so it takes no lock."""

    def __init__(self, max_size: int = DEFAULT_RESPONSES_STORE_SIZE) -> None:
        if max_size < 0:
            raise ValueError(f"the responses store size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry
