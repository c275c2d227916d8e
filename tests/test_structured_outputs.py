"""Structured outputs, logit_bias and allowed_token_ids in the engine.

The grammar battery runs on the real SmolLM2 (nested objects, arrays, enums, numbers,
booleans, required fields; regex; choice): every output must parse and validate. The tiny
random model checks the mechanics where any model would do: masks hold whatever the model
prefers, constrained and free requests share a batch exactly, n > 1 and preemption keep the
grammar state, and bad constraints are errors naming their field.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from conftest import NEEDS_SMOLLM2, NO_SMOLLM2

from pagoda import LLM, SamplingParams
from pagoda.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputsParams,
    apply_bitmask,
)

SCHEMAS = {
    "person": ("Describe a fictional person as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150}}}),
    "nested": ("Give a city with its coordinates and a few tags as JSON.", {
        "type": "object", "additionalProperties": False,
        "required": ["city", "location", "tags"],
        "properties": {
            "city": {"type": "string"},
            "location": {"type": "object", "additionalProperties": False,
                         "required": ["lat", "lon"],
                         "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                     "maxItems": 3}}}),
    "enum": ("Classify the sentiment of 'I love this!' as JSON.", {
        "type": "object", "additionalProperties": False,
        "required": ["sentiment", "confidence"],
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}),
    "list": ("List two or three famous movies with their years as JSON.", {
        "type": "array", "minItems": 2, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False,
                  "required": ["title", "year"],
                  "properties": {"title": {"type": "string"}, "year": {"type": "integer"}}}}),
    "bool": ("Is the sky blue? Answer as JSON with a short reason.", {
        "type": "object", "required": ["answer", "reason"], "additionalProperties": False,
        "properties": {"answer": {"type": "boolean"},
                       "reason": {"type": "string", "maxLength": 80}}}),
}


# ---- without a model -------------------------------------------------------------------------
def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_apply_bitmask_matches_a_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 100
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    for row, col in allowed.nonzero().tolist():
        word = int(bitmask[row, col // 32]) & 0xFFFFFFFF | (1 << (col % 32))
        bitmask[row, col // 32] = word - (1 << 32) if word >= 2**31 else word
    logits = torch.randn(3, vocab, generator=g)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


# ---- the tiny random model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256)


def constrained(so: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    return SamplingParams(structured_outputs=so, **kw)


def text_of(llm: LLM, prompt: str | list[int], params: SamplingParams) -> list[str]:
    return [o.text for o in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


def test_masks_hold_whatever_the_model_prefers(llm: LLM):
    assert text_of(llm, "hello", constrained(StructuredOutputsParams(choice=["red", "blue"]))
                   )[0] in ("red", "blue")
    [phone] = text_of(llm, "call", constrained(StructuredOutputsParams(regex=r"\(\d{3}\) \d{4}")))
    assert re.fullmatch(r"\(\d{3}\) \d{4}", phone)
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    [obj] = text_of(llm, "x", constrained(StructuredOutputsParams(json=schema)))
    jsonschema.validate(json.loads(obj), schema)


def test_objects_allow_only_their_properties_unless_told_otherwise(llm: LLM):
    """As vLLM's default backend (xgrammar's strict mode): a schema's objects take no property
    they do not name unless `additionalProperties` says so; `allOf` parts stay open."""
    from pagoda.grammar_child import closed_objects

    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    # NOTE: a comma pushed up, so that an open object would go on to keys of the model's own
    comma = {t: 30.0 for t in llm.get_tokenizer().encode(",", add_special_tokens=False)}
    [out] = text_of(llm, "x", constrained(StructuredOutputsParams(json=schema), max_tokens=60, logit_bias=comma))
    assert set(json.loads(out)) == {"ok"}
    nested = {"properties": {"a": {"properties": {"b": {}}}, "c": {"additionalProperties": True, "properties": {}}},
              "allOf": [{"properties": {"d": {}}}], "$defs": {"E": {"properties": {"e": {}}}}}
    closed = closed_objects(nested)
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True and closed["$defs"]["E"]["additionalProperties"] is False
    assert "additionalProperties" not in closed and "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in nested["properties"]["a"]  # NOTE: the request's own schema untouched


def test_a_constrained_and_a_free_request_share_a_batch_exactly(llm: LLM):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], free, use_tqdm=False)[0].outputs[0].token_ids
    choice = constrained(StructuredOutputsParams(choice=["alpha", "beta", "gamma"]))
    outs = llm.generate(["The quick brown fox", "Pick one"], [free, choice], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].text in ("alpha", "beta", "gamma")
    assert outs[1].outputs[0].finish_reason == "stop"


def test_n_samples_each_follow_the_grammar(llm: LLM):
    params = constrained(StructuredOutputsParams(regex=r"[a-c]{2}-[0-9]{2}"), n=4,
                         temperature=1.0, seed=5)
    for text in text_of(llm, "sample", params):
        assert re.fullmatch(r"[a-c]{2}-[0-9]{2}", text), text


def test_grammar_state_survives_preemption(tiny_llama):
    so = StructuredOutputsParams(regex=r"(ab|cd){3,12}")
    params = constrained(so, max_tokens=60)
    prompts = [[5 + i] * 40 for i in range(6)]
    roomy = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256)
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=256,
                block_size=16)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in got] == expected
    assert all(re.fullmatch(r"(ab|cd){3,12}", t) for t in expected)


def test_min_tokens_does_not_fight_a_finished_grammar(llm: LLM):
    params = constrained(StructuredOutputsParams(choice=["ok"]), min_tokens=5)
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_logit_bias_and_allowed_token_ids(llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate(["bias"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    pushed = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={777: 100})
    assert llm.generate(["bias"], pushed, use_tqdm=False)[0].outputs[0].token_ids == [777] * 6
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            logit_bias={base[0]: -100})
    assert llm.generate(["bias"], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != base[0]
    allowed = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=[10, 20, 30])
    assert set(llm.generate(["bias"], allowed, use_tqdm=False)[0].outputs[0].token_ids) <= {
        10, 20, 30}


def test_repetition_detection_ends_a_loop_as_vllm(llm: LLM):
    """A forced loop (one token's logit pushed) ends after min_count repeats with vLLM's finish
    reason "repetition" and stop reason "repetition_detected"; never before min_tokens."""
    loop = dict(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={777: 100})
    detect = {"max_pattern_size": 2, "min_count": 3}
    out = llm.generate(["loop"], SamplingParams(**loop, repetition_detection=detect), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [777] * 3 and out.finish_reason == "repetition" and out.stop_reason == "repetition_detected"
    late = SamplingParams(**loop, min_tokens=7, repetition_detection=detect)
    assert len(llm.generate(["loop"], late, use_tqdm=False)[0].outputs[0].token_ids) == 7
    free = llm.generate(["loop"], SamplingParams(**loop), use_tqdm=False)[0].outputs[0]
    assert len(free.token_ids) == 20 and free.finish_reason == "length"


def _holds(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(seq)]) == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_are_never_completed(llm: LLM):
    """vLLM's bad_words: each word's tokens (as written, and after a space) never all come in a
    row; a word the free answer writes is avoided and the answer differs there."""
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate(["words"], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    texts = [llm.tokenizer.decode([t]) for t in free]
    # NOTE: vLLM keeps the form after a space only where it has as many tokens as the plain one
    resolved = {w: llm.engine.processor.check_params(SamplingParams(**greedy, bad_words=[w])).bad_words_token_ids
                for w in (t.strip() for t in texts if t.startswith(" ") and len(t.strip()) > 1)}
    word = next(w for w, seqs in resolved.items() if any(_holds(free, seq) for seq in seqs))
    seqs = resolved[word]
    assert seqs[0] == tuple(llm.tokenizer.encode(word, add_special_tokens=False))
    avoided = llm.generate(["words"], SamplingParams(**greedy, bad_words=[word]),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert avoided != free and not any(_holds(avoided, seq) for seq in seqs)
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):
        SamplingParams(bad_words=["a", ""])
    with pytest.raises(ValueError, match="Too many bad words"):
        llm.engine.processor.check_params(SamplingParams(bad_words=[f"w{i}" for i in range(129)]))


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(regex="[0-9"), "Invalid regex"),
    (StructuredOutputsParams(json={"type": "objectx"}), "Invalid json"),
    (StructuredOutputsParams(json="{not json"), "Invalid json"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "Invalid grammar"),
])
def test_bad_constraints_are_errors_naming_the_field(llm: LLM, so, message):
    with pytest.raises(GrammarError, match=message) as info:
        llm.engine.add_request("bad", "x", constrained(so))
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("params, param", [
    (dict(logit_bias={49152: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),
])
def test_bad_token_controls_are_refused(llm: LLM, params: dict, param: str):
    with pytest.raises(ValueError) as info:
        llm.engine.add_request("bad", "x", SamplingParams(**params))
    assert getattr(info.value, "param", None) == param


def test_compiles_are_cached(tiny_llama, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152)
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second = compiler.compile(so), compiler.compile(
        StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert len(compiler._cache) == 1 and first is not second


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(choice=[f"c{i}" for i in range(2049)]), r"2049 choices; the limit is 2048 \(--max-guided-choices\)"),
    (StructuredOutputsParams(choice=["x" * 70_000]), r"70000 bytes; the limit is 65536 \(--max-grammar-bytes\)"),
    (StructuredOutputsParams(grammar="start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "a"'),
     r"3002 rules; the limit is 1000 \(--max-grammar-rules\)"),
    (StructuredOutputsParams(grammar="root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1500)) + 'r1500 ::= "a"'),
     r"rules; the limit is 1000"),
    (StructuredOutputsParams(regex="a" * 70_000), r"--max-grammar-bytes"),
    (StructuredOutputsParams(json=_deep_schema(10_000)), r"levels of nesting; the limit is 128 \(--max-schema-depth\)"),
    (StructuredOutputsParams(json=json.dumps(_deep_schema(100))), r"--max-schema-depth"),
    (StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2049)}}),
     r"2049 properties; the limit is 2048 \(--max-schema-properties\)"),
    (StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{i}": {"type": "object", "properties": {f"q{j}": {"type": "null"} for j in range(50)}} for i in range(41)}}),
     r"2091 properties; the limit is 2048"),
    (StructuredOutputsParams(json={"anyOf": [{"enum": list(range(1500))}, {"enum": [str(i) for i in range(600)]}]}),
     r"2100 enum values; the limit is 2048 \(--max-guided-choices\)"),
    (StructuredOutputsParams(json={"type": "string", "description": "x" * 1_100_000}),
     r"bytes; the limit is 1048576 \(--max-grammar-bytes\)"),
])
def test_constraints_over_a_limit_are_refused_before_compiling(smollm2_tokenizer_dir, monkeypatch, so, message):
    """A 3,000-rule grammar crashed the grammar library (issue 23), a 60,000-entry choice held a
    worker for a minute: each limit refuses its input with the flag's name, and nothing reaches
    the library."""
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152)
    monkeypatch.setattr(compiler, "_build", lambda *a: pytest.fail("compiled an input over a limit"))
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(so, "response_format")
    assert info.value.param == "response_format"


def test_limits_follow_the_config_and_an_input_within_them_compiles(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from pagoda.config import LimitsConfig

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tight = GrammarCompiler(tok, 49152, limits=LimitsConfig(max_guided_choices=2, max_schema_depth=3,
                                                            max_schema_properties=2))
    with pytest.raises(GrammarError, match="3 choices; the limit is 2"):
        tight.compile(StructuredOutputsParams(choice=["a", "b", "c"]))
    with pytest.raises(GrammarError, match="levels of nesting; the limit is 3"):
        tight.compile(StructuredOutputsParams(json=_deep_schema(2)))
    with pytest.raises(GrammarError, match="3 properties; the limit is 2"):
        tight.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}, "c": {}}}))
    tight.compile(StructuredOutputsParams(choice=["a", "b"]))
    tight.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}}))
    tight.compile(StructuredOutputsParams(json={"enum": ["x", "y"]}))
    with pytest.raises(GrammarError, match="3 enum values; the limit is 2"):
        tight.compile(StructuredOutputsParams(json={"enum": ["x", "y", "z"]}))
    GrammarCompiler(tok, 49152).compile(StructuredOutputsParams(json=_deep_schema(30)))
    with pytest.raises(ValueError, match="max_schema_depth"):
        LimitsConfig(max_schema_depth=0)


def test_library_panics_reach_no_user() -> None:
    from pagoda.structured_output import library_message

    text = ("capacity overflow\nthread '<unnamed>' panicked at src/lib.rs:12:5:\n<backtrace>\n  0: rust_begin_unwind")
    assert library_message(text) == "capacity overflow"
    assert library_message("panicked at src/x.rs:1:1") == "the grammar compiler failed on this input"
    assert library_message("x" * 2000).endswith("...") and len(library_message("x" * 2000)) == 503
    assert library_message("expected ':' at line 2") == "expected ':' at line 2"


def _chained_grammar(num_rules: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(num_rules)) + f'r{num_rules}: "b"\n'


def test_a_grammar_that_crashes_the_library_costs_one_sandbox_process(smollm2_tokenizer_dir):
    """3,000 chained rules segfault llguidance's native code (issue 23): with the limits
    raised so it reaches the library, it is the request's error and the next compile works."""
    from transformers import AutoTokenizer

    from pagoda.config import LimitsConfig

    limits = LimitsConfig(max_grammar_rules=10**6, max_grammar_bytes=10**7, grammar_compile_workers=1)
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152, limits=limits)
    try:
        compiler.compile(StructuredOutputsParams(grammar=_chained_grammar(5)))
        first = compiler._sandbox._idle.queue[0].proc.pid
        with pytest.raises(GrammarError, match="the grammar compiler failed on this grammar") as info:
            compiler.compile(StructuredOutputsParams(grammar=_chained_grammar(3000)), "response_format")
        assert info.value.param == "response_format" and "backtrace" not in str(info.value)
        assert compiler._sandbox.num_failures == 1
        grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
        assert not grammar.terminated
        assert compiler._sandbox._idle.queue[0].proc.pid != first  # a fresh child took over
    finally:
        compiler.close()


