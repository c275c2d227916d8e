"""RequestQueue: the scheduler's waiting requests, served fairly between groups.

A group is what one client asked for at once: the prompts of one API request (a batch of
1,000 prompts is one group), the samples of one prompt. At the best priority level present
(lower first, vLLM's `priority`; every request is level 0 under the "fcfs" policy) the
queue serves the group that holds the fewest running seats (`held`, from the scheduler),
ties going to the group served least recently; each group's requests go in arrival order.
So a request that arrives behind a 1,000-prompt batch is next, not 1,000th, and
single-prompt requests keep first-come-first-served order among themselves.

Invariant: `peek(held)` is the request `popleft(held)` returns; a request preempted for
memory (`appendleft`) goes before every other request of its level, to be resumed first; one
that gave its seat to another group (`return_to_group`) goes first in its own group.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping

from pagoda.request import Request

POLICIES = ("fcfs", "priority")
_NONE_HELD: Mapping[str, int] = {}


class _Level:
    """The requests of one priority level: resumed ones first, then groups in turn."""

    def __init__(self) -> None:
        self.resumed: deque[Request] = deque()
        self.groups: OrderedDict[str, deque[Request]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.resumed or self.groups)

    def _next_group(self, held: Mapping[str, int]) -> str:
        best, fewest = None, None
        for group in self.groups:
            seats = held.get(group, 0)
            if fewest is None or seats < fewest:
                best, fewest = group, seats
                if not seats:
                    break
        assert best is not None
        return best

    def peek(self, held: Mapping[str, int]) -> Request:
        if self.resumed:
            return self.resumed[0]
        return self.groups[self._next_group(held)][0]

    def popleft(self, held: Mapping[str, int]) -> Request:
        if self.resumed:
            return self.resumed.popleft()
        group = self._next_group(held)
        requests = self.groups[group]
        request = requests.popleft()
        if requests:
            self.groups.move_to_end(group)  # NOTE: the next group's turn among equals
        else:
            del self.groups[group]
        return request

    def remove(self, request: Request) -> bool:
        if request in self.resumed:
            self.resumed.remove(request)
            return True
        requests = self.groups.get(request.group)
        if requests is None or request not in requests:
            return False
        requests.remove(request)
        if not requests:
            del self.groups[request.group]
        return True

    def __iter__(self) -> Iterator[Request]:
        yield from self.resumed
        for requests in self.groups.values():
            yield from requests


class RequestQueue:
    """Waiting requests in the order they are to be scheduled.

    Args:
        policy: "fcfs" (one level) or "priority" (levels by `Request.priority`).
    """

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._levels: dict[int, _Level] = {}
        self._len = 0

    def _level(self, request: Request) -> _Level:
        key = request.priority if self.policy == "priority" else 0
        level = self._levels.get(key)
        if level is None:
            level = self._levels[key] = _Level()
        return level

    def _first(self) -> tuple[int, _Level]:
        if not self._len:
            raise IndexError("the queue is empty")
        key = min(self._levels)
        return key, self._levels[key]

    def append(self, request: Request) -> None:
        """Queues a new request behind its own group's."""
        self._level(request).groups.setdefault(request.group, deque()).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """Queues a request preempted for memory first in its level."""
        self._level(request).resumed.appendleft(request)
        self._len += 1

    def return_to_group(self, request: Request) -> None:
        """Queues a request that gave up its seat first in its own group."""
        level = self._level(request)
        level.groups.setdefault(request.group, deque()).appendleft(request)
        self._len += 1

    def put_back(self, request: Request, resumed: bool) -> None:
        """Undoes `popleft` for a request the scheduler skipped this step (`max_loras`): first
        among the resumed (`resumed`: it was), or first in its group, its group first among
        equals."""
        level = self._level(request)
        if resumed:
            level.resumed.appendleft(request)
        else:
            level.groups.setdefault(request.group, deque()).appendleft(request)
            level.groups.move_to_end(request.group, last=False)
        self._len += 1

    def head_is_resumed(self) -> bool:
        """Whether `peek` gives a request preempted for memory (resumed first)."""
        return bool(self._first()[1].resumed)

    def peek(self, held: Mapping[str, int] = _NONE_HELD) -> Request:
        """The next request to schedule, given the running seats each group `held`."""
        return self._first()[1].peek(held)

    def popleft(self, held: Mapping[str, int] = _NONE_HELD) -> Request:
        key, level = self._first()
        request = level.popleft(held)
        self._settle(key, level)
        return request

    def discard(self, request: Request) -> None:
        """Takes `request` out of the queue if it is in it."""
        for key, level in list(self._levels.items()):
            if level.remove(request):
                self._settle(key, level)
                return

    def _settle(self, key: int, level: _Level) -> None:
        self._len -= 1
        if not level:
            del self._levels[key]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, level by level (not exactly the serving order)."""
        for key in sorted(self._levels):
            yield from self._levels[key]
