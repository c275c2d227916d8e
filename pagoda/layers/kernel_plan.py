"""KernelPlan: which kernel each linear takes, by row count, chosen by measurement on this CPU.

A bf16 linear can be computed by several paths, each reading the weight in its own storage:
- `gemv`: the native GEMV kernel on the plain (checkpoint-layout) weight;
- `gemm`: the native small-M GEMM on its packed panels;
- `onednn`: oneDNN's prepacked matmul (AMX tiles or AVX512_BF16 where the CPU has them);
- `torch`: `F.linear` on the plain weight.
Which is fastest depends on the CPU (docs/performance.md: on an AMX Xeon oneDNN wins 1.8-6.5x
from 16 rows, on Zen 4 the own GEMM wins) and on the row count, so it is measured, not assumed:
`measure_shapes` times every available path per weight shape and row bucket on the model's own
weight shapes, `decide` turns the timings into a plan, and the plan is cached per (CPU model and
flags, torch version, kernel build, threads, shapes) under the user's cache directory.

Invariants:
- Memory: by default each weight is kept in one storage (`copies=1`): the storage whose best
  paths lose least against the fastest path of each bucket, summed over buckets in relative
  terms; `PAGODA_LINEAR_COPIES=2` allows a second storage where it is faster.
- A plan maps every row count >= 1 to one path (the last bucket is open-ended).
- `PAGODA_LINEAR_PLAN` ("1-8:gemv,9-32:gemm,33+:onednn", or one path name) forces the plan
  for every shape; a path this machine lacks is a ValueError naming the ones it has.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger("pagoda")

PATHS = ("gemv", "gemm", "onednn", "torch")
STORAGE = {"gemv": "plain", "gemm": "panels", "onednn": "onednn", "torch": "plain"}
# NOTE: the upper row count of each bucket, which is also the count it is measured at; rows
# past the last bucket take its path. Powers of two: step sizes move in such steps, and the
# paths' costs change slowly in between.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PLAN_ENV, COPIES_ENV = "PAGODA_LINEAR_PLAN", "PAGODA_LINEAR_COPIES"
FORMAT_VERSION = 1

Shape = tuple[int, int]  # (out_features, in_features)
# timings[path][bucket] = seconds per weight of a shape, in a pass over several of them
Timings = Mapping[str, Mapping[int, float]]


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    """The path for each row bucket of one weight shape (`paths[i]` for rows up to BUCKETS[i])."""

    paths: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.paths) != len(BUCKETS):
            raise ValueError(f"a plan needs one path per bucket {BUCKETS}, got {self.paths}")
        unknown = sorted(set(self.paths) - set(PATHS))
        if unknown:
            raise ValueError(f"unknown linear paths {unknown}; known: {list(PATHS)}")

    def path_for(self, rows: int) -> str:
        for bound, path in zip(BUCKETS, self.paths, strict=True):
            if rows <= bound:
                return path
        return self.paths[-1]

    @property
    def storages(self) -> frozenset[str]:
        """The weight storages the plan's paths read."""
        return frozenset(STORAGE[p] for p in self.paths)

    def max_rows(self, path: str) -> int:
        """The largest row count up to which every bucket takes `path` (0: not even one row)."""
        rows = 0
        for bound, p in zip(BUCKETS, self.paths, strict=True):
            if p != path:
                return rows
            rows = bound
        return 1 << 62

    def describe(self) -> str:
        """'rows 1-8 gemv, 9-32 gemm, 33+ onednn'."""
        parts, start = [], 1
        for i, path in enumerate(self.paths):
            if i + 1 < len(self.paths) and self.paths[i + 1] == path:
                continue
            last = i + 1 == len(self.paths)
            span = f"{start}+" if last else (str(start) if start == BUCKETS[i] else f"{start}-{BUCKETS[i]}")
            parts.append(f"{span} {path}")
            start = BUCKETS[i] + 1
        return "rows " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """A ShapePlan per weight shape, with where it came from ("measured", "cached", "forced")."""

    shapes: Mapping[Shape, ShapePlan]
    source: str
    key: str = ""
    timings: Mapping[Shape, Timings] = dataclasses.field(default_factory=dict)

    def for_shape(self, shape: Shape) -> ShapePlan | None:
        return self.shapes.get(shape)

    def describe(self) -> str:
        """One line for the start-up log: the plan of each distinct shape."""
        by_plan: dict[str, list[str]] = {}
        for (n, k), plan in sorted(self.shapes.items()):
            by_plan.setdefault(plan.describe(), []).append(f"{n}x{k}")
        body = "; ".join(f"{plan} [{', '.join(shapes)}]" for plan, shapes in by_plan.items())
        return f"linear ({self.source}): {body}"

    def summary(self) -> str:
        """The plan of the shape whose weights are most (the info metric's label)."""
        if not self.shapes:
            return ""
        shape = max(self.shapes, key=lambda s: s[0] * s[1])
        return self.shapes[shape].describe()

    def to_json(self) -> dict[str, object]:
        return {"version": FORMAT_VERSION, "key": self.key,
                "shapes": {f"{n}x{k}": list(p.paths) for (n, k), p in self.shapes.items()},
                "timings_s": {f"{n}x{k}": {path: {str(b): t for b, t in by_bucket.items()}
                                           for path, by_bucket in t_shape.items()}
                              for (n, k), t_shape in self.timings.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, object], source: str) -> KernelPlan:
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"kernel plan format {data.get('version')!r}, expected {FORMAT_VERSION}")
        shapes, timings = {}, {}
        for name, paths in dict(data["shapes"]).items():  # type: ignore[call-overload]
            shapes[_shape(name)] = ShapePlan(tuple(paths))
        for name, by_path in dict(data.get("timings_s", {})).items():  # type: ignore[call-overload]
            timings[_shape(name)] = {p: {int(b): float(t) for b, t in v.items()} for p, v in by_path.items()}
        return cls(shapes, source, str(data.get("key", "")), timings)

    def timing_table(self) -> list[str]:
        """Lines of milliseconds per pass, a shape's paths by bucket (what `pagoda tune` prints)."""
        lines = []
        for (n, k), by_path in sorted(self.timings.items()):
            lines.append(f"{n}x{k}: " + self.shapes[(n, k)].describe())
            lines.append("  rows " + "".join(f"{b:>9}" for b in BUCKETS))
            for path, by_bucket in by_path.items():
                cells = (f"{1e3 * by_bucket[b]:9.2f}" if b in by_bucket else f"{'-':>9}" for b in BUCKETS)
                lines.append(f"  {path:<6}" + "".join(cells))
        return lines