def test_a_compile_over_its_timeout_is_stopped_and_named(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from pagoda.config import LimitsConfig

    limits = LimitsConfig(grammar_compile_workers=1, grammar_compile_timeout=1e-4)
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152, limits=limits)
    # NOTE: a schema that takes ~100 ms to compile: a small one could be answered while this
    # process waits for a core on a loaded machine, before it even starts to wait for the reply.
    fields = {f"field_{i}": {"type": "string", "pattern": "[a-z]{2,9}[0-9]+"} for i in range(200)}
    slow = {"type": "object", "properties": fields, "required": sorted(fields)}
    try:
        with pytest.raises(GrammarError, match=r"took more than 0.0001 s \(--grammar-compile-timeout\)"):
            compiler.compile(StructuredOutputsParams(json=slow))
    finally:
        compiler.close()
    assert compiler._sandbox is not None and compiler._sandbox._num_started == 0


def test_a_compile_over_its_cpu_time_is_ended_by_the_kernel_and_named(smollm2_tokenizer_dir):
    """A compile's CPU time is bounded apart from the wall clock (threads add up): RLIMIT_CPU set
    by the child before each compile ends it with SIGXCPU; the next compile gets a fresh child."""
    from transformers import AutoTokenizer

    from pagoda.grammar_sandbox import GrammarSandbox, SandboxError, tokenizer_init

    sandbox = GrammarSandbox(tokenizer_init(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152), 1,
                             timeout_s=120.0, memory_mib=0, cpu_s=1)
    options = {"disable_any_whitespace": True, "whitespace_pattern": None}
    try:
        assert "start" in sandbox.grammar_text({"kind": "choice", "spec": ["yes", "no"], **options})
        first = sandbox._idle.queue[0].proc.pid
        # NOTE: 60,000 of these took 4.7 CPU-seconds to compile on a Zen 3; twice as many leave
        # a margin over the 1-2 s the limit allows on a faster CPU
        many = [f"choice number {i} of many" for i in range(120_000)]
        start = time.monotonic()
        with pytest.raises(SandboxError, match=r"used more than 1 CPU-seconds \(--grammar-compile-timeout\)"):
            sandbox.grammar_text({"kind": "choice", "spec": many, **options})
        assert time.monotonic() - start < 30 and sandbox.num_failures == 1
        assert "start" in sandbox.grammar_text({"kind": "choice", "spec": ["a", "b"], **options})
        assert sandbox._idle.queue[0].proc.pid != first
    finally:
        sandbox.close()


