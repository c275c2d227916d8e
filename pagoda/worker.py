"""A parallel worker: one rank's model shard and KV pool, driven step by step by the engine.

World rank 0 receives each step's scheduler output from the engine over a pipe (its requests
as `WorkerRequest` copies, worker_step.py) and broadcasts it to every rank. Each rank runs the
same `ModelRunner` as one process: it prepares its own inputs and runs its pipeline stage's
layers on its tensor-parallel shard (a stage after the first receives the previous stage's
hidden states and residual first, a stage before the last sends its own on). The last stage
gathers the logits over its group; its rank 0 samples and sends the tokens (`WorkerOutput`)
to world rank 0, which answers the engine.

A step that fails is answered as a `WorkerStepError` and the workers go on, as one process
goes on: preparing inputs and sampling run alike on every rank that runs them; a failure in
the model's forward is one when the stage's ranks all failed (the same inputs, the same code:
they agree on it, `launch.all_failed`), and the stage tells the stages after it instead of
sending hidden states (a `FAILED` header). A rank that failed alone, whose peers may be inside
a collective, ends; so does a worker on any other error: the engine, which watches its
workers, then fails loudly, naming the dead one, rather than waiting on a collective forever.
A worker also exits with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.distributed import launch
from pagoda.scheduler import SchedulerOutput
from pagoda.worker_step import LoRAControl, LoRAReply, WorkerOutput, WorkerStepError

if TYPE_CHECKING:
    from pagoda.model_inputs import ModelInputs
    from pagoda.model_runner import LastStageOutput
    from pagoda.models.llama import Intermediate

logger = logging.getLogger("pagoda")

# NOTE: what a stage sends the next one first each step: its hidden states follow, or its failure.
HIDDEN, FAILED = 0, 1


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to start."""

    config: EngineConfig
    rank: int
    init_addr: str
    num_threads: int


def send(conn: Connection, obj: object) -> None:
    """Plain pickle: torch's own reductions would pass tensors by file descriptor, which
    needs a multiprocessing parent's authkey these separately started processes lack."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # NOTE: PR_SET_PDEATHSIG = 1
    except OSError:
        logger.warning("PR_SET_PDEATHSIG unavailable; a worker may outlive a killed engine")


def _agree_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class Shard:
    """One rank's model shard, KV pool, and place in the pipeline."""

    def __init__(self, spec: WorkerSpec) -> None:
        from pagoda.engine_setup import build_model_parts, resolve_device

        config = spec.config
        par = config.parallel
        launch.join(spec.rank, par.world_size, spec.init_addr, resolve_device(config.model.device))
        from pagoda.models.loader import load_hf_config, resolve_model_path

        hf_config = load_hf_config(resolve_model_path(config.model.model), config.model.hf_overrides)
        num_layers = int(hf_config.num_hidden_layers)  # type: ignore[attr-defined]
        self.tp, self.stage = launch.layout(spec.rank, par.tensor_parallel_size,
                                            par.pipeline_parallel_size, num_layers)
        self.parts = build_model_parts(config, self.tp, self.stage, agree=_agree_min)
        self.runner = self.parts.runner
        self.model = self.runner.model
        self.hidden_size = self.model.dims.hidden_size
        weight = next(self.model.parameters())
        self.dtype = weight.dtype  # NOTE: hidden states and logits too
        self.device = weight.device  # NOTE: what the stages pass each other lives there (NCCL)
        self.samples = self.stage.is_last and self.tp.rank == 0
        self.control = launch.control_group(spec.rank, par.tensor_parallel_size,
                                            par.pipeline_parallel_size)
        self.node_threads = spec.num_threads * par.ranks_per_node

    @torch.inference_mode()
    def step(self, out: SchedulerOutput) -> WorkerOutput | WorkerStepError | None:
        """Runs this stage of the step; returns its result (or why it failed) on the rank that
        samples, else None.

        Preparing the inputs and sampling fail alike on every rank that runs them (the same
        inputs, no collective inside): such a failure is the answer, and the workers go on.
        A failure in the forward is the answer too once the stage's ranks agree they all
        failed; a rank that failed alone ends (its peers may be inside a collective)."""
        try:
            sampling, inputs = self.runner.preparer.prepare(out)
        except Exception as exc:  # noqa: BLE001 - the step's failure, not the worker's
            return self._failed(exc)
        result = self._forward(inputs)
        if not self.stage.is_last:
            self._send(result)
            return None
        if isinstance(result, WorkerStepError):
            return result if self.samples else None
        if self.tp.rank != 0:
            return None
        # NOTE: every other rank of the node waits while this one samples: it borrows their
        # cores (16 seeded top-p rows of SmolLM2's vocabulary: 98 ms on one Zen 3 core, 66 on two).
        torch.set_num_threads(self.node_threads)
        try:
            return WorkerOutput.of(*self.runner.sample(out, sampling, inputs, result))
        except Exception as exc:  # noqa: BLE001
            return self._failed(exc)
        finally:
            torch.set_num_threads(self.runner.max_threads)

    def lora_control(self, control: LoRAControl) -> LoRAReply:
        """Loads or drops an adapter on this rank; every rank answers the same (a rank that
        refuses an adapter makes every rank drop it)."""
        error, removed = None, False
        try:
            if control.request is not None:
                self.runner.add_lora(control.request)
            elif control.remove_id is not None:
                removed = self.runner.remove_lora(control.remove_id)
        except (ValueError, OSError) as exc:  # NOTE: LoRAError is a ValueError
            error = str(exc)
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        refused = next((e for e in errors if e is not None), None)
        if refused is not None and control.request is not None and error is None:
            self.runner.remove_lora(control.request.lora_int_id)
        return LoRAReply(refused, removed)

    def _forward(self, inputs: ModelInputs) -> LastStageOutput | Intermediate | WorkerStepError:
        """This stage's forward, or why it (or a stage before it) failed."""
        intermediate = None if self.stage.is_first else self._receive(inputs.num_tokens)
        if isinstance(intermediate, WorkerStepError):
            return intermediate
        try:
            return self.runner.forward(inputs, intermediate)
        except Exception as exc:
            if not launch.all_failed(self.control):
                logger.error("the model failed on this rank alone (%s: %s); its tensor-parallel "
                             "peers did not fail with it: ending", type(exc).__name__, exc)
                raise
            logger.warning("step failed: %s: %s", type(exc).__name__, exc)
            return WorkerStepError(type(exc).__name__, str(exc))

    def _failed(self, exc: Exception) -> WorkerStepError | None:
        logger.warning("step failed: %s: %s", type(exc).__name__, exc)
        return WorkerStepError(type(exc).__name__, str(exc)) if self.samples else None

    def _send(self, result: LastStageOutput | Intermediate | WorkerStepError) -> None:
        """Hands this stage's hidden states and residual (or its failure) to the next stage."""
        assert self.stage.next_rank is not None
        if isinstance(result, WorkerStepError):
            dist.send(torch.tensor([FAILED], device=self.device), self.stage.next_rank)
            dist.send_object_list([result], self.stage.next_rank)
            return
        dist.send(torch.tensor([HIDDEN], device=self.device), self.stage.next_rank)
        assert isinstance(result, tuple)
        h, residual = result
        assert residual is not None
        dist.send(h.contiguous(), self.stage.next_rank)
        dist.send(residual.contiguous(), self.stage.next_rank)

    def _receive(self, num_tokens: int) -> Intermediate | WorkerStepError:
        assert self.stage.prev_rank is not None
        header = torch.empty(1, dtype=torch.long, device=self.device)
        dist.recv(header, self.stage.prev_rank)
        if int(header) == FAILED:
            box: list[Any] = [None]
            dist.recv_object_list(box, self.stage.prev_rank)
            return box[0]
        h = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        residual = torch.empty_like(h)
        dist.recv(h, self.stage.prev_rank)
        dist.recv(residual, self.stage.prev_rank)
        return h, residual


