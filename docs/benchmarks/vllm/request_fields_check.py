"""pagoda's `repetition_detection`, `bad_words` tokenization and `thinking_token_budget` against
vLLM's own code.

    .venv/bin/python docs/benchmarks/vllm/request_fields_check.py make /tmp/fields         # pagoda
    ~/.cache/pagoda-peers/venv-vllm/bin/python docs/benchmarks/vllm/request_fields_check.py check /tmp/fields

`make` (pagoda's venv) writes, into the folder: SmolLM2's tokenizer; 20,000 random token
sequences (some ending with a repeated pattern) with random detection settings and pagoda's
verdict (`RepetitionDetectionParams.repeats`); and a list of words with the token sequences
pagoda's `InputProcessor` bans for each; and 5,000 free-running token streams (a random
prompt, maybe opening the thinking, random outputs with thinking sections opened and closed)
with a random budget, and the output once pagoda's `ThinkingBudget` forced what it must. `check`
(the peers' venv, vLLM 0.32 installed by ../shared/peers/setup.sh) recomputes them with vLLM's
`check_sequence_repetition`, `SamplingParams.update_from_tokenizer` on the same tokenizer, and
its sampler's `ThinkingBudgetStateHolder` (no speculative tokens) stepping the same streams, and
prints what disagrees.
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
    budgets = thinking_cases(rng)
    (out / "cases.json").write_text(json.dumps({"repetition": cases, "bad_words": banned, "thinking": budgets}))
    print(f"wrote {len(cases)} repetition cases, {len(banned)} bad words and {len(budgets)} thinking "
          f"streams to {out}")


# NOTE: one token each, as reasoning models' <think> and </think> are (vLLM's state machine
# counts multi-token markers' own tokens in ways of its own)
START, END = [90], [95]


def thinking_cases(rng: random.Random) -> list[list]:
    """[kind, prompt, free tokens, budget, pagoda's output] streams: "reasoning" ones shaped as
    a reasoning model writes (the prompt or the output opens one section, thinking, maybe its
    end, an answer without markers) and "stray" ones with markers anywhere."""
    from pagoda.thinking_budget import ThinkingBudget, ThinkingTokens

    marks = ThinkingTokens(tuple(START), tuple(END), tuple(END))

    def piece(most: int = 6) -> list[int]:
        return [rng.randint(1, 5) for _ in range(rng.randint(0, most))]

    cases = []
    for i in range(5000):
        if i % 2 == 0:
            kind, opened = "reasoning", rng.random() < 0.4
            prompt = [7, *piece(), *(START + piece(3) if opened else [])]
            free = ([] if opened or rng.random() < 0.3 else piece(2) + START) + piece(12)
            free += (END if rng.random() < 0.8 else []) + piece(40)
        else:
            kind, prompt = "stray", [7, *piece(), *(START if rng.random() < 0.4 else []), *piece()]
            free = []
            while len(free) < 40:
                free += piece() + rng.choice([START, END, [], []])
        free, budget = free[:40], rng.randint(0, 8)
        rule, output = ThinkingBudget(budget, marks), []
        for token in free:
            forced = rule.forced_token(prompt + output, len(prompt))
            output.append(token if forced is None else forced)
        cases.append([kind, prompt, free, budget, output])
    return cases


def vllm_thinking(prompt: list[int], free: list[int], budget: int) -> list[int]:
    """The output vLLM's sampler gives the same free-running stream."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    config = SimpleNamespace(reasoning_start_token_ids=START, reasoning_end_token_ids=END)
    holder = ThinkingBudgetStateHolder(config, 1, 0, torch.device("cpu"), False)  # type: ignore[arg-type]
    output: list[int] = []
    params = SimpleNamespace(thinking_token_budget=budget)
    holder.sync_batch(BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))
    for token in free:
        logits = torch.zeros(1, 100)
        logits[0, token] = 1.0
        holder.update_state([output], None)
        logits = holder.apply_to_logits(logits, False, None)
        output.append(int(logits[0].argmax()))
    return output


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
    for kind in ("reasoning", "stray"):
        streams = [c for c in data["thinking"] if c[0] == kind]
        differ = [(c, theirs) for c in streams if (theirs := vllm_thinking(*c[1:4])) != c[4]]
        forced = sum(c[2] != c[4] for c in streams)
        print(f"thinking_token_budget, {kind} streams: {len(streams) - len(differ)} of {len(streams)} "
              f"alike ({forced} forced); where they differ: {why_differ(differ)}")


def why_differ(differ: list) -> dict[str, int]:
    """At the first position told apart: vLLM forcing an end where the model had closed the
    section (pagoda: not thinking), or other."""
    reasons: dict[str, int] = {}
    for (_, prompt, _, _, ours), theirs in differ:
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        seen = prompt + ours[:at]
        closed = max((i for i, t in enumerate(seen) if t in END), default=-1) > \
            max((i for i, t in enumerate(seen) if t in START), default=-1)
        if theirs[at] in END and closed:
            key = "vLLM forces an end after the section was closed"
        elif theirs[at] in END:
            key = "vLLM forces sooner"
        else:
            key = "vLLM forces later"
        reasons[key] = reasons.get(key, 0) + 1
    return reasons

if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](Path(sys.argv[2]))
