"""GrammarSandbox: user grammars are compiled in child processes that may crash or hang alone.

A 3,000-rule Lark grammar crashed llguidance's native code (SIGSEGV), taking the whole
server and every request in it down. Here each constraint is first converted and compiled
by one of a few children (`pagoda/grammar_child.py`, started on first use), each under an
address-space limit; the engine then builds its own matcher only from a grammar a child
compiled. A child that dies, overruns `timeout_s` or uses more than `cpu_s` CPU-seconds on
one compile (threads included: RLIMIT_CPU, set by the child before each) is killed or ends,
and is replaced; the request gets a `SandboxError` (the server's 400), naming the limit when
one was hit.

Invariants: one request at a time per child; a caller waits for a free child, never for
another request's compile beyond its timeout; children die with the engine's process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from copy import copy
from typing import IO, Any

logger = logging.getLogger("pagoda")

CHILD_SCRIPT = os.path.join(os.path.dirname(__file__), "grammar_child.py")
START_TIMEOUT_S = 60.0


class SandboxError(ValueError):
    """The constraint could not be compiled in the sandbox: invalid, crashed or too slow."""


class SandboxStartError(RuntimeError):
    """A compiling process could not start (the server's fault, never the request's)."""


def tokenizer_init(hf_tokenizer: Any, n_vocab: int) -> dict[str, Any]:
    """What a child needs to build llguidance's tokenizer (as `llguidance.hf` builds it)."""
    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return {"tokenizer": backend.to_str(), "n_vocab": n_vocab, "eos": hf_tokenizer.eos_token_id}


class _Child:
    """One compiling process and its pipes."""

    def __init__(self, init_line: str, memory_mib: int, cpu_s: int) -> None:
        # NOTE: -I keeps the environment's PYTHON* variables and the user's site out, so the
        # parent's import path is handed over: llguidance is found where the parent found it
        # (PYTHONPATH, `pip install --user` or `--target`), not only in the interpreter's site.
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", CHILD_SCRIPT, str(memory_mib), str(cpu_s), os.pathsep.join(sys.path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, encoding="utf-8",
            errors="surrogatepass")
        try:
            self._write(init_line)
            reply = self.read(START_TIMEOUT_S)
        except (OSError, ValueError):
            reply = None
        if reply is None or not reply.get("ready"):
            self.proc.kill()
            self.proc.wait()
            why = self._last_words()
            self.kill()
            raise SandboxStartError(f"a grammar-compiling process failed to start: {why}")

    def _last_words(self) -> str:
        """The last line the child wrote to stderr (why it failed to start)."""
        self._stderr.seek(0)
        lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else "it wrote nothing"

    def _write(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(line)
        stdin.flush()

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The child's reply, or None if it died or overran `timeout_s`."""
        try:
            self._write(json.dumps(request) + "\n")
        except (BrokenPipeError, OSError):
            return None
        return self.read(timeout_s)

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        stdout = self.proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        if not ready:
            return None
        line = stdout.readline()
        if not line.endswith("\n"):
            return None
        result: dict[str, Any] = json.loads(line)
        return result

    def exit_signal(self) -> int | None:
        """The signal that ended the child, if it ended (waits up to a second for it)."""
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None
        return -code if code < 0 else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._stderr.close()


class GrammarSandbox:
    """A lazily started pool of grammar-compiling processes.

    Args:
        init: the tokenizer description (`tokenizer_init`).
        num_workers: most children, so most compiles at once.
        timeout_s: longest one compile may take.
        memory_mib: each child's address-space limit (0: none).
        cpu_s: CPU-seconds one compile may use, all its threads together (default: `timeout_s`,
            rounded up; 0: no limit).
    """

    def __init__(self, init: dict[str, Any], num_workers: int, timeout_s: float,
                 memory_mib: int, cpu_s: int | None = None) -> None:
        self._init_line = json.dumps(init) + "\n"
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_mib = memory_mib
        self.cpu_s = max(1, math.ceil(timeout_s)) if cpu_s is None else cpu_s
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()
        self._num_started = 0
        self.num_failures = 0

    def grammar_text(self, request: dict[str, Any]) -> str:
        """The grammar a child compiled for `request` (kind, spec and JSON options).

        Raises:
            SandboxError: the library refused it, crashed on it, or overran the timeout.
        """
        child = self._acquire()
        start = time.monotonic()
        reply = child.ask(request, self.timeout_s)
        if reply is None:
            elapsed = time.monotonic() - start
            ended_by = child.exit_signal() if elapsed < self.timeout_s else None
            self._lose(child)
            raise self._failure(request["kind"], elapsed, ended_by)
        self._idle.put(child)
        if "error" in reply:
            raise SandboxError(reply["error"])
        grammar: str = reply["grammar"]
        return grammar

    def _failure(self, kind: str, elapsed: float, ended_by: int | None) -> SandboxError:
        """The request's error once its child was lost (logged, counted); `ended_by`: the
        signal that ended it, if it ended on its own."""
        self.num_failures += 1
        if ended_by == signal.SIGXCPU:
            logger.warning("a %s used more than %d CPU-seconds to compile; its process was stopped", kind, self.cpu_s)
            return SandboxError(f"compiling this {kind} used more than {self.cpu_s} CPU-seconds "
                                "(--grammar-compile-timeout)")
        if elapsed >= self.timeout_s:
            logger.warning("a %s took more than %g s to compile; its process was stopped", kind, self.timeout_s)
            return SandboxError(f"compiling this {kind} took more than {self.timeout_s:g} s "
                                "(--grammar-compile-timeout)")
        logger.warning("the grammar compiler crashed on a %s; its process was replaced", kind)
        return SandboxError(f"the grammar compiler failed on this {kind} (it crashed or ran out of "
                            "memory, --grammar-compile-memory)")

    def _acquire(self) -> _Child:
        """An idle child, a new one while fewer than `num_workers` run, or the next freed."""
        while True:
            with self._lock:
                try:
                    return self._idle.get_nowait()
                except queue.Empty:
                    pass
                if self._num_started < self.num_workers:
                    self._num_started += 1
                    break
            try:
                # NOTE: polled, because a busy child that dies frees a slot, not a child.
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue
        try:
            return _Child(self._init_line, self.memory_mib, self.cpu_s)
        except Exception:
            with self._lock:
                self._num_started -= 1
            raise

    def _lose(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._num_started -= 1

    def close(self) -> None:
        """Stops every idle child (a busy one ends when the engine's process does)."""
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            self._lose(child)
