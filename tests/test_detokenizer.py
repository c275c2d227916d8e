"""Incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagoda.detokenizer import IncrementalDetokenizer
from pagoda.sampling_params import SamplingParams

TEXT = "日本語のテキストと絵文字🎉🚀、そして English words. Ünïcödé ok"


def test_multibyte_characters_never_split(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # several tokens per character somewhere
    detok = IncrementalDetokenizer(tok, [1], SamplingParams())
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(finished=False))
    pieces.append(detok.take_delta(finished=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_stop_string_spanning_tokens_is_cut(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    ids = tok.encode("The answer is forty two. Done.")
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["forty two"]))
    streamed = ""
    stopped = False
    for t in ids:
        stopped = detok.add_token(t)
        streamed += detok.take_delta(finished=stopped)
        if stopped:
            break
    assert stopped and streamed == "The answer is " and detok.stop_reason == "forty two"
