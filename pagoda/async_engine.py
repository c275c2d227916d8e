"""AsyncLLM: the engine loop in a background thread, per-request async streams.

The HTTP event loop never runs the model: `generate()` validates a request through the
engine's `InputProcessor` (tokenizing text in a worker thread), refuses it with
`QueueFullError` when `max_queued_requests` sequences wait already, queues it, then awaits
its `RequestOutput` deltas, which the engine thread hands over with `call_soon_threadsafe`. Closing or cancelling the stream (a client disconnect) aborts the
request, which frees its KV blocks before the next step. `check_health()` reports the truth:
unhealthy when the loop died or has had work pending without stepping for `stall_timeout`.
`kv_report()` answers from a snapshot the engine thread takes after each loop iteration, so
the HTTP thread never reads the scheduler while a step mutates it.

Failing loudly: if the loop itself dies (a bug outside the per-request isolation), every
open stream gets an `EngineDeadError` and `dead_reason` says why; the server then exits
non-zero so a supervisor restarts it. `shutdown()` also ends every open stream.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagoda import heap
from pagoda.engine import LLMEngine
from pagoda.generation_config import GenerationDefaults
from pagoda.input_processor import EngineRequest, InputProcessor
from pagoda.lora import LoRARequest
from pagoda.metrics.base import StatLoggerBase
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")

LOG_INTERVAL_S = 5.0
IDLE_TRIM_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or was shut down)."""


class StreamCutError(RuntimeError):
    """The server ended a request before it finished (shutdown after --drain-timeout)."""


