"""LoRA adapters (pagoda/lora.py): PEFT folders served beside the base model.

Greedy output with an adapter equals transformers' on the base weights with the adapter merged
in (W + s * B A), token for token in float32, for requests of two adapters and of the base
model in one batch; prefix-cache blocks are not shared across adapters; bad adapters and
engines without adapters are refused with their reason.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy_generate
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams
from pagoda.distributed.group import ParallelGroup, PipelineStage
from pagoda.lora import LoRAError, LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def projection_shapes(model_dir: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (block, out features, in features) of the HF checkpoint's projections."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"q_proj": ("self_attn", q, hidden), "k_proj": ("self_attn", kv, hidden),
            "v_proj": ("self_attn", kv, hidden), "o_proj": ("self_attn", hidden, q),
            "gate_proj": ("mlp", inter, hidden), "up_proj": ("mlp", inter, hidden),
            "down_proj": ("mlp", hidden, inter)}


def write_adapter(out: Path, model_dir: Path, targets: list[str], rank: int = 8, alpha: float = 16,
                  seed: int = 0, **config: object) -> Path:
    """A random PEFT LoRA folder for the tiny model (every layer, `targets`)."""
    shapes = projection_shapes(model_dir)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name in targets:
            block, n_out, n_in = shapes[name]
            stem = f"base_model.model.model.layers.{i}.{block}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.15
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.15
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "bias": "none", "base_model_name_or_path": str(model_dir), **config}))
    return out


def merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens on the base weights with `adapter` merged in."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        r = config["r"]
        scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, a in weights.items():
                if ".lora_A." in key:
                    b = weights[key.replace(".lora_A.", ".lora_B.")]
                    name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                    params[name] += scaling * (b @ a)
    return hf_greedy_generate(model, prompts, max_tokens)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (40 + 7 * i,), generator=g).tolist() for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"all": write_adapter(root / "all", tiny_llama, ALL, rank=8, alpha=16, seed=1),
            "attn": write_adapter(root / "attn", tiny_llama, ["q_proj", "v_proj"], rank=4, alpha=8,
                                  seed=2, use_rslora=True)}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=256, num_kv_blocks=128,
               enable_lora=True, max_lora_rank=8)


def test_adapters_and_the_base_model_in_one_batch_equal_merged_weights(
        llm: LLM, tiny_llama: Path, adapters: dict[str, Path]):
    ps = prompts(4)
    a = LoRARequest("all", 1, str(adapters["all"]))
    b = LoRARequest("attn", 2, str(adapters["attn"]))
    loras = [a, b, None, a]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False, lora_request=loras)]
    want = {name: merged_greedy(tiny_llama, adapters[name] if name != "base" else None, ps, 12)
            for name in ("all", "attn", "base")}
    assert got == [want["all"][0], want["attn"][1], want["base"][2], want["all"][3]]
    # NOTE: each adapter changes what the model says (the test could fail).
    assert want["all"][0] != want["base"][0] and want["attn"][1] != want["base"][1]


def test_max_loras_keeps_one_adapter_running_and_every_answer(tiny_llama: Path, adapters: dict[str, Path]):
    """`max_loras=1` (vLLM's default there): no step runs two adapters' requests, requests of
    the base model run beside either, and every answer equals the unlimited engine's."""
    ps = prompts(6)
    a = LoRARequest("all", 1, str(adapters["all"]))
    b = LoRARequest("attn", 2, str(adapters["attn"]))
    loras = [a, b, None, b, a, None]
    engine = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    limited = LLM(str(tiny_llama), max_loras=1, **engine)
    steps: list[set[int]] = []
    execute = limited.engine.core.runner.execute

    def recording(out):  # type: ignore[no-untyped-def]
        steps.append({r.lora_request.lora_int_id for r in out.requests if r.lora_request is not None})
        return execute(out)

    limited.engine.core.runner.execute = recording  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in limited.generate(ps, GREEDY, use_tqdm=False, lora_request=loras)]
    assert steps and max(len(s) for s in steps) == 1 and {1, 2} == set().union(*steps)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **engine).generate(
        ps, GREEDY, use_tqdm=False, lora_request=loras)]
    assert got == want
    with pytest.raises(ValueError, match="max_loras"):
        LLM(str(tiny_llama), max_loras=0, **engine)