def _shape(name: object) -> Shape:
    n, _, k = str(name).partition("x")
    return int(n), int(k)


# ------------------------------------------------------------------------------- decisions


def decide(timings: Timings, copies: int = 1) -> ShapePlan:
    """The plan for one shape from its measured timings.

    Args:
        timings: seconds per weight, by path then bucket; a path covers the buckets from the
            first up to where `measure` stopped timing it (a path this CPU lacks is absent).
        copies: how many storages of the weight may be kept (1 or 2).
    """
    if copies not in (1, 2):
        raise ValueError(f"{COPIES_ENV} must be 1 or 2, got {copies}")
    paths = [p for p in PATHS if p in timings]
    if not paths:
        raise ValueError("no linear path was measured")
    timings = {p: _extrapolated(p, timings[p]) for p in paths}
    best = {b: min(timings[p][b] for p in paths) for b in BUCKETS}

    def within(storages: Iterable[str]) -> tuple[float, tuple[str, ...]]:
        allowed = [p for p in paths if STORAGE[p] in storages]
        choice = tuple(min(allowed, key=lambda p: (timings[p][b], PATHS.index(p))) for b in BUCKETS)
        cost = sum(timings[p][b] / best[b] for p, b in zip(choice, BUCKETS, strict=True))
        return cost, choice

    storages = sorted({STORAGE[p] for p in paths}, key=lambda s: [STORAGE[p] for p in PATHS].index(s))
    options: list[tuple[str, ...]] = [(s,) for s in storages]
    if copies == 2:
        options += [(a, b) for i, a in enumerate(storages) for b in storages[i + 1:]]
    scored = []
    for i, option in enumerate(options):
        cost, choice = within(option)
        # NOTE: ties go to fewer storages, then to the earlier option (PATHS order).
        scored.append((round(cost, 9), len(option), i, choice))
    return ShapePlan(min(scored)[3])


def _extrapolated(path: str, by_bucket: Mapping[int, float]) -> dict[int, float]:
    """A path's timings with the buckets it was not timed at (`measure` stopped timing it there,
    as a clear loser) taken as its last timing times the ratio of rows."""
    measured = [b for b in BUCKETS if b in by_bucket]
    if measured != list(BUCKETS[:len(measured)]) or not measured:
        raise ValueError(f"path {path} has no timing for rows {[b for b in BUCKETS if b not in by_bucket]}")
    last = measured[-1]
    return {b: by_bucket[b] if b in by_bucket else by_bucket[last] * b / last for b in BUCKETS}


