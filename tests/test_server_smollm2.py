"""The server with the real SmolLM2-135M-Instruct: `--model smollm2`, as `make serve` runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from test_server import ServerProcess, start_server

# NOTE: "Answer in one sentence." keeps every greedy token up to "Paris." 0.86+ logits ahead of the
# next (transformers, fp32). The bare question's first token leads by 0.08 ("The" over "L"),
# below bf16's rounding of the logits: an AMX Xeon's tile sums (docs/performance.md) tied the two
# and the answer went another way, though its logits were nearer fp32's than the vector tiles'.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


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


class Weather(BaseModel):
    """The weather to look up."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    hobbies: list[str] = Field(max_length=3)


def test_openai_parse_helper_with_response_format(client: openai.OpenAI):
    out = client.chat.completions.parse(
        model="smollm2", response_format=Person, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Describe a fictional person."}])
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and out.choices[0].finish_reason == "stop"


def test_openai_tool_helpers_named_and_required(client: openai.OpenAI):
    tools = [openai.pydantic_function_tool(Weather, name="get_weather"),
             openai.pydantic_function_tool(Person, name="save_person")]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.parse(
        model="smollm2", messages=ask, tools=tools, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments,
                                                               Weather)
    required = client.chat.completions.create(
        model="smollm2", messages=ask, tools=tools, tool_choice="required", max_tokens=300,
        temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    models = {"get_weather": Weather, "save_person": Person}
    for c in choice.message.tool_calls:
        models[c.function.name].model_validate_json(c.function.arguments)
    stream = client.chat.completions.create(
        model="smollm2", messages=ask, tools=tools, max_tokens=120, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    arguments = "".join(tc.function.arguments or "" for chunk in stream if chunk.choices
                        for tc in chunk.choices[0].delta.tool_calls or [])
    assert arguments == call.function.arguments
