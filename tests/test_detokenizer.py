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


def _wordpiece_tokenizer():
    """A tokenizer whose decoder puts a space before each word but a "##" piece, added tokens
    included (BERT's): where vLLM's `spaces_between_special_tokens` shows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _streamed(tok, ids: list[int], params: SamplingParams) -> str:
    detok = IncrementalDetokenizer(tok, [1], params)
    for t in ids:
        detok.add_token(t)
    return detok.take_delta(finished=True)


def test_spaces_between_special_tokens_off_writes_them_bare():
    tok = _wordpiece_tokenizer()
    ids = [1, 3, 4, 3, 2]  # hello <a> <b> <a> world
    kept = SamplingParams(skip_special_tokens=False)
    assert _streamed(tok, ids, kept) == " hello <a> <b> <a> world"
    bare = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    # NOTE: vLLM's rule: only an added token after another loses its space
    assert _streamed(tok, ids, bare) == " hello <a><b><a> world"
    # NOTE: skipped special tokens leave nothing to space (the flag changes nothing)
    skipped = SamplingParams(spaces_between_special_tokens=False)
    assert _streamed(tok, ids, skipped) == _streamed(tok, ids, SamplingParams())