def parse_forced(text: str, available: Sequence[str]) -> ShapePlan:
    """A plan from PAGODA_LINEAR_PLAN: one path name, or 'A-B:path' / 'A+:path' spans that
    cover every row count from 1 on, in order (a span's bounds are bucket bounds or 1)."""
    text = text.strip()
    spans: list[tuple[int, int | None, str]] = []
    if ":" not in text:
        spans.append((1, None, text))
    else:
        for part in text.split(","):
            rng, _, path = (x.strip() for x in part.partition(":"))
            first, _, last = rng.rstrip("+").partition("-")
            try:
                spans.append((int(first), None if rng.endswith("+") else int(last or first), path))
            except ValueError:
                raise ValueError(f"{PLAN_ENV}={text!r}: {part.strip()!r} is not 'A-B:path' or 'A+:path'") from None
    unknown = sorted({p for *_, p in spans} - set(available))
    if unknown:
        raise ValueError(f"{PLAN_ENV}={text!r}: path(s) {unknown} not available on this machine; "
                         f"available: {list(available)}")
    paths: list[str] = []
    expect = 1
    for lo, hi, path in spans:
        if lo != expect:
            raise ValueError(f"{PLAN_ENV}={text!r}: spans must cover rows from 1 on without gaps "
                             f"(expected one to start at {expect}, got {lo})")
        bounds = [b for b in BUCKETS if b >= lo and (hi is None or b <= hi)]
        if hi is not None and hi not in BUCKETS:
            raise ValueError(f"{PLAN_ENV}={text!r}: {hi} is not a bucket bound; bounds: {list(BUCKETS)}")
        paths += [path] * len(bounds)
        expect = (hi or BUCKETS[-1]) + 1
    if len(paths) < len(BUCKETS):
        paths += [paths[-1]] * (len(BUCKETS) - len(paths))
    return ShapePlan(tuple(paths[:len(BUCKETS)]))


def copies_from_env() -> int:
    raw = os.environ.get(COPIES_ENV, "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{COPIES_ENV} must be 1 or 2, got {raw!r}") from None


# ------------------------------------------------------------------------------ measuring

# One pass over the weights of a shape: (path, rows) -> seconds; built by the caller, which
# owns the storages (see pagoda.layers.linear.shape_timer).
PassFn = Callable[[str, int], float]


def measure(run_pass: PassFn, paths: Sequence[str], buckets: Sequence[int] = BUCKETS,
            repeats: int = 3, budget_s: float = 1.5) -> dict[str, dict[int, float]]:
    """Median seconds of `repeats` passes per path and bucket (after one warm-up pass each).

    A path slower than 4x the best one at a bucket, timed again to confirm it (one disturbed
    median on a shared machine must not rule out a path), is not timed at larger buckets
    (`decide` takes it as losing them by the same factor), so that a slow fallback does not eat
    the tuning budget; nor is any path but the best once `budget_s` is spent.
    """
    out: dict[str, dict[int, float]] = {p: {} for p in paths}
    start, dropped = time.perf_counter(), set[str]()

    def timed(p: str, b: int) -> float:
        return statistics.median(run_pass(p, b) for _ in range(repeats))

    for b in buckets:
        for p in paths:
            if p in dropped:
                continue
            run_pass(p, b)
            out[p][b] = timed(p, b)
        best = min(out[p][b] for p in paths if b in out[p])
        for p in paths:
            if p not in dropped and out[p][b] > 4 * best:
                out[p][b] = min(out[p][b], timed(p, b))
        best = min(out[p][b] for p in paths if b in out[p])
        for p in paths:
            if p not in dropped and (out[p][b] > 4 * best or time.perf_counter() - start > budget_s):
                if p != min(paths, key=lambda q: out[q].get(b, float("inf"))):
                    dropped.add(p)
    return out


def plan_key(shapes: Iterable[tuple[Shape, int]], build: str, threads: int, copies: int) -> str:
    """A digest of everything a plan depends on: CPU model and flags, torch, the kernel build,
    threads, the shapes and how many weights of each, the storages allowed."""
    import torch

    from pagoda.layers.cpu_kernels import loader

    cpu = loader.cpu_identity()
    text = json.dumps([FORMAT_VERSION, cpu, torch.__version__, build, threads, sorted(shapes), copies])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    from pagoda.layers.cpu_kernels import loader

    return loader.cache_root() / "kernel_plans"


def load_cached(key: str) -> KernelPlan | None:
    path = cache_dir() / f"{key}.json"
    try:
        return KernelPlan.from_json(json.loads(path.read_text()), "cached")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the cached kernel plan %s (%s); measuring again", path, exc)
        return None


def store(plan: KernelPlan) -> Path | None:
    """Writes the plan under its key (atomically); None, with a warning, where nothing is writable."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{plan.key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(plan.to_json(), indent=1))
        os.replace(tmp, folder / f"{plan.key}.json")
        return folder / f"{plan.key}.json"
    except OSError as exc:
        logger.warning("could not cache the kernel plan in %s (%s)", folder, exc)
        return None
