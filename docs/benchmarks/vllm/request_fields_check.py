"""pagoda's `repetition_detection` and `bad_words` tokenization against vLLM's own code.

    .venv/bin/python docs/benchmarks/vllm/request_fields_check.py make /tmp/fields         # pagoda
    ~/.cache/pagoda-peers/venv-vllm/bin/python docs/benchmarks/vllm/request_fields_check.py check /tmp/fields

`make` (pagoda's venv) writes, into the folder: SmolLM2's tokenizer; 20,000 random token
sequences (some ending with a repeated pattern) with random detection settings and pagoda's
verdict (`RepetitionDetectionParams.repeats`); and a list of words with the token sequences
pagoda's `InputProcessor` bans for each. `check` (the peers' venv, vLLM 0.32 installed by
../shared/peers/setup.sh) recomputes both with vLLM's `check_sequence_repetition` and
`SamplingParams.update_from_tokenizer` on the same tokenizer, and prints what disagrees.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ["Paris", " Paris", "lambda", "hello world", "  spaced", "New York", "ünïcödé", "42", "<|im_end|>",
         "don't", "Python3", "a", "the", "THE", "123456789", "🙂", "x" * 40]


def make(out: Path) -> None:
    from pagoda import SamplingParams
    from pagoda.engine import LLMEngine
    from pagoda.sampling_params import RepetitionDetectionParams

    engine = LLMEngine.from_engine_args("smollm2", (), log_stats=False, num_kv_blocks=64, max_model_len=512)
    out.mkdir(parents=True, exist_ok=True)
    engine.tokenizer.save_pretrained(out / "tokenizer")
    rng, cases = random.Random(0), []
    for _ in range(20000):
        mx = rng.randint(0, 6)
        detect = (mx, rng.randint(0, mx), rng.randint(2, 4))
        tokens = [rng.randint(0, rng.randint(1, 3)) for _ in range(rng.randint(0, 30))]
        if mx and rng.random() < 0.3:
            tokens += [rng.randint(0, 3) for _ in range(rng.randint(1, mx))] * detect[2]
        cases.append([detect, tokens, RepetitionDetectionParams(*detect).repeats(tokens)])
    banned = {w: [list(s) for s in engine.processor.check_params(SamplingParams(bad_words=[w])).bad_words_token_ids]
              for w in WORDS}
    (out / "cases.json").write_text(json.dumps({"repetition": cases, "bad_words": banned}))
    print(f"wrote {len(cases)} repetition cases and {len(banned)} bad words to {out}")


def check(out: Path) -> None:
    from vllm.sampling_params import RepetitionDetectionParams, SamplingParams
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.v1.core.sched.utils import check_sequence_repetition

    data = json.loads((out / "cases.json").read_text())
    wrong = [c for c in data["repetition"]
             if check_sequence_repetition(c[1], RepetitionDetectionParams(*c[0])) != c[2]]
    hits = sum(c[2] for c in data["repetition"])
    print(f"repetition_detection: {len(data['repetition']) - len(wrong)} of {len(data['repetition'])} "
          f"verdicts agree ({hits} repeats found); disagreeing: {wrong[:5]}")
    tokenizer = get_tokenizer(str(out / "tokenizer"))  # NOTE: vLLM's wrapper (max_token_id)
    same = 0
    for word, pagoda_ids in data["bad_words"].items():
        params = SamplingParams(bad_words=[word])
        params.update_from_tokenizer(tokenizer)
        theirs = [list(s) for s in params._bad_words_token_ids or []]
        same += theirs == pagoda_ids
        if theirs != pagoda_ids:
            print(f"bad_words {word!r}: pagoda {pagoda_ids}, vLLM {theirs}")
    print(f"bad_words: {same} of {len(data['bad_words'])} words tokenized alike")


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](Path(sys.argv[2]))