def run_worker(spec: WorkerSpec, conn: Connection | None) -> None:
    """A worker process's main: start, report, then serve steps until told to stop."""
    die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {spec.rank}: %(message)s")
    torch.set_num_threads(spec.num_threads)
    shard = Shard(spec)
    if conn is not None:
        parts = shard.parts
        send(conn, ("ready", {"num_blocks": parts.num_blocks, "block_bytes": parts.block_bytes,
                             "vocab_size": parts.vocab_size}))
    while True:
        message: list[Any] = [receive(conn) if conn is not None else None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        if isinstance(message[0], LoRAControl):
            reply = shard.lora_control(message[0])
            if conn is not None:
                send(conn, reply)
            continue
        _answer(shard, spec.rank, conn, shard.step(message[0]))
    launch.leave()


def _answer(shard: Shard, rank: int, conn: Connection | None,
            reply: WorkerOutput | WorkerStepError | None) -> None:
    """Brings the sampling rank's reply to world rank 0, which hands it to the engine."""
    sampler = _sampler_rank(shard)
    if rank == 0:
        if sampler != 0:
            box: list[Any] = [None]
            dist.recv_object_list(box, sampler)
            reply = box[0]
        assert conn is not None
        send(conn, reply)
    elif rank == sampler:
        dist.send_object_list([reply], 0)


def _sampler_rank(shard: Shard) -> int:
    """The world rank that samples: tensor-parallel rank 0 of the last stage."""
    return (shard.stage.size - 1) * shard.tp.size


def main() -> None:
    """`python -m pagoda.worker RANK`: fetch the spec from the engine, then run."""
    rank = int(sys.argv[1])
    host, port = os.environ["PAGODA_WORKER_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGODA_WORKER_KEY"]))
    send(conn, rank)
    spec: WorkerSpec = receive(conn)
    if rank != 0:
        conn.close()
    try:
        run_worker(spec, conn if rank == 0 else None)
    except (RuntimeError, EOFError, OSError) as e:
        if not _is_lost_peer(e):
            raise
        # NOTE: another rank (or the engine) is gone: the engine names the dead one; one line here.
        logging.getLogger("pagoda").error("stopping: lost a peer (%s)", str(e).splitlines()[0][:200])
        sys.exit(1)


def _is_lost_peer(error: BaseException) -> bool:
    """Whether `error` says a connection to another rank or the engine closed."""
    if isinstance(error, (EOFError, ConnectionError)):
        return True
    text = str(error)
    return any(s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "Read error"))


if __name__ == "__main__":
    main()
