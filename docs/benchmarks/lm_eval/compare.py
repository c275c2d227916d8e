"""Compares two lm-eval runs' per-request results (`--log_samples`): every loglikelihood (and
is-greedy flag) of each task in both output folders, matched by document and request.
Usage: python docs/benchmarks/lm_eval/compare.py OUT_A OUT_B   (e.g. pagoda's run, transformers')
"""

import json
import sys
from pathlib import Path


def samples(out: str) -> dict[str, dict[int, list]]:
    """{task: {doc_id: filtered_resps}} from the newest samples file of each task under out."""
    found: dict[str, dict[int, list]] = {}
    for path in sorted(Path(out).rglob("samples_*.jsonl")):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        found[task] = {
            r["doc_id"]: r["filtered_resps"] for r in map(json.loads, path.read_text().splitlines())
        }
    return found


def pairs(resps: list) -> list[tuple[float, str]]:
    """Each request's (loglikelihood, is_greedy): multiple choice gives pairs, rolling a number."""
    return [(float(r[0]), str(r[1])) if isinstance(r, list) else (float(r), "") for r in resps]


a, b = samples(sys.argv[1]), samples(sys.argv[2])
for task in sorted(a.keys() & b.keys()):
    diffs, flips, total_a, total_b, n = [], 0, 0.0, 0.0, 0
    for doc, resps in a[task].items():
        for (la, ga), (lb, gb) in zip(pairs(resps), pairs(b[task][doc]), strict=True):
            diffs.append(abs(la - lb))
            flips += ga != gb
            total_a, total_b, n = total_a + la, total_b + lb, n + 1
    print(
        f"{task}: {n} requests, max |loglikelihood difference| {max(diffs):.2e}, "
        f"mean {sum(diffs) / n:.2e}; sums {total_a:.4f} / {total_b:.4f}; is_greedy differs in {flips}"
    )
