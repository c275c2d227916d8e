"""The server with the real SmolLM2-135M-Instruct: `--model smollm2`, as `make serve` runs it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from test_server import ServerProcess, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("smollm2", "--max-model-len", "2048", "--kv-cache-memory", "256MiB")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_answers_and_counts_like_the_tokenizer(client: openai.OpenAI,
                                                    smollm2_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    [model] = client.models.list().data
    assert model.id == "smollm2" and model.model_extra["max_model_len"] == 2048
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24,
                                         temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    completion_ids = tokenizer.encode(answer, add_special_tokens=False)
    if out.choices[0].finish_reason == "stop":
        completion_ids.append(tokenizer.eos_token_id)  # NOTE: the EOS is generated, not shown.
    assert out.usage.completion_tokens == len(completion_ids)

    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
