"""AsyncLLM: the engine loop in a background thread, per-request async streams.

The HTTP event loop never runs the model: `generate()` validates and queues a request, then
awaits its `RequestOutput` deltas, which the engine thread hands over with
`call_soon_threadsafe`. Closing or cancelling the stream (a client disconnect) aborts the
request, which frees its KV blocks before the next step. `check_health()` reports the truth:
unhealthy when the loop died or has had work pending without stepping for `stall_timeout`.
`kv_report()` answers from a snapshot the engine thread takes after each loop iteration, so
the HTTP thread never reads the scheduler while a step mutates it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from pagoda.engine import LLMEngine
from pagoda.metrics.base import StatLoggerBase
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")

LOG_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stall_timeout: float = 60.0) -> None:
        self.engine = engine
        self.stall_timeout = stall_timeout
        self._commands: deque[tuple[str, tuple]] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._dead_reason: str | None = None
        self.last_step_time = time.monotonic()
        self._snapshot = engine.scheduler_stats()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str = "smollm2", stat_loggers: Sequence[StatLoggerBase] = (),
                         stall_timeout: float = 60.0, **kwargs: object) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(model, stat_loggers, **kwargs), stall_timeout)

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    @property
    def config(self):  # noqa: ANN201
        return self.engine.config

    # ---- the API side --------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas; the last has `finished=True`.

        Raises:
            ValueError (incl. PromptTooLongError): the request is invalid.
            EngineDeadError: the engine loop is not running.
        """
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        token_ids = self.engine.tokenize(prompt)
        self.engine.validate_prompt(token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        if self._dead_reason is not None:
            # NOTE: the loop died after the first check, maybe before it failed every stream.
            self._streams.pop(request_id, None)
            raise EngineDeadError(self._dead_reason)
        self._send("add", (request_id, prompt if isinstance(prompt, list) else token_ids,
                           sampling_params, time.time(), prompt if isinstance(prompt, str) else None))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", (request_id,))

    async def abort(self, request_id: str) -> None:
        self._send("abort", (request_id,))

    def _send(self, command: str, args: tuple) -> None:
        self._commands.append((command, args))
        self._wakeup.set()

    def check_health(self) -> tuple[bool, str]:
        """(True, "ok") while the loop runs and steps; else False and the reason.

        Unhealthy when the loop is dead, or when requests (or queued commands) have waited
        more than `stall_timeout` seconds since its last step.
        """
        if self._dead_reason is not None or not self._thread.is_alive():
            return False, f"engine loop is dead: {self._dead_reason or 'thread exited'}"
        stalled = time.monotonic() - self.last_step_time
        pending = self.engine.has_unfinished_requests() or bool(self._commands)
        if pending and stalled > self.stall_timeout:
            return False, (f"engine has pending requests but has not stepped for {stalled:.1f} s "
                           f"(stall timeout {self.stall_timeout:g} s)")
        return True, "ok"

    def num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def kv_cache_free_blocks(self) -> int:
        return self.engine.block_manager.num_free_blocks

    def kv_cache_total_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    def kv_report(self) -> dict[str, float]:
        """`LLMEngine.kv_report()` from the stats of the engine loop's last iteration."""
        return self.engine.kv_report(self._snapshot)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._snapshot = self.engine.last_scheduler_stats
                    self.last_step_time = time.monotonic()
                else:
                    self._snapshot = self.engine.scheduler_stats()
                    self.last_step_time = time.monotonic()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                if time.monotonic() - last_log >= LOG_INTERVAL_S:
                    last_log = time.monotonic()
                    for stat_logger in self.engine.stat_loggers:
                        stat_logger.log()
        except BaseException as exc:  # noqa: BLE001 - report, then fail every waiting stream
            logger.exception("Engine loop died")
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(self._dead_reason))

    def _drain_commands(self) -> None:
        while self._commands:
            command, args = self._commands.popleft()
            if command == "add":
                self._add(*args)
            else:
                out = self.engine.abort_request(args[0])
                if out is not None:
                    self._deliver(args[0], out)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float,
             text: str | None) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, arrival)
            if text is not None:
                self.engine.states[request_id].prompt = text
        except ValueError as exc:
            self._deliver(request_id, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)
