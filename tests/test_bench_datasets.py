"""Benchmark workloads: seeded, special ids skipped, lengths as asked, files read as given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.datasets import (
    allowed_token_ids,
    jsonl_requests,
    length_range,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
)


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
