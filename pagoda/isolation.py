"""Running a step so that a failure fails only the request that caused it.

`execute_isolating` runs the scheduled batch once; if the model call or the sampler raises,
it runs each request of the batch alone, in the scheduled order, and reports the ones that
still fail. Seeded requests get their generator state back before the rerun, so an innocent
request's tokens are exactly those it would have drawn had the step not failed.

Invariant: nothing here touches the scheduler or the block pool; the engine applies the
`StepResult` (advances the requests that ran, fails the culprits, preempts the requests that
read KV a culprit was to write in the same step; see `untrusted_blocks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.pooling import PooledPart
from pagoda.request import Request
from pagoda.sampler import SamplerOutput, TokenLogprobs
from pagoda.scheduler import SchedulerOutput

logger = logging.getLogger("pagoda")


class StepRunner(Protocol):
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]: ...


@dataclass
class StepResult:
    """What a step did: requests that ran (with their token counts), samples, prompt logprobs
    scored, pooled parts, failures."""

    executed: list[tuple[Request, int]] = field(default_factory=list)
    samples: dict[Request, tuple[list[int], TokenLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[Request, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[Request, PooledPart] = field(default_factory=dict)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)

    def add_run(self, out: SchedulerOutput, sampled: list[Request],
                result: SamplerOutput | None) -> None:
        self.executed.extend(zip(out.requests, out.num_scheduled_tokens, strict=True))
        if result is not None:
            for i, (request, logprobs) in enumerate(zip(sampled, result.logprobs, strict=True)):
                self.samples[request] = (result.emitted(i), logprobs)
            self.prompt_logprobs.update(result.prompt_logprobs)
            self.pooled.update(result.pooled)


def execute_isolating(runner: StepRunner, out: SchedulerOutput) -> StepResult:
    """Runs `out`; on failure, reruns its requests one at a time to find the culprits."""
    saved = {r: r.generator.get_state() for r in out.requests if r.generator is not None}
    result = StepResult()
    try:
        result.add_run(out, *runner.execute(out))
        return result
    except Exception as exc:  # noqa: BLE001 - one request must not fail its whole batch
        if getattr(exc, "fatal", False):
            raise  # NOTE: e.g. a dead parallel worker: no request can run any more
        if len(out.requests) == 1:
            result.failed.append((out.requests[0], exc))
            return result
        logger.warning("A step of %d requests failed (%s: %s); rerunning them one at a time",
                       len(out.requests), type(exc).__name__, exc)
    for request, num_tokens in zip(out.requests, out.num_scheduled_tokens, strict=True):
        if request in saved:
            request.generator.set_state(saved[request])  # type: ignore[union-attr]
        alone = out.alone(request, num_tokens)
        try:
            result.add_run(alone, *runner.execute(alone))
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "fatal", False):
                raise
            result.failed.append((request, exc))
    return result


def untrusted_blocks(failed: list[tuple[Request, Exception]], block_size: int) -> set[tuple[int, int]]:
    """Blocks the failed requests were to fill in this step (call before freeing them), as
    (KV cache group, block id): group 0 `block_ids`, group 1 a mixed model's `sliding_block_ids`.

    NOTE: a block is named for prefix caching when scheduled, so another request of the same
    step may have hit it and read K/V its writer never wrote; such readers must recompute.
    """
    blocks: set[tuple[int, int]] = set()
    for request, _ in failed:
        first = request.num_computed_tokens // block_size
        blocks.update((0, b) for b in request.block_ids[first:])
        blocks.update((1, b) for b in request.sliding_block_ids[first:])
    return blocks


def uses_any(request: Request, blocks: set[tuple[int, int]]) -> bool:
    if not blocks:
        return False
    return (any((0, b) in blocks for b in request.block_ids)
            or any((1, b) in blocks for b in request.sliding_block_ids))
