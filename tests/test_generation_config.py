"""`--generation-config` (generation_config.py): the model's generation_config.json as the
defaults of the sampling fields a request leaves out, as vLLM.

The server path is checked on the SamplingParams a (fake) engine receives from the chat and
completions routes; the offline path on a real tiny model's `LLM.get_default_sampling_params`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from test_quantization_gptq_awq import checkpoints
from test_server_api import FakeEngine

from pagoda.config import EngineConfig, ModelConfig
from pagoda.engine import model_generation_defaults
from pagoda.generation_config import (
    OVERRIDDEN_WARNING,
    GenerationDefaults,
    load_generation_defaults,
)
from pagoda.input_processor import EngineRequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server.api import build_app
from pagoda.server.serve import add_serve_parser, engine_kwargs
from pagoda.server.serving import ServerContext

FILE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 24, "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
FROM_FILE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
             "max_tokens": 24}


def write_config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level Llama (test_quantization_gptq_awq's float checkpoint: made in a
    fraction of a second) with a generation_config.json recommending sampling values."""
    _, float_dir, _ = checkpoints(tmp_path_factory.mktemp("genconf_model"), "gptq-sym-g32")
    return write_config(float_dir, FILE)


def test_auto_reads_the_models_file_and_logs_it(model_dir: Path, caplog: pytest.LogCaptureFixture):
    defaults = model_generation_defaults(ModelConfig(model=str(model_dir)))
    assert defaults.params == FROM_FILE and defaults.source == "model"
    assert defaults.max_tokens_cap is None  # the model's own max_new_tokens is a default only
    assert OVERRIDDEN_WARNING in caplog.text


def test_vllm_ignores_the_file_and_gguf_has_none(model_dir: Path):
    assert model_generation_defaults(ModelConfig(model=str(model_dir), generation_config="vllm")) \
        == GenerationDefaults(source="vllm")
    assert model_generation_defaults(ModelConfig(model="smollm2")).params == {}


def test_values_equal_to_transformers_defaults_set_nothing(tmp_path: Path):
    """vLLM reads the file through `to_diff_dict`: top_k 50, temperature 1.0 are unset."""
    folder = write_config(tmp_path / "g", {"temperature": 1.0, "top_k": 50, "top_p": 0.8})
    assert load_generation_defaults("auto", {}, str(folder)).params == {"top_p": 0.8}


def test_config_json_when_no_generation_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"temperature": 0.3, "hidden_size": 8}))
    assert load_generation_defaults("auto", {}, str(tmp_path)).params == {"temperature": 0.3}


def test_override_wins_and_caps_max_tokens(model_dir: Path):
    config = ModelConfig(model=str(model_dir), override_generation_config='{"temperature": 0.2, "max_new_tokens": 8}')
    defaults = model_generation_defaults(config)
    assert defaults.params == {**FROM_FILE, "temperature": 0.2, "max_tokens": 8}
    assert defaults.max_tokens(100, room=50) == 8  # vLLM's override_max_tokens bounds every request
    only = model_generation_defaults(ModelConfig(model=str(model_dir), generation_config="vllm",
                                                 override_generation_config={"top_k": 5}))
    assert only.params == {"top_k": 5}


def test_a_folder_source(model_dir: Path, tmp_path: Path):
    folder = write_config(tmp_path / "gen", {"temperature": 0.4, "max_new_tokens": 10})
    defaults = model_generation_defaults(ModelConfig(model=str(model_dir), generation_config=str(folder)))
    assert defaults.params == {"temperature": 0.4, "max_tokens": 10} and defaults.source == str(folder)
    assert defaults.max_tokens_cap == 10
    assert defaults.max_tokens(None, room=5) == 5 and defaults.max_tokens(30, room=100) == 10


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(generation_config="/no/such/folder"), "no such folder"),
    (dict(generation_config="."), "has no generation_config.json"),
    (dict(override_generation_config="{temperature: 1}"), "must be JSON"),
    (dict(override_generation_config="[0.5]"), "must be a JSON object"),
    (dict(override_generation_config={"do_sample": True}), "unknown key(s) ['do_sample']"),
    (dict(override_generation_config={"temperature": "hot"}), "temperature must be a number"),
    (dict(override_generation_config={"top_k": 1.5}), "top_k must be an integer"),
    (dict(override_generation_config={"top_p": 0}), "top_p must be in (0, 1]"),
])
def test_bad_values_are_clear_errors(kwargs: dict, message: str):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs("smollm2", **kwargs)
    assert message in str(e.value)


