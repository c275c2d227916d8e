"""The parallel executor: the engine's side of tensor and pipeline parallelism.

`start_parallel_engine_parts` starts this node's worker processes (pagoda/worker.py), waits
until every rank has loaded its shard and agreed on the KV block count, and returns the
engine's parts with a `MultiprocExecutor` in the runner's seat. Each step the executor sends
the scheduler's output to world rank 0 (its requests as `WorkerRequest` copies, with grammar
masks and seeded generators' states computed here: worker_step.py); every worker prepares its
own inputs and runs the same `ModelRunner` as one process, and the last stage samples: token
ids come back, never logits. Every request's state stays in the engine.

The same failure rules as one process: a step that fails on the workers (preparing inputs,
the model's forward on every rank of a stage, sampling) comes back as `WorkerStepFailed`, and
the engine reruns it request by request (isolation.py), failing only the culprit. Failing loudly: a worker that dies, or does
not answer within the step timeout, raises `WorkerDiedError`, which the engine does not retry
(`fatal`); the server then exits 1.
`shutdown` stops every local worker and leaves no orphan (workers also die with their parent).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine_setup import EngineParts, build_model_parts, eos_token_ids, resolve_max_model_len
from pagoda.lora import LoRAError, LoRARequest
from pagoda.models.loader import load_hf_config, load_tokenizer, resolve_model_path
from pagoda.pooling import PoolerConfig
from pagoda.request import Request
from pagoda.sampler import SamplerOutput
from pagoda.scheduler import SchedulerOutput
from pagoda.worker import WorkerSpec, receive, send
from pagoda.worker_step import LoRAControl, LoRAReply, WorkerOutput, WorkerStepError, for_workers

logger = logging.getLogger("pagoda")

START_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 600.0


class WorkerDiedError(RuntimeError):
    """A parallel worker died or stopped answering; the engine cannot go on."""

    fatal = True


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class WorkerProcess:
    """One worker: a `python -m pagoda.worker` subprocess (no fork, no re-import of the
    caller's main module), and for world rank 0 the connection the steps travel on.

    Args:
        role: what the process is called in errors (default: its rank).
    """

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], role: str | None = None) -> None:
        self.rank = rank
        self.proc = proc
        self.role = role or f"rank {rank}"
        self.conn: Connection | None = None

    @property
    def name(self) -> str:
        return f"{self.role} (pid {self.proc.pid})"

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.is_alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_workers(config: EngineConfig, init_addr: str) -> list[WorkerProcess]:
    """Starts this node's ranks and hands each its `WorkerSpec`; world rank 0 keeps its
    connection to the engine."""
    par = config.parallel
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    host, port = listener.address
    first = par.node_rank * par.ranks_per_node
    threads = max(1, (os.cpu_count() or 1) // par.ranks_per_node)
    env = {**os.environ, "PAGODA_WORKER_ADDR": f"{host}:{port}", "PAGODA_WORKER_KEY": key.hex()}
    workers = {rank: WorkerProcess(rank, subprocess.Popen(
        [sys.executable, "-m", "pagoda.worker", str(rank)], env=env))
        for rank in range(first, first + par.ranks_per_node)}
    try:
        for _ in workers:
            conn = accept_from(listener, list(workers.values()))
            rank = receive(conn)
            send(conn, WorkerSpec(config, rank, init_addr, threads))
            if rank == 0:
                workers[rank].conn = conn
            else:
                conn.close()
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    finally:
        listener.close()
    return list(workers.values())


def accept_from(listener: Listener, workers: list[WorkerProcess]) -> Connection:
    """The next worker's connection; fails if a worker dies first or none comes in time."""
    box: list[Connection] = []
    thread = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.2)
        dead = [w.name for w in workers if not w.is_alive()]
        if dead or time.monotonic() > deadline:
            raise WorkerDiedError(f"parallel workers failed to start: {', '.join(dead) or 'timeout'}")
    return box[0]


class WorkerStepFailed(RuntimeError):
    """A step failed on the workers (the workers go on): the engine reruns it request by
    request, as in one process."""