def test_a_child_imports_from_the_parents_path_and_a_failed_start_is_the_servers_error(
        smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """Children run isolated (`python -I`), which drops PYTHONPATH and the user's site: a
    parent that found llguidance there (on a lent GPU: `pip install --target`) once had every
    constraint refused as the user's "Invalid regex ...: Broken pipe". The child now imports
    from the parent's path (a stub placed first on it is what the child finds here), and a
    child that cannot start is a `SandboxStartError` (the server's 500) naming why."""
    from transformers import AutoTokenizer

    from pagoda.config import LimitsConfig
    from pagoda.grammar_sandbox import SandboxStartError

    stub = tmp_path / "llguidance"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('a stub llguidance from the parent path')\n")
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    compiler = GrammarCompiler(tok, 49152, limits=LimitsConfig(grammar_compile_workers=1))
    compiler._tokenizer()  # NOTE: the real llguidance, imported here before the stub is on the path
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(SandboxStartError, match="failed to start: ImportError: a stub llguidance from the "
                                                    "parent path"):
            compiler.compile(StructuredOutputsParams(regex="[a-c]{2}"))
        assert compiler._sandbox is not None and compiler._sandbox._num_started == 0
        monkeypatch.undo()
        assert not compiler.compile(StructuredOutputsParams(regex="[a-c]{2}")).terminated
    finally:
        compiler.close()


def test_without_sandbox_workers_grammars_compile_in_process(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from pagoda.config import LimitsConfig

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), 49152,
                               limits=LimitsConfig(grammar_compile_workers=0))
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler._sandbox is None
    with pytest.raises(GrammarError, match="Invalid regex"):
        compiler.compile(StructuredOutputsParams(regex="(unclosed"))


