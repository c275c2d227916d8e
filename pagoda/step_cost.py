"""StepCost: a step's time as a line in its scheduled tokens, fitted online, and the token
budget that keeps a step near a target time (`--step-time-target-ms`).

A request that arrives while a step runs waits for that step, then for the step that
prefills it: under load, a step is the floor of every time to first token and of every
inter-token latency. On a CPU a step of a few hundred tokens takes a second or more, and
throughput barely grows past a few dozen rows, so bounding the step's time costs little
throughput and keeps the floor near the target. The line (overhead + per-token cost) is fitted
by least squares over the last steps, so it follows the model, the CPU, the context lengths
and whatever else shares the machine; until enough steps are seen the configured token budget
holds.
"""

from __future__ import annotations

from collections import deque

# NOTE: a step never shrinks below this many tokens, whatever the fit says: a target that the
# fixed overhead alone exceeds would otherwise starve throughput for no latency gain.
MIN_STEP_TOKENS = 16
MIN_SAMPLES = 4


class StepCost:
    """The last `window` steps' (tokens, seconds), and the line through them."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, num_tokens: int, seconds: float) -> None:
        """One step's scheduled tokens and its time (steps that ran nothing are not kept)."""
        if num_tokens > 0 and seconds > 0:
            self._samples.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(overhead seconds, seconds a token), or None before `MIN_SAMPLES` steps.

        With steps of one size, or a slope the noise made non-positive, the line is taken
        through the origin (all time per token): budgets then err on the short side.
        """
        if len(self._samples) < MIN_SAMPLES:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in self._samples)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in self._samples)
        if sxx > 0 and sxy > 0:
            per_token = sxy / sxx
            overhead = mean_y - per_token * mean_x
            if overhead >= 0:
                return overhead, per_token
        return 0.0, mean_y / mean_x

    def budget(self, target_s: float, ceiling: int) -> int:
        """The most tokens a step can take and still end within `target_s` by the fit, between
        `MIN_STEP_TOKENS` and `ceiling` (the configured budget: also the answer before a fit)."""
        line = self.fit()
        if line is None:
            return ceiling
        overhead, per_token = line
        tokens = int((target_s - overhead) / per_token + 1e-6)  # NOTE: 39.9999... is 40
        return min(ceiling, max(MIN_STEP_TOKENS, tokens))
