"""The kernel scripts' timer: the best of `n` wall-clock runs of `f` after one warm-up, in
seconds. Imported by the scripts beside it (run as `python docs/benchmarks/kernels/NAME.py`)."""
import time
from collections.abc import Callable


def best(f: Callable[[], object], n: int = 5) -> float:
    f()
    t = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - start)
    return t
