"""Benchmark workloads: seeded, special ids skipped, lengths as asked, files read as given."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.cli import add_bench_parser
from pagoda.bench.datasets import (
    PRESETS,
    allowed_token_ids,
    jsonl_requests,
    length_range,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
)
from pagoda.bench.serve_command import apply_preset, build_requests


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    return load_tokenizer(str(tiny_llama))


def test_random_token_prompts_are_seeded_and_skip_special_ids(tok: Any) -> None:
    a = random_requests(tok, 6, (8, 16), (4, 8), seed=3, as_text=False)
    b = random_requests(tok, 6, (8, 16), (4, 8), seed=3, as_text=False)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    special = set(tok.all_special_ids)
    for r in a:
        assert isinstance(r.prompt, list)
        assert 8 <= r.prompt_len == len(r.prompt) <= 16 and 4 <= r.expected_output_len <= 8
        assert not special & set(r.prompt)
    assert len(allowed_token_ids(tok)) == len(tok) - len(special)


def test_text_prompts_have_the_length_they_claim(tok: Any) -> None:
    requests = random_requests(tok, 10, (20, 40), (5, 5), seed=0, prefix_len=4)
    for r in requests:
        assert isinstance(r.prompt, str)
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 24 <= r.prompt_len <= 44 and r.expected_output_len == 5


def test_shared_prefix_requests_share_whole_prefixes(tok: Any) -> None:
    requests = shared_prefix_requests(tok, 8, num_prefixes=2, prefix_len=16, suffix_len=8,
                                      output_len=4, seed=0, as_text=False)
    prefixes = {tuple(r.prompt[:16]) for r in requests if isinstance(r.prompt, list)}
    assert len(prefixes) == 2
    assert all(r.prompt_len == 24 and r.expected_output_len == 4 for r in requests)


def test_jsonl_requests(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Hello world"}) + "\n\n"
                    + json.dumps({"prompt": "Bye", "output_len": 3}) + "\n")
    requests = jsonl_requests(tok, path, None, output_len=7)
    assert [(r.prompt, r.expected_output_len) for r in requests] == [("Hello world", 7), ("Bye", 3)]
    assert requests[0].prompt_len == len(tok.encode("Hello world", add_special_tokens=False))
    assert len(jsonl_requests(tok, path, 1, output_len=7)) == 1
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        jsonl_requests(tok, path, None, output_len=7)


def test_length_range_is_vllms_range_ratio() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(144, 0.5) == (72, 216)
    with pytest.raises(ValueError):
        length_range(100, 1.0)


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return apply_preset(parser.parse_args(["bench", "serve", *argv]))


def test_a_preset_sets_the_workload_and_flags_override_it() -> None:
    plain = serve_args()
    assert (plain.random_input_len, plain.random_output_len, plain.num_prompts) == (1024, 128, 1000)
    assert plain.ignore_eos is False and plain.max_concurrency is None
    chat = serve_args("--preset", "chatbot", "--random-output-len", "8")
    assert (chat.random_input_len, chat.random_range_ratio) == (500, 0.5)
    assert chat.random_output_len == 8  # the command line wins
    assert (chat.num_prompts, chat.max_concurrency, chat.ignore_eos) == (400, 100, True)
    assert serve_args("--preset", "rag", "--no-ignore-eos").ignore_eos is False
    assert serve_args("--preset", "rag").dataset_name == "prefix_repetition"
    assert {p.slo_metric for p in PRESETS.values()} == {"e2el", "ttft", "itl"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_workloads_have_the_lengths_they_describe(tok: Any, name: str) -> None:
    args = serve_args("--preset", name)
    requests = build_requests(args, tok, num_prompts=8)
    preset = PRESETS[name].dataset
    if name == "rag":
        prefix = preset["prefix_repetition_prefix_len"] + preset["prefix_repetition_suffix_len"]
        assert all(abs(r.prompt_len - prefix) <= 2 for r in requests)  # text round trip
        assert {r.expected_output_len for r in requests} == {128}
        return
    low, high = length_range(preset["random_input_len"], preset["random_range_ratio"])
    prefix = preset.get("random_prefix_len", 0)
    assert all(low + prefix - 2 <= r.prompt_len <= high + prefix + 2 for r in requests)
    low, high = length_range(preset["random_output_len"], preset["random_range_ratio"])
    assert all(low <= r.expected_output_len <= high for r in requests)