class MultiprocExecutor:
    """Sends each step's scheduler output to the parallel workers; the tokens come back."""

    def __init__(self, workers: list[WorkerProcess], vocab_size: int) -> None:
        self.workers = workers
        conn = workers[0].conn
        assert conn is not None
        self.conn = conn
        self.vocab_size = vocab_size
        self._loras: dict[int, LoRARequest] = {}  # NOTE: what the workers loaded, as they were asked

    def add_lora(self, request: LoRARequest) -> None:
        """Loads an adapter on every worker (each its shard and stage), unless they have it;
        raises `LoRAError` with a rank's reason if one refuses it (then none keeps it)."""
        if self._loras.get(request.lora_int_id) == request:
            return
        reply = self._control(LoRAControl(request=request))
        if reply.error is not None:
            raise LoRAError(reply.error)
        self._loras[request.lora_int_id] = request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops an adapter on every worker; whether they had it."""
        self._loras.pop(lora_int_id, None)
        reply = self._control(LoRAControl(remove_id=lora_int_id))
        if reply.error is not None:
            raise LoRAError(reply.error)
        return reply.removed

    def _control(self, control: LoRAControl) -> LoRAReply:
        send(self.conn, control)
        reply = self._wait()
        assert isinstance(reply, LoRAReply), reply
        return reply

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        send(self.conn, for_workers(out, self.vocab_size))
        reply = self._wait()
        if isinstance(reply, WorkerStepError):
            raise WorkerStepFailed(f"{reply.kind}: {reply.message}")
        assert isinstance(reply, WorkerOutput), reply
        return reply.for_engine(out)

    def _wait(self) -> WorkerOutput | WorkerStepError | LoRAReply:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not self.conn.poll(0.2):
            self.check_workers()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the workers did not answer within {STEP_TIMEOUT_S:g} s")
        try:
            reply: WorkerOutput | WorkerStepError | LoRAReply = receive(self.conn)
        except (EOFError, OSError) as e:
            # NOTE: rank 0 usually falls because another rank did; name every dead one.
            deadline = time.monotonic() + 3
            while all(w.is_alive() for w in self.workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.check_workers()
            raise WorkerDiedError(f"lost the connection to rank 0 ({e!r})") from e
        return reply

    def check_workers(self) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            raise WorkerDiedError(", ".join(f"{w.name} exited with {w.proc.returncode}"
                                            for w in dead))

    def restore_threads(self) -> None:
        """Nothing to restore here: the workers own their threads."""

    def shutdown(self) -> None:
        try:
            send(self.conn, None)
        except (OSError, BrokenPipeError):
            pass
        deadline = time.monotonic() + 10
        for worker in self.workers:
            try:
                worker.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            worker.stop()


def _await_ready(workers: list[WorkerProcess]) -> dict[str, Any]:
    conn = workers[0].conn
    assert conn is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.5):
        dead = [w for w in workers if not w.is_alive()]
        if dead or time.monotonic() > deadline:
            for w in workers:
                w.stop()
            why = ", ".join(f"{w.name} exited with {w.proc.returncode}" for w in dead) or "timeout"
            raise WorkerDiedError(f"parallel workers failed to start ({why}); see their log")
    kind, info = receive(conn)
    assert kind == "ready"
    return info


def check_parallel_sizes(hf_config: object, tp_size: int, pp_size: int) -> None:
    """Refuses, before any worker starts, a layout the model cannot be split into."""
    c: Any = hf_config
    sizes = {"num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
             "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    if getattr(c, "moe_intermediate_size", None):  # NOTE: Qwen3-MoE's experts (Mixtral's: intermediate_size)
        sizes["moe_intermediate_size"] = c.moe_intermediate_size
    valid = [t for t in range(1, sizes["num_attention_heads"] + 1)
             if all(v % t == 0 for v in sizes.values())]
    if tp_size not in valid:
        shape = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide this model ({shape}); "
                         f"valid sizes: {valid}.")
    if pp_size > c.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's "
                         f"{c.num_hidden_layers} layers.")


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """The tokenizer and, in this process or in parallel workers, the model and its KV pool."""
    if config.parallel.world_size > 1:
        return start_parallel_engine_parts(config)
    return build_model_parts(config)


def start_parallel_engine_parts(config: EngineConfig) -> EngineParts:
    """Node 0's engine parts, with this node's workers started and ready."""
    path = resolve_model_path(config.model.model)
    hf_config = load_hf_config(path, config.model.hf_overrides)
    tokenizer = load_tokenizer(path, config.model.chat_template, config.model.tokenizer)
    config = config.with_max_model_len(resolve_max_model_len(config.model.max_model_len,
                                                             hf_config))
    par = config.parallel
    check_parallel_sizes(hf_config, par.tensor_parallel_size, par.pipeline_parallel_size)
    workers = start_workers(config, par.dist_init_addr or free_address())
    info = _await_ready(workers)
    executor = MultiprocExecutor(workers, info["vocab_size"])
    logger.info("Parallel engine: tensor_parallel_size=%d, pipeline_parallel_size=%d, %d node(s); "
                "%d KV blocks per rank", par.tensor_parallel_size, par.pipeline_parallel_size,
                par.nnodes, info["num_blocks"])
    return EngineParts(config, tokenizer, executor, info["num_blocks"], info["block_bytes"],
                       eos_token_ids(hf_config, tokenizer), info["vocab_size"],
                       pooler=PoolerConfig.from_hf_config(hf_config))


def run_headless(config: EngineConfig) -> int:
    """A node other than 0: runs its ranks until they exit (the engine is on node 0)."""
    assert config.parallel.dist_init_addr is not None
    workers = start_workers(config, config.parallel.dist_init_addr)
    try:
        return max((w.proc.wait() for w in workers), default=0)
    finally:
        for worker in workers:
            worker.stop()