def test_bad_files_name_the_file(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_generation_defaults(str(tmp_path), {}, None)
    write_config(tmp_path, {"temperature": -0.5})
    with pytest.raises(ValueError, match="generation_config.json: temperature must be non-negative"):
        load_generation_defaults("auto", {}, str(tmp_path))


def test_cli_flags_reach_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--generation-config", "vllm",
                              "--override-generation-config", '{"top_p": 0.5}'])
    config = EngineConfig.from_kwargs("smollm2", **engine_kwargs(args))
    assert config.model.generation_config == "vllm"
    assert config.model.override_generation_config == {"top_p": 0.5}


class RecordingEngine(FakeEngine):
    """test_server_api's fake engine, keeping the SamplingParams of every request it receives."""

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self.received: list[SamplingParams] = []

    async def generate_request(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.received.append(req.sampling_params)
        async for out in super().generate_request(req):
            yield out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def received_params(tokenizer: object, defaults: GenerationDefaults, path: str, body: dict
                    ) -> SamplingParams:
    engine = RecordingEngine(tokenizer)
    ctx = ServerContext(engine=engine, served_model_names=["m"], model_path="m", max_model_len=64,
                        chat_template="{% for m in messages %}{{ m.content }} {% endfor %}",
                        generation_defaults=defaults)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    response = asyncio.run(go())
    assert response.status_code == 200, response.text
    return engine.received[0]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_server_requests_get_the_files_defaults(model_dir: Path, tokenizer: object):
    defaults = model_generation_defaults(ModelConfig(model=str(model_dir)))
    got = received_params(tokenizer, defaults, "/v1/chat/completions", CHAT)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty, got.max_tokens) \
        == (0.6, 0.9, 20, 0.05, 1.1, 24)
    explicit = received_params(tokenizer, defaults, "/v1/chat/completions",
                               {**CHAT, "temperature": 0.0, "top_k": 3, "max_tokens": 30})
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens) == (0.0, -1, 30)  # greedy resets top_k
    assert explicit.repetition_penalty == 1.1
    completion = received_params(tokenizer, defaults, "/v1/completions",
                                 {"prompt": "hi", "top_p": 0.5})
    assert (completion.temperature, completion.top_p, completion.max_tokens) == (0.6, 0.5, 16)
    plain = received_params(tokenizer, GenerationDefaults(), "/v1/chat/completions", CHAT)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1)
    assert plain.max_tokens > 24  # the room the 64-token context leaves after the prompt


def test_offline_llm_default_sampling_params(model_dir: Path):
    from pagoda import LLM

    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, max_model_len=64)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k, default.min_p,
            default.repetition_penalty, default.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 24)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 24 or out.finish_reason == "stop"


def test_beam_search_takes_the_default_temperature_and_max_tokens():
    from pagoda.server.protocol import CompletionRequest
    from pagoda.server.serving import Prompt, beam_search_params

    defaults = GenerationDefaults({"temperature": 0.7, "max_tokens": 9}, None, "model")
    ctx = ServerContext(engine=None, served_model_names=["m"], model_path="m", max_model_len=64,  # type: ignore[arg-type]
                        generation_defaults=defaults)
    req = CompletionRequest(prompt="x", use_beam_search=True, max_tokens=None)
    params = beam_search_params(ctx, req, [Prompt([5, 6])], None, 1.0)
    assert (params.temperature, params.max_tokens) == (0.7, 9)
    explicit = CompletionRequest(prompt="x", use_beam_search=True, temperature=0.0, max_tokens=4)
    params = beam_search_params(ctx, explicit, [Prompt([5, 6])], 4, 1.0)
    assert (params.temperature, params.max_tokens) == (0.0, 4)
