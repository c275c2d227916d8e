"""The engine core in a process of its own, behind a client with the core's methods.

`CoreProcessClient` starts `python -m pagoda.core_client` (no fork: a fresh interpreter, as
the parallel workers), which builds the `EngineCore` there (model, KV pool, scheduler,
proposer; under TP/PP the workers too) and answers the frontend's calls over one pipe:
`add_request`, `abort_request`, `stop_sequence`, `fail_request`, `record_rejection`,
`take_pending_stats`, `step`, `check_integrity`. `LLMEngine` holds either the core itself
(the default) or this client (`--core-process`), through the same methods.

What crosses the pipe is plain data: `EngineRequest`s, whose grammar travels as its source
text and is rebuilt on the core's side (`GrammarCompiler.from_source`); `CoreStep`s; stats.
Every answer carries the core's scheduler stats, so reading them costs no round trip. Stats a
call records for the frontend's step (a stop string's finish) come back and are added to it.

Failing loudly: the core process dies with its parent; if it dies first, or its pipe breaks,
the call raises `EngineCoreDiedError`, which is `fatal` (the engine loop stops and the server
exits non-zero, as for a dead parallel worker). An exception inside the core travels back and
is raised from the call, with its type when it can be rebuilt here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from pagoda.config import EngineConfig, LimitsConfig
from pagoda.engine_core import CoreStep, EngineCore, EngineCoreOutput
from pagoda.engine_setup import EngineParts
from pagoda.executor import START_TIMEOUT_S, WorkerProcess, accept_from, build_engine_parts
from pagoda.input_processor import EngineRequest
from pagoda.lora import LoRARequest
from pagoda.outputs import RequestMetrics
from pagoda.stats import IterationStats, SchedulerStats
from pagoda.structured_output import GrammarCompiler
from pagoda.worker import die_with_parent, receive, send

logger = logging.getLogger("pagoda")


class EngineCoreDiedError(RuntimeError):
    """The core process died or its pipe broke; the engine cannot go on."""

    fatal = True


class CoreProcessClient:
    """The frontend's handle on an `EngineCore` in another process (see the module docstring).

    `parts` are the core's engine parts without the runner (which stays there): the resolved
    config, the tokenizer, the block count and size, the vocabulary and EOS ids.
    """

    runner = None  # NOTE: the model runs in the core process; nothing here can reach it

    def __init__(self, config: EngineConfig) -> None:
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._stats = SchedulerStats()
        self.process, self.conn = _start(config)
        try:
            kind, value = self._receive(time.monotonic() + START_TIMEOUT_S)
            if kind != "ready":
                raise value  # NOTE: the core's own error (e.g. a ValueError naming a bad model)
        except BaseException:
            self.process.stop()
            raise
        self.parts: EngineParts = value[0]
        self._stats = value[1]  # NOTE: the pool as built, for the start-up report

    # ---- the core's methods ----------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> list[RequestMetrics]:
        source = req.grammar.source if req.grammar is not None else None
        return self._call("add_request", dataclasses.replace(req, grammar=None), source)

    def abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        return self._call("abort_request", request_id)

    def add_lora(self, request: LoRARequest) -> None:
        self._call("add_lora", request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", lora_int_id)

    def stop_sequence(self, request_id: str, sample_index: int, num_output_tokens: int,
                      stats: IterationStats | None = None) -> None:
        recorded = self._call("stop_sequence", request_id, sample_index, num_output_tokens, stats is not None)
        if stats is not None:
            stats.add_request_records(recorded)

    def fail_request(self, request_id: str, exc: Exception,
                     stats: IterationStats | None = None) -> list[EngineCoreOutput]:
        outputs, recorded = self._call("fail_request", request_id, _portable(exc), stats is not None)
        if stats is not None:
            stats.add_request_records(recorded)
        return outputs

    def record_rejection(self, reason: str) -> None:
        self._call("record_rejection", reason)

    def take_pending_stats(self) -> IterationStats:
        return self._call("take_pending_stats")

    def step(self) -> CoreStep:
        return self._call("step")

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def has_unfinished_requests(self) -> bool:
        return self._call("has_unfinished_requests")

    def scheduler_stats(self) -> SchedulerStats:
        """The core's stats as of its last answer (every call's answer carries them)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._stats.num_waiting_reqs

    def shutdown(self) -> None:
        """Stops the core (and what it started: parallel workers); idempotent."""
        with self._lock:
            if self._dead is None:
                self._dead = "the engine core was shut down"
                try:
                    send(self.conn, None)
                    self.process.proc.wait(10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self.process.stop()

    # ---- the pipe ----------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._dead is not None:
                raise EngineCoreDiedError(self._dead)
            try:
                send(self.conn, (method, args))
            except OSError as e:
                raise self._died(f"lost the pipe to the engine core ({e!r})") from e
            kind, value, self._stats = self._receive()
        if kind == "error":
            raise value
        return value

    def _receive(self, deadline: float | None = None) -> Any:
        """The core's next answer; a step may take as long as it takes (no deadline)."""
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise self._died(f"{self.process.name} exited with {self.process.proc.returncode}")
            if deadline is not None and time.monotonic() > deadline:
                raise self._died(f"{self.process.name} did not start within {START_TIMEOUT_S:g} s")
        try:
            return receive(self.conn)
        except (EOFError, OSError) as e:
            time.sleep(0.2)  # NOTE: a dying core closes its pipe just before it exits
            code = self.process.proc.poll()
            raise self._died(f"lost the pipe to {self.process.name}"
                             + (f": it exited with {code}" if code is not None else f" ({e!r})")) from e

    def _died(self, why: str) -> EngineCoreDiedError:
        self._dead = why
        logger.error("Engine core: %s", why)
        return EngineCoreDiedError(why)


def _start(config: EngineConfig) -> tuple[WorkerProcess, Connection]:
    """Starts the core process and hands it the config; returns it and its connection."""
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    host, port = listener.address
    env = {**os.environ, "PAGODA_CORE_ADDR": f"{host}:{port}", "PAGODA_CORE_KEY": key.hex(),
           "PAGODA_CORE_LOG_LEVEL": str(logger.getEffectiveLevel())}
    process = WorkerProcess(0, subprocess.Popen([sys.executable, "-m", "pagoda.core_client"], env=env),
                            role="engine core")
    try:
        conn = accept_from(listener, [process])
        send(conn, config)
    except BaseException:
        process.stop()
        raise
    finally:
        listener.close()
    return process, conn


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a trip through pickle, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may refuse pickling its own way
        portable = RuntimeError(f"{type(exc).__name__}: {exc}")
        if getattr(exc, "fatal", False):
            portable.fatal = True  # type: ignore[attr-defined]
        return portable


# ---- the core process ------------------------------------------------------------------------
class _CoreServer:
    """The core process's side: builds the core, then answers calls until told to stop."""

    def __init__(self, conn: Connection, config: EngineConfig) -> None:
        self.conn = conn
        start = time.perf_counter()
        parts = build_engine_parts(config)
        self.core = EngineCore(parts, parts.eos_token_ids)
        # NOTE: no sandbox: this compiler only rebuilds grammars the frontend's compiled already.
        self.grammars = GrammarCompiler(parts.tokenizer, parts.vocab_size,
                                        limits=LimitsConfig(grammar_compile_workers=0))
        logger.info("Engine core process %d ready in %.1f s", os.getpid(), time.perf_counter() - start)
        send(conn, ("ready", (dataclasses.replace(parts, runner=None), self.core.scheduler_stats())))

    def serve(self) -> None:
        while (message := receive(self.conn)) is not None:
            method, args = message
            try:
                reply: tuple[str, Any] = ("ok", getattr(self, f"_{method}")(*args))
            except Exception as exc:  # noqa: BLE001 - the frontend raises it from its call
                reply = ("error", _portable(exc))
            send(self.conn, (*reply, self.core.scheduler_stats()))
        self.core.shutdown()

    def _add_request(self, req: EngineRequest, source: str | None) -> list[RequestMetrics]:
        grammar = self.grammars.from_source(source) if source is not None else None
        return self.core.add_request(dataclasses.replace(req, grammar=grammar))

    def _abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        return self.core.abort_request(request_id)

    def _add_lora(self, request: LoRARequest) -> None:
        self.core.add_lora(request)

    def _remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def _stop_sequence(self, request_id: str, sample_index: int, num_output_tokens: int,
                       in_step: bool) -> IterationStats:
        stats = IterationStats()
        self.core.stop_sequence(request_id, sample_index, num_output_tokens, stats if in_step else None)
        return stats

    def _fail_request(self, request_id: str, exc: Exception,
                      in_step: bool) -> tuple[list[EngineCoreOutput], IterationStats]:
        stats = IterationStats()
        return self.core.fail_request(request_id, exc, stats if in_step else None), stats

    def _record_rejection(self, reason: str) -> None:
        self.core.record_rejection(reason)

    def _take_pending_stats(self) -> IterationStats:
        return self.core.take_pending_stats()

    def _step(self) -> CoreStep:
        return self.core.step()

    def _check_integrity(self) -> None:
        self.core.check_integrity()

    def _has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()


def main() -> None:
    """`python -m pagoda.core_client`: fetch the config from the frontend, build, serve."""
    die_with_parent()
    # NOTE: Ctrl-C in a terminal reaches the whole process group: the frontend drains and then
    # stops the core itself; a core that died first would cut every stream.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = int(os.environ.get("PAGODA_CORE_LOG_LEVEL", logging.INFO))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s core: %(message)s")
    logger.setLevel(level)
    host, port = os.environ["PAGODA_CORE_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGODA_CORE_KEY"]))
    config: EngineConfig = receive(conn)
    try:
        server = _CoreServer(conn, config)
    except Exception as exc:  # noqa: BLE001 - the frontend raises it, naming the cause
        send(conn, ("error", _portable(exc)))
        sys.exit(1)
    try:
        server.serve()
    except (EOFError, OSError):
        # NOTE: the frontend is gone; nothing is left to answer.
        server.core.shutdown()
        sys.exit(1)


if __name__ == "__main__":
    main()