class QueueFullError(RuntimeError):
    """Too many sequences wait already; the server answers 429 with `Retry-After`."""

    def __init__(self, num_queued: int, limit: int, retry_after: int) -> None:
        super().__init__(f"The server is busy: {num_queued} sequences are waiting "
                         f"(--max-queued-requests {limit}). Retry after {retry_after} s.")
        self.retry_after = retry_after


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
        # NOTE: the queue's two counts, read and written together under `_queue_lock`: requests
        # the engine holds waiting (as of its last drain or step) and sequences sent but not
        # yet taken. Summed from the command deque instead, a check could count a request
        # twice (read there, then drained and counted as waiting before the second read):
        # a 1,000-prompt request was refused as 1,240 waiting on an idle server.
        self._queue_lock = threading.Lock()
        self._num_waiting = 0
        self._pending_sequences = 0
        self._finish_times: deque[float] = deque(maxlen=64)
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

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.engine.generation_defaults

    # ---- the API side --------------------------------------------------------------------
    @property
    def processor(self) -> InputProcessor:
        return self.engine.processor

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop died (None while it runs): the server exits non-zero on it."""
        return self._dead_reason

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validates the request (tokenizing text off the event loop), then streams it.

        Raises:
            ValueError (incl. PromptTooLongError): the request is invalid.
            QueueFullError: too many sequences are waiting.
            EngineDeadError: the engine loop is not running.
        """
        await self.processor.prepare_grammar(sampling_params)
        if isinstance(prompt, str):
            req = await asyncio.to_thread(self.processor.process, request_id, prompt,
                                          sampling_params, priority=priority)
        else:
            req = self.processor.process(request_id, prompt, sampling_params, priority=priority)
        async for out in self.generate_request(req):
            yield out

    async def generate_request(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Streams a request `self.processor` validated; yields deltas, the last `finished`."""
        self._check_admission(req)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (asyncio.get_running_loop(), queue)
        if self._dead_reason is not None:
            # NOTE: the loop died after the first check, maybe before it failed every stream.
            self._streams.pop(req.request_id, None)
            raise EngineDeadError(self._dead_reason)
        with self._queue_lock:
            self._pending_sequences += req.sampling_params.n
        self._send("add", (req,))
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
            self._streams.pop(req.request_id, None)
            if not finished:
                self._send("abort", (req.request_id,))

    def _check_admission(self, req: EngineRequest) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if req.request_id in self._streams:
            raise ValueError(f"Request id {req.request_id!r} is already in use.")
        self.check_queue(req.sampling_params.n)

    def check_queue(self, num_sequences: int) -> None:
        """Raises `QueueFullError` if `num_sequences` more would exceed max_queued_requests."""
        limit = self.engine.config.limits.max_queued_requests
        queued = self.num_queued_sequences()
        if queued + num_sequences > limit:
            raise QueueFullError(queued, limit, self._retry_after(queued))

    def record_rejection(self, reason: str) -> None:
        """Counts a request refused before reaching the engine (e.g. "queue_full")."""
        self._send("reject", (reason,))

    def num_queued_sequences(self) -> int:
        """Sequences waiting to be scheduled, including adds the engine has not taken yet."""
        with self._queue_lock:
            return self._num_waiting + self._pending_sequences

    def _retry_after(self, queued: int) -> int:
        """Seconds until the queue has likely drained enough, from the recent finish rate."""
        finishes = list(self._finish_times)
        if len(finishes) < 2 or finishes[-1] <= finishes[0]:
            return 1
        rate = (len(finishes) - 1) / (finishes[-1] - finishes[0])
        return int(min(max(math.ceil(queued / rate), 1), 60))

    async def abort(self, request_id: str) -> None:
        self._send("abort", (request_id,))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads a LoRA adapter on the engine thread (between steps); raises `LoRAError`."""
        await self._on_engine_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a loaded LoRA adapter on the engine thread; whether it was loaded."""
        removed: bool = await self._on_engine_thread(self.engine.remove_lora, lora_int_id)
        return removed

    async def _on_engine_thread(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` run by the engine loop between steps, its result (or error) awaited here."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._send("call", (fn, args, loop, done))
        return await done

    def cut_streams(self, reason: str) -> int:
        """Ends every open stream with `StreamCutError(reason)` and aborts its request, one log
        line each; returns how many were cut."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            logger.warning("request %s cut: %s", request_id, reason)
            self._deliver(request_id, StreamCutError(reason))
            self._send("abort", (request_id,))
        return len(request_ids)

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
        return self._snapshot.num_blocks_free

    def kv_cache_total_blocks(self) -> int:
        return self._snapshot.num_blocks_total

    def kv_report(self) -> dict[str, float]:
        """`LLMEngine.kv_report()` from the stats of the engine loop's last iteration."""
        return self.engine.kv_report(self._snapshot)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; every stream still open gets an `EngineDeadError`."""
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout)
        self._dead_reason = self._dead_reason or "the engine was shut down"
        self._fail_streams()
        self.engine.shutdown()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        last_log = last_trim = time.monotonic()
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._snapshot = self.engine.last_scheduler_stats
                    with self._queue_lock:
                        self._num_waiting = self._snapshot.num_waiting_reqs
                else:
                    if time.monotonic() - last_trim >= IDLE_TRIM_INTERVAL_S:
                        # NOTE: big requests (and big refused ones, tokenized in the frontend's
                        # threads) leave freed memory in malloc's arenas; hand it back.
                        heap.trim()
                        last_trim = time.monotonic()
                    self._snapshot = self.engine.scheduler_stats()
                    self._wakeup.wait(timeout=IDLE_TRIM_INTERVAL_S)
                    self._wakeup.clear()
                self.last_step_time = time.monotonic()
                if time.monotonic() - last_log >= LOG_INTERVAL_S:
                    last_log = time.monotonic()
                    self._log_stats()
        except BaseException as exc:  # noqa: BLE001 - report, then fail every waiting stream
            # NOTE: a fatal error (a dead worker) is known and named: one line, no traceback.
            logger.critical("Engine loop died: %s: %s", type(exc).__name__, exc,
                            exc_info=None if getattr(exc, "fatal", False) else exc)
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            self._fail_streams()

    def _log_stats(self) -> None:
        for stat_logger in self.engine.stat_loggers:
            try:
                stat_logger.log()
            except Exception:  # noqa: BLE001 - a broken sink must not stop serving
                logger.exception("Stat logger %s failed", type(stat_logger).__name__)

    def _fail_streams(self) -> None:
        reason = self._dead_reason or "engine stopped"
        for request_id in list(self._streams):
            logger.warning("request %s cut: %s", request_id, reason)
            self._deliver(request_id, EngineDeadError(reason))

    def _drain_commands(self) -> None:
        taken = 0
        while self._commands:
            command, args = self._commands.popleft()
            if command == "add":
                self._add(args[0])
                taken += args[0].sampling_params.n
            elif command == "reject":
                self.engine.record_rejection(args[0])
            elif command == "call":
                self._answer_call(*args)
            else:
                out = self.engine.abort_request(args[0])
                if out is not None:
                    self._deliver(args[0], out)
        with self._queue_lock:
            self._pending_sequences -= taken
            self._num_waiting = self.engine.num_waiting_requests()

    @staticmethod
    def _answer_call(fn: Any, args: tuple, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            result, error = fn(*args), None
        except Exception as exc:  # noqa: BLE001 - the caller's error, raised where it awaits
            result, error = None, exc
        settle = (lambda: done.set_exception(error)) if error is not None else (lambda: done.set_result(result))
        try:
            loop.call_soon_threadsafe(lambda: None if done.done() else settle())
        except RuntimeError:  # NOTE: the caller's event loop has closed; nobody waits.
            pass

    def _add(self, req: EngineRequest) -> None:
        try:
            self.engine.add_processed(req)
        except Exception as exc:  # noqa: BLE001 - a request that cannot start fails alone
            if not isinstance(exc, ValueError):
                logger.exception("Request %s could not be added", req.request_id)
            self._deliver(req.request_id, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs over with one wake-up per event loop, not one per request."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for out in outputs:
            if out.finished:
                self._finish_times.append(now)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            self._call_soon(loop, _put_all, items)

    def _deliver(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._call_soon(stream[0], _put_all, [(stream[1], item)])

    def _call_soon(self, loop: asyncio.AbstractEventLoop, fn: Any, items: list) -> None:
        try:
            loop.call_soon_threadsafe(fn, items)
        except RuntimeError:  # NOTE: the streams' event loop has closed; nobody listens.
            for request_id, (stream_loop, _) in list(self._streams.items()):
                if stream_loop is loop:
                    self._streams.pop(request_id, None)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