# ---- the real SmolLM2 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> LLM:
    if NO_SMOLLM2:
        pytest.skip(NEEDS_SMOLLM2)
    return LLM("smollm2", max_model_len=1024, kv_cache_memory="256MiB")


def chat(llm: LLM, question: str) -> str:
    return str(llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False))


def test_smollm2_json_schemas_all_validate(smollm2: LLM):
    names = list(SCHEMAS)
    prompts = [chat(smollm2, SCHEMAS[k][0]) for k in names]
    params = [constrained(StructuredOutputsParams(json=SCHEMAS[k][1]), max_tokens=300)
              for k in names]
    sampled = [constrained(StructuredOutputsParams(json=SCHEMAS[k][1]), max_tokens=300,
                           temperature=0.7, top_p=0.9, seed=i) for i, k in enumerate(names)]
    outs = smollm2.generate(prompts * 2, params + sampled, use_tqdm=False)
    compiler = GrammarCompiler(smollm2.get_tokenizer(), 49152)
    finished = []
    for name, out, p in zip(names * 2, outs, params + sampled, strict=True):
        completion = out.outputs[0]
        finished.append(completion.finish_reason == "stop")
        if finished[-1]:
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name][1])
            continue
        # A sampled answer may run on until max_tokens (SmolLM2 sometimes writes a number's digits
        # forever; which seed does depends on the CPU's rounding): every token is still the schema's.
        assert completion.finish_reason == "length", (name, completion.text)
        tokens = list(completion.token_ids)
        assert compiler.compile(p.structured_outputs).valid_prefix(tokens) == len(tokens)
    assert all(finished[:len(names)]), finished
    assert sum(finished[len(names):]) >= len(names) - 1, finished


def test_smollm2_json_object_regex_and_choice(smollm2: LLM):
    cases = [
        (chat(smollm2, "Describe a cat as a JSON object with the keys name and age."),
         StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (chat(smollm2, "Give a US phone number."),
         StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
         lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        (chat(smollm2, "Is Paris in France? Answer yes or no."),
         StructuredOutputsParams(choice=["yes", "no"]), lambda t: t == "yes"),
    ]
    outs = smollm2.generate([c[0] for c in cases],
                            [constrained(c[1], max_tokens=200) for c in cases], use_tqdm=False)
    for (_, so, check), out in zip(cases, outs, strict=True):
        assert check(out.outputs[0].text), (so.kind, out.outputs[0].text)

