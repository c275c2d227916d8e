"""`pagoda bench throughput` / `bench latency` on a tiny model: pagoda and the transformers
baseline get the same prompts and both count exactly the requested tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from pagoda.bench.backends import HFBackend, left_pad
from pagoda.bench.cli import add_bench_parser, run_command


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_static_batches_count_only_requested_tokens(tiny_llama: Path) -> None:
    backend = HFBackend(str(tiny_llama), "float32", batch_size=2)
    calls: list[tuple[int, int]] = []
    generate = backend.model.generate

    def spy(**kwargs: object) -> torch.Tensor:
        out = generate(**kwargs)
        ids = kwargs["input_ids"]
        assert isinstance(ids, torch.Tensor)
        calls.append((ids.shape[0], out.shape[1] - ids.shape[1]))
        return out

    backend.model.generate = spy
    useful = backend.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [3, 6, 2])
    assert useful == 11
    assert calls == [(2, 6), (1, 2)]  # each batch runs to its longest request


def test_throughput_both_backends_same_work(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    args = bench_args("throughput", "--backend", "both", "--model", str(tiny_llama),
                      "--dtype", "float32", "--num-prompts", "5", "--input-len-range", "8", "24",
                      "--output-len-range", "3", "9", "--hf-batch-size", "2",
                      "--kv-cache-memory", "64MiB", "--output-json", str(out))
    results = run_command(args)
    saved = json.loads(out.read_text())
    wanted = sum(saved["workload"]["output_lens"])
    assert [r.backend for r in results] == ["pagoda", "hf"]
    for r in results:
        assert r.num_requests == 5
        assert r.num_output_tokens == wanted
        assert r.num_prompt_tokens == sum(saved["workload"]["input_lens"])
        assert r.output_tokens_per_s == pytest.approx(wanted / r.elapsed_s)
    assert saved["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"
    # every saved figure names the CPU it was measured on and the kernels it ran
    from pagoda.layers.cpu_kernels import loader

    assert saved["environment"]["cpu_model"] == loader.cpu_model()
    assert set(saved["environment"]["cpu_flags"]) <= set(loader.MATRIX_FLAGS)
    assert saved["environment"]["kernel_variant"] in ("avx512bf16", "avx2", "portable", "none")


def test_latency_measures_both_backends(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    args = bench_args("latency", "--backend", "both", "--model", str(tiny_llama),
                      "--dtype", "float32", "--input-len", "8", "--output-len", "6",
                      "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "2",
                      "--kv-cache-memory", "64MiB", "--output-json", str(out))
    results = run_command(args)
    assert [r.backend for r in results] == ["pagoda", "hf"]
    for r in results:
        assert len(r.latencies_s) == 2 and all(t > 0 for t in r.latencies_s)
        assert r.batch_size == 2 and r.output_len == 6
    saved = json.loads(out.read_text())
    assert set(saved["results"][0]["percentiles"]) == {"10", "25", "50", "75", "90", "99"}


def test_random_model_of_a_shape_loads_and_serves(tmp_path: Path, smollm2_tokenizer_dir: Path) -> None:
    """`bench random-model` writes a Llama directory with SmolLM2's tokenizer that pagoda loads:
    greedy tokens equal transformers' on the same random weights (fp32), at a tiny shape here.
    The tokenizer comes from the session's saved copy (`--tokenizer DIR`): converting it from
    the GGUF again took 14 s."""
    import transformers

    from pagoda import LLM, SamplingParams
    from pagoda.bench import random_model

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    out = random_model.build("tiny", tmp_path / "m", seed=1, dims=dims, tokenizer_source=str(smollm2_tokenizer_dir))
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 49152)
    llm = LLM(str(out), dtype="float32", num_kv_blocks=32, max_model_len=256)
    prompt = [1, 504, 3287, 314, 5711]
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 5:]
    assert list(got) == want.tolist()
    with pytest.raises(ValueError, match="unknown shape 'llama-2b'"):
        random_model.build("llama-2b", tmp_path / "x")
    assert set(random_model.SHAPES) == {"smollm2-135m", "llama-1b", "llama-8b", "mixtral-8x1024", "dense-2048",
                                        "qwen3-0.6b"}
