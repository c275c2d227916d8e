"""`GGUFIndex` reads a GGUF's scalar metadata and tensor table as the `gguf` package's reader
does (same names, types, shapes and bytes), in a fraction of the time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagoda.models.gguf_index import GGUFIndex


def _same_as_the_reader(path: str) -> GGUFIndex:
    from gguf import GGUFReader

    index, reader = GGUFIndex(path), GGUFReader(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(x) for x in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name
    for key, field in reader.fields.items():
        if index.fields.get(key) is not None:
            assert index.fields[key] == pytest.approx(field.contents()), key
    return index


def test_a_written_file_of_every_kind_reads_alike(tmp_path: Path):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 9)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("flag", True)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 1000)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3] * 1000)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0):
        weights = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(kind.name, quantize(weights, kind), raw_dtype=kind)
    # NOTE: a k-quant's raw super-blocks (144 bytes per 256 weights), as a file carries them
    q4k = rng.integers(0, 255, (2, 144), dtype=np.uint8)
    writer.add_tensor("q4k", q4k, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = _same_as_the_reader(str(path))
    assert index.fields["general.name"] == "tiny ünïcode" and index.fields["tokenizer.ggml.tokens"] is None
    # NOTE: after the model is loaded its pages leave this process; a later read still sees the file
    before = [t.data.copy() for t in index.tensors]
    index.release_pages()
    assert all(np.array_equal(t.data, b) for t, b in zip(index.tensors, before, strict=True))
    _same_as_the_reader(str(path))


def test_smollm2_reads_alike():
    from conftest import smollm2_gguf_path

    index = _same_as_the_reader(str(smollm2_gguf_path()))
    assert index.fields["general.architecture"] == "llama" and len(index.tensors) == 272


def test_not_a_gguf_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFIndex(str(path))