def test_chat_takes_an_adapter(llm: LLM, adapters: dict[str, Path]):
    a = LoRARequest("all", 1, str(adapters["all"]))
    conversation = [{"role": "user", "content": "Name a colour."}]
    ids = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    chat = llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
    assert chat == llm.generate([list(ids)], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
    assert chat != llm.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_cached_prefixes_are_not_shared_across_adapters(llm: LLM, tiny_llama: Path, adapters: dict[str, Path]):
    p = prompts(1)
    a = LoRARequest("all", 1, str(adapters["all"]))
    with_adapter = llm.generate(p, GREEDY, use_tqdm=False, lora_request=a)[0]
    hits = llm.engine.block_manager.prefix_cache_hits
    base = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert llm.engine.block_manager.prefix_cache_hits == hits  # the adapter's blocks were not reused
    assert base.outputs[0].token_ids == merged_greedy(tiny_llama, None, p, 12)[0]
    again = llm.generate(p, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert llm.engine.block_manager.prefix_cache_hits > hits  # its own blocks are
    assert again.outputs[0].token_ids == with_adapter.outputs[0].token_ids


def test_a_core_in_its_own_process_serves_adapters_alike(llm: LLM, tiny_llama: Path, adapters: dict[str, Path]):
    a = LoRARequest("all", 1, str(adapters["all"]))
    want = [o.outputs[0].token_ids for o in llm.generate(prompts(2), GREEDY, use_tqdm=False, lora_request=[a, None])]
    apart = LLM(str(tiny_llama), dtype="float32", max_model_len=256, num_kv_blocks=64, enable_lora=True,
                max_lora_rank=8, core_process=True)
    try:
        apart.engine.add_lora(a)  # NOTE: over the pipe, as the server's start-up does
        got = [o.outputs[0].token_ids for o in apart.generate(prompts(2), GREEDY, use_tqdm=False, lora_request=[a, None])]
        assert got == want
        assert apart.engine.remove_lora(1) and not apart.engine.remove_lora(1)
    finally:
        apart.engine.shutdown()


def test_adapters_that_cannot_be_served_are_refused(llm: LLM, tiny_llama: Path, tmp_path: Path):
    big = write_adapter(tmp_path / "big", tiny_llama, ["q_proj"], rank=16)
    with pytest.raises(LoRAError, match="rank 16; this server takes ranks 1-8"):
        llm.generate(prompts(1), GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 7, str(big)))
    with pytest.raises(LoRAError, match="No adapter_config.json"):
        llm.generate(prompts(1), GREEDY, use_tqdm=False, lora_request=LoRARequest("none", 8, str(tmp_path)))
    damaged = write_adapter(tmp_path / "damaged", tiny_llama, ["q_proj"], rank=4)
    (damaged / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="Cannot read the LoRA adapter's"):
        llm.generate(prompts(1), GREEDY, use_tqdm=False, lora_request=LoRARequest("damaged", 10, str(damaged)))
    dora = write_adapter(tmp_path / "dora", tiny_llama, ["q_proj"], rank=4, use_dora=True)
    with pytest.raises(LoRAError, match="DoRA"):
        llm.generate(prompts(1), GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 9, str(dora)))
    # NOTE: the engine goes on.
    assert llm.generate(prompts(1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        merged_greedy(tiny_llama, None, prompts(1), 12)[0]


def test_an_engine_without_adapters_refuses_a_lora_request(tiny_llama: Path, adapters: dict[str, Path]):
    plain = LLM(str(tiny_llama), dtype="float32", max_model_len=128, num_kv_blocks=32)
    with pytest.raises(LoRAError, match="enable_lora"):
        plain.generate(prompts(1), GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("all", 1, str(adapters["all"])))


def _parallel_adapters(tiny_llama: Path, adapters: dict[str, Path], **parallel: int) -> None:
    """Two adapters and the base model in one batch, served by parallel workers: the tokens
    merged weights give (as one process); a bad adapter refused by every rank, the engine going on."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8, **parallel)
    try:
        ps = prompts(3)
        a, b = LoRARequest("all", 1, str(adapters["all"])), LoRARequest("attn", 2, str(adapters["attn"]))
        got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False, lora_request=[a, b, None])]
        want = [merged_greedy(tiny_llama, adapters[name] if name else None, ps, 12)[i]
                for i, name in enumerate(("all", "attn", None))]
        assert got == want
        too_big = LoRARequest("big", 3, str(write_adapter(adapters["all"].parent / "big", tiny_llama, ALL, rank=16)))
        with pytest.raises(LoRAError, match="rank 16; this server takes ranks 1-8"):
            llm.generate(ps[:1], GREEDY, use_tqdm=False, lora_request=too_big)
        assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
        again = llm.generate(ps[:1], GREEDY, use_tqdm=False, lora_request=a)  # NOTE: loaded again
        assert again[0].outputs[0].token_ids == want[0]
    finally:
        llm.engine.shutdown()


class _Unsummed(ParallelGroup):
    """A rank of a group of two whose all-reduce the test does itself (it sums the ranks' results)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_each_rank_and_stage_loads_its_slice_of_an_adapter(tiny_llama: Path, adapters: dict[str, Path]):
    """In one process, no workers: rank r of TP=2 holds the rows of each column-parallel part's
    update (q, k, v, gate, up) that its shard outputs, and a row-parallel (o, down) update whose
    partial x A^T, summed over the ranks, gives the whole update; a pipeline stage holds only its
    layers' updates."""
    from pagoda.lora import load_adapter
    from pagoda.models.loader import load_hf_config, load_model

    cfg = load_hf_config(str(tiny_llama))
    request = LoRARequest("all", 1, str(adapters["all"]))

    def build(**parallel: object) -> torch.nn.Module:
        return load_model(str(tiny_llama), cfg, torch.float32, torch.device("cpu"), 256, **parallel)

    one = load_adapter(request, build(), 8)
    ranks = [load_adapter(request, build(tp=_Unsummed(rank=r, size=2)), 8) for r in range(2)]
    modules = dict(build().named_modules())
    x = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    for target, update in one.updates.items():
        module = modules[target]
        whole = torch.zeros(3, module.out_features)
        update.add_to(whole, x[:, :module.in_features], slice(0, 3))
        row_parallel = target.endswith(("o_proj", "down_proj"))
        parts = []
        for r, adapter in enumerate(ranks):
            mine = adapter.updates[target]
            assert (mine.reduce is not None) == row_parallel
            width = module.in_features // 2 if row_parallel else module.in_features
            out = torch.zeros(3, module.out_features if row_parallel else module.out_features // 2)
            mine.add_to(out, x[:, r * width:(r + 1) * width] if row_parallel else x[:, :width], slice(0, 3))
            parts.append(out)
        if row_parallel:
            torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
        else:  # NOTE: rank r's columns: its half of each fused part, parts in order
            sizes = getattr(module, "output_sizes", [module.out_features])
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for r, out in enumerate(parts):
                cols = torch.cat([torch.arange(a + r * n // 2, a + (r + 1) * n // 2) for a, n in zip(starts, sizes, strict=True)])
                torch.testing.assert_close(out, whole[:, cols], rtol=1e-5, atol=1e-5)
    last = load_adapter(request, build(stage=PipelineStage(index=1, size=2, first_layer=1)), 8)
    assert last.updates and set(last.updates) == {t for t in one.updates if not t.startswith("layers.0.")}


@pytest.mark.slow
def test_tensor_parallel_workers_serve_adapters(tiny_llama: Path, adapters: dict[str, Path]):
    """TP=2 in worker processes (23 s here; the slicing is checked in one process above)."""
    _parallel_adapters(tiny_llama, adapters, tensor_parallel_size=2)


@pytest.mark.slow
def test_pipeline_parallel_stages_serve_their_layers_updates(tiny_llama: Path, adapters: dict[str, Path]):
    _parallel_adapters(tiny_llama, adapters, pipeline_parallel_size=2)


def test_the_server_serves_adapters_by_name(tiny_llama: Path, adapters: dict[str, Path]):
    import httpx
    from test_server import REPO, start_server

    server = start_server(tiny_llama, "--dtype", "float32", "--max-model-len", "256", "--enable-lora",
                          "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"all={adapters['all']}",
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        url = server.base_url
        # NOTE: vLLM's runtime routes: an adapter loaded while serving, refused twice.
        body = {"lora_name": "attn", "lora_path": str(adapters["attn"])}
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'attn' added successfully."
        again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        broken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert broken.status_code == 400 and "No adapter_config.json" in broken.json()["error"]["message"]
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert cards["all"]["parent"] == str(tiny_llama) and cards["all"]["root"] == str(adapters["all"])
        assert "attn" in cards and str(tiny_llama) in cards
        p = prompts(2)
        for model, adapter, prompt in (("all", adapters["all"], p[0]), ("attn", adapters["attn"], p[1]),
                                       (str(tiny_llama), None, p[0])):
            r = httpx.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == merged_greedy(tiny_llama, adapter, [prompt], 12)[0]
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "all", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert chat.status_code == 200 and chat.json()["model"] == "all"
        response = httpx.post(f"{url}/v1/responses", json={"model": "all", "input": "hi", "max_output_tokens": 4},
                              timeout=60)
        assert response.status_code == 200 and response.json()["model"] == "all"
        assert httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "a"}).status_code == 404
        refused = httpx.post(f"{url}/v1/embeddings", json={"model": "all", "input": "a"})
        assert refused.status_code == 400 and "LoRA adapter" in refused.json()["error"]["message"]
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert httpx.post(f"{url}/v1/completions", json={"model": "attn", "prompt": "a"}).status_code == 404
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
    finally:
        server.stop()
    bad = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", str(tiny_llama), "--lora-modules",
                          f"all={adapters['all']}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--lora-modules needs --enable-lora" in bad.stderr
    # NOTE: as vLLM, every --lora-modules adapter loads before the server serves.
    too_big = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", str(tiny_llama), "--dtype", "float32",
                              "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "4",
                              "--lora-modules", f"all={adapters['all']}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert too_big.returncode == 1 and "rank 8; this server takes ranks 1-4" in too_big.stderr
    assert "Loaded" not in too_big.stderr  # NOTE: refused before the model loads


def peft_adapter(model: torch.nn.Module, out: Path):
    """A PEFT LoRA made with `peft` on `model` (rank 8 on all seven projections, B made
    non-zero), saved to `out`; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.fixture(scope="module")
def smollm2_and_peft(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 in float32 (its GGUF, as transformers reads it) written as a HF folder, and a
    PEFT LoRA made on it with `peft`."""
    from conftest import smollm2_gguf_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    root = tmp_path_factory.mktemp("smollm2_peft")
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    del config.quantization_config  # NOTE: a GGUF-read model saves only as a plain one
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(root / "base")
    return root / "base", root / "adapter", peft_adapter(model, root / "adapter")


def assert_peft_adapter_equals_transformers_and_peft(base: Path, adapter: Path, peft_model) -> None:  # type: ignore[no-untyped-def]
    """Greedy tokens with the adapter, and without it, equal PEFT's on transformers (fp32)."""
    ps = prompts(2)
    want = hf_greedy_generate(peft_model, ps, 16)
    with peft_model.disable_adapter():
        want_base = hf_greedy_generate(peft_model, ps, 16)
    assert want != want_base
    llm = LLM(str(base), dtype="float32", max_model_len=256, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    lora = LoRARequest("peft", 1, str(adapter))
    got = [o.outputs[0].token_ids for o in llm.generate(ps + ps, params, use_tqdm=False,
                                                        lora_request=[lora, lora, None, None])]
    assert got == want + want_base


def test_a_peft_adapter_equals_transformers_and_peft(tiny_llama: Path, tmp_path: Path):
    """An adapter made by the `peft` library itself (its names, layout and config), on the tiny
    model: what the SmolLM2 test below checks on real weights, in a second."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert_peft_adapter_equals_transformers_and_peft(tiny_llama, tmp_path / "adapter",
                                                     peft_adapter(model, tmp_path / "adapter"))


# NOTE: slow (47 s on a 2-vCPU Zen 3, most of it reading SmolLM2's GGUF into transformers and
# saving it in fp32): the tiny-model test above keeps the same check in the default suite.
@pytest.mark.slow
def test_a_peft_adapter_on_smollm2_equals_transformers_and_peft(smollm2_and_peft):
    assert_peft_adapter_equals_transformers_and_peft(*smollm2_and_peft)


def test_adapted_rows_run_inside_the_native_stack_as_the_hooks_do(tiny_llama: Path, adapters: dict[str, Path],
                                                                  monkeypatch):
    """In bf16 a step with adapted rows runs the one-call native stack, each row adding its
    adapter's updates inside the call (pagoda/csrc/decoder.cpp), where it ran layer by layer
    with the updates as hooks: the same tokens and log-probabilities within the products' fp32
    summation order, two adapters and the base model in one batch, prefill and decode steps."""
    from pagoda.models.native_decoder import NativeDecoder

    engine = dict(dtype="bfloat16", max_model_len=256, num_kv_blocks=128, enable_lora=True, max_lora_rank=8,
                  enable_prefix_caching=False)
    native = LLM(str(tiny_llama), **engine)
    if native.engine.runner.native_decoder is None:
        pytest.skip("no native stack here (no CPU kernels)")
    hooks = LLM(str(tiny_llama), **engine)
    hooks.engine.runner.native_decoder = None
    adapted_calls = []
    call = NativeDecoder.__call__

    def counting(self, h, residual, positions, meta, lora_runs=None):  # type: ignore[no-untyped-def]
        adapted_calls.append(lora_runs is not None)
        return call(self, h, residual, positions, meta, lora_runs)

    monkeypatch.setattr(NativeDecoder, "__call__", counting)
    ps = prompts(4)
    loras = [LoRARequest("all", 1, str(adapters["all"])), LoRARequest("attn", 2, str(adapters["attn"])), None,
             LoRARequest("all", 1, str(adapters["all"]))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    got = native.generate(ps, params, use_tqdm=False, lora_request=loras)
    want = hooks.generate(ps, params, use_tqdm=False, lora_request=loras)
    assert adapted_calls.count(True) >= 8  # NOTE: the prefill step and every decode step
    base = [o.outputs[0].token_ids for o in hooks.generate(ps, params, use_tqdm=False)]
    compared = 0
    for g, w in zip(got, want, strict=True):
        g_out, w_out = g.outputs[0], w.outputs[0]
        assert g_out.token_ids[0] == w_out.token_ids[0]
        for token_g, token_w, lp_g, lp_w in zip(g_out.token_ids, w_out.token_ids, g_out.logprobs, w_out.logprobs,
                                                strict=True):
            if token_g != token_w:
                break
            assert lp_g.keys() == lp_w.keys()
            assert max(abs(lp_g[t].logprob - lp_w[t].logprob) for t in lp_g) < 0.05
            compared += 1
    assert compared >= 16
    assert [o.outputs[0].token_ids for o in got][:2] != base[:2]  # NOTE: the adapters were applied
