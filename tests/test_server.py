"""The OpenAI-compatible server, as a real process on 127.0.0.1 serving a tiny random Llama.

One server per module (started by `python -m pagoda.entrypoints.openai.api_server`), hit with
the official `openai` client and with raw httpx. A second, short-lived server covers API keys,
served model names and the SIGTERM drain, which ends it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "1, 2, 3,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def start_server(model: str | Path, *flags: str, env: dict[str, str] | None = None,
                 timeout: float = 180.0) -> ServerProcess:
    """Starts the server as a subprocess and waits until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port), "--uvicorn-log-level", "warning", *flags]
    pythonpath = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **(env or {})}
    log_path = Path(tempfile.mkstemp(prefix="pagoda_server_", suffix=".log")[1])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server did not start in {timeout} s:\n{server.log()}")


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text output (summed over unmatched labels)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total, found = total + float(m.group(3)), True
    assert found, f"{name} {labels} not in /metrics"
    return total


def sse_events(lines: list[str]) -> list[dict | str]:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    srv = start_server(tiny_llama, "--dtype", "float32", "--num-kv-blocks", "128",
                       "--max-num-seqs", "16", "--seed", "0", "--engine-stall-timeout", "30")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def greedy(client: openai.OpenAI, model: str, prompt: str | list[int], max_tokens: int = 8) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


# ---- plain routes -------------------------------------------------------------------------


def test_models_health_version(client: openai.OpenAI, http: httpx.Client, tiny_llama: Path):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_llama)]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    assert "vllm:num_requests_running" in http.get("/metrics").text


def test_tokenize_detokenize(http: httpx.Client, tokenizer):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                 "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}


# ---- completions --------------------------------------------------------------------------


def test_completion_usage_matches_tokenizer(client: openai.OpenAI, model_id: str, tokenizer):
    out = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert len(choice.logprobs.tokens) == 6 and "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_completion_prompt_forms(client: openai.OpenAI, model_id: str, tokenizer):
    text = greedy(client, model_id, PROMPTS[1])
    assert greedy(client, model_id, tokenizer.encode(PROMPTS[1])) == text
    out = client.completions.create(model=model_id, prompt=PROMPTS[:2], max_tokens=3, n=2,
                                    seed=7, temperature=1.0, echo=True)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text.startswith(PROMPTS[c.index // 2])
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:2])
    assert 4 <= out.usage.completion_tokens <= 12
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    out = client.completions.create(model=model_id, prompt=ids, max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)


def test_completion_streaming_equals_non_streaming(client: openai.OpenAI, model_id: str):
    full = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=model_id, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_with_continuous_usage(http: httpx.Client, tokenizer):
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    assert all(line.startswith("data: ") for line in lines if line)
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(tokenizer.encode(PROMPTS[2]))}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == (
        chunks[0]["usage"]["prompt_tokens"] + 5)


def test_sampling_parameters(client: openai.OpenAI, model_id: str):
    def sample(**kwargs) -> str:
        extra = {k: kwargs.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "min_tokens",
                                             "ignore_eos") if k in kwargs}
        out = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=6,
                                        extra_body=extra, **kwargs)
        return out.choices[0].text

    seeded = dict(temperature=1.0, top_p=0.9, seed=1234, top_k=50, min_p=0.01)
    assert sample(**seeded) == sample(**seeded)
    penalized = sample(temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
                       repetition_penalty=1.3, min_tokens=2, ignore_eos=True)
    assert isinstance(penalized, str) and penalized
    text = greedy(client, model_id, PROMPTS[3], 8)
    stop = text.strip().split()[1] if len(text.split()) > 1 else text[2:4]
    stopped = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=8,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def test_a_cache_salt_keeps_cached_prefixes_apart(client: openai.OpenAI, model_id: str):
    """vLLM's `cache_salt`: a prompt cached under one salt is a miss under another or none."""
    prompt = "A salted system prompt that several tenants send, word for word. " * 4

    def cached_tokens(salt: str | None) -> int:
        chunks = list(client.completions.create(
            model=model_id, prompt=prompt, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={} if salt is None else {"cache_salt": salt}))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    counts = [cached_tokens(salt) for salt in ("s1", "s2", "s1", None, None)]
    assert counts[:2] == [0, 0] and counts[3] == 0, counts
    assert counts[2] >= 16 and counts[4] == counts[2], counts
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=model_id, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})


# ---- chat ---------------------------------------------------------------------------------


def test_chat_usage_and_streaming(client: openai.OpenAI, model_id: str, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(model=model_id, messages=messages, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.content) <= 5
    assert out.choices[0].message.role == "assistant"
    assert all(len(c.top_logprobs) == 3 for c in out.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_completion_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens)
    # NOTE: the same prompt again: its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= 16
    chunks = list(client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=3, n=2, temperature=1.0, seed=3,
        stream=True))
    assert {c.choices[0].index for c in chunks if c.choices[0].delta.role} == {0, 1}
    assert {c.choices[0].index for c in chunks if c.choices[0].finish_reason} == {0, 1}


# ---- errors -------------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"].endswith("Error")
    if param is not None:
        assert error["param"] == param
    return str(error["message"])


def test_context_length_errors(http: httpx.Client, client: openai.OpenAI, model_id: str):
    long_prompt = [100] * 500
    msg = assert_error(http.post("/v1/completions", json={"prompt": long_prompt,
                                                          "max_tokens": 20}), 400, "max_tokens")
    assert msg.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                          "However, you requested 520 tokens (500 in the messages, 20 in the "
                          "completion).")
    msg = assert_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 600}]}), 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in msg
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
        client.completions.create(model=model_id, prompt=[5] * 600, max_tokens=1)


def test_bad_requests(http: httpx.Client):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400,
                 "temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "a", "top_p": 1.5}), 400, "top_p")
    assert_error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}), 400,
                 "max_tokens")
    assert_error(http.post("/v1/completions", json={"prompt": "a", "n": 2, "temperature": 0}),
                 400, "n")
    assert_error(http.post("/v1/completions", json={"prompt": [10**9]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={}), 400, "prompt")
    assert_error(http.post("/v1/chat/completions", content=b'{"messages": [', headers={
        "content-type": "application/json"}), 400)
    msg = assert_error(http.post("/v1/chat/completions", content=json.dumps(chat), headers={
        "content-type": "text/plain"}), 400)
    assert "application/json" in msg
    assert_error(http.post("/v1/chat/completions", json={**chat, "model": "nope"}), 404, "model")
    assert_error(http.get("/v1/nope"), 404)


def test_client_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=str(client.models.list().data[0].id), prompt="x",
                                  temperature=5)


# ---- disconnects, concurrency, responsiveness ---------------------------------------------


def wait_until_idle(http: httpx.Client, timeout: float = 10.0) -> str:
    """Waits until the engine holds no request and no KV block; returns /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        # NOTE: gauges update when the engine steps; a 1-token request makes it step.
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        text = http.get("/metrics").text
        idle = (metric(text, "vllm:num_requests_running") == 0
                and metric(text, "pagoda:kv_blocks_free") == metric(text, "pagoda:kv_blocks"))
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


# NOTE: the tiny Llama of conftest.py: K and V, 2 layers, 2 KV heads of 64 / 4 dims, float32.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * (64 // 4) * 4
NUM_KV_BLOCKS, BLOCK_SIZE = 128, 16


def test_kv_cache_report_while_a_request_runs(server: ServerProcess, http: httpx.Client):
    assert "KV cache pool: 1.0 MiB, 128 blocks x 16 tokens" in server.log()
    wait_until_idle(http)
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)]
            report = http.get("/kv_cache").json()
    assert report["pool_bytes"] == NUM_KV_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    assert report["num_blocks"] == NUM_KV_BLOCKS and report["block_size"] == BLOCK_SIZE
    held, reserved = report["tokens_held"], report["slots_reserved"]
    assert held > 0 and reserved >= held and reserved % BLOCK_SIZE == 0
    assert report["slots_unused"] == reserved - held < BLOCK_SIZE
    assert report["num_blocks_free"] == NUM_KV_BLOCKS - reserved // BLOCK_SIZE
    # NOTE: one running request; reserving its full context up front would take 512 slots.
    assert report["contiguous_reservation_tokens"] == 1 * MAX_MODEL_LEN
    assert report["contiguous_reservation_bytes"] == MAX_MODEL_LEN * KV_BYTES_PER_TOKEN
    assert f"{held} tokens held in {reserved} reserved slots" in report["text"]
    assert "contiguous max-length reservation for the same requests: 512 slots" in report["text"]
    wait_until_idle(http)
    idle = http.get("/kv_cache").json()
    assert (idle["tokens_held"], idle["slots_reserved"], idle["contiguous_reservation_tokens"]
            ) == (0, 0, 0)


def test_stream_disconnect_aborts_and_frees_blocks(server: ServerProcess, http: httpx.Client):
    aborted_before = metric(http.get("/metrics").text, "vllm:request_success_total",
                            finished_reason="abort")
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(6)]
    started = time.monotonic()
    text = wait_until_idle(http)
    assert time.monotonic() - started < 5
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "pagoda:kv_blocks_free") == metric(text, "pagoda:kv_blocks")
    assert metric(text, "vllm:request_success_total", finished_reason="abort") > aborted_before


def test_non_streaming_disconnect_aborts(server: ServerProcess, http: httpx.Client):
    aborted_before = metric(http.get("/metrics").text, "vllm:request_success_total",
                            finished_reason="abort")
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 480,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.3)
    text = wait_until_idle(http)
    assert metric(text, "pagoda:kv_blocks_free") == metric(text, "pagoda:kv_blocks")
    assert metric(text, "vllm:request_success_total", finished_reason="abort") > aborted_before


def test_concurrent_greedy_matches_alone(server: ServerProcess, client: openai.OpenAI,
                                         model_id: str):
    alone = [greedy(client, model_id, p, 12) for p in PROMPTS]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                      max_retries=0) as aclient:
            outs = await asyncio.gather(*[aclient.completions.create(
                model=model_id, prompt=p, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}) for p in PROMPTS])
        return [o.choices[0].text for o in outs]

    assert asyncio.run(together()) == alone


def test_health_answers_fast_while_saturated(server: ServerProcess, http: httpx.Client):
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "n": 4}
    load = [threading.Thread(target=httpx.post, args=(f"{server.base_url}/v1/completions",),
                             kwargs={"json": body, "timeout": 120}) for _ in range(4)]
    for t in load:
        t.start()
    time.sleep(0.5)
    latencies = []
    for path in ["/health", "/v1/models"] * 5:
        started = time.perf_counter()
        assert http.get(path).status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.05)
    for t in load:
        t.join()
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.05 and latencies[-1] < 0.25, latencies


# ---- keys, names, drain: a second server that the last test stops ------------------------


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: Path):
    srv = start_server(tiny_llama, "--api-key", "key-one", "--api-key", "key-two",
                       "--served-model-name", "tiny", "tiny-alias", "--num-kv-blocks", "64",
                       "--drain-timeout", "20", env={"PAGODA_API_KEY": "key-env"})
    yield srv
    srv.stop()


def test_api_keys_and_served_names(keyed_server: ServerProcess):
    url = keyed_server.base_url
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}
                     ).status_code == 401
    for key in ("key-one", "key-two", "key-env"):
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert [m["id"] for m in r.json()["data"]] == ["tiny", "tiny-alias"]
    for open_route in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(f"{url}{open_route}").status_code == 200, open_route
    key = {"Authorization": "Bearer key-one"}
    for method, route, body in (("POST", "/tokenize", {"prompt": "a"}),
                                ("POST", "/detokenize", {"tokens": [1]}),
                                ("GET", "/kv_cache", None), ("GET", "/docs", None),
                                ("GET", "/openapi.json", None)):
        assert httpx.request(method, f"{url}{route}", json=body).status_code == 401, route
        assert httpx.request(method, f"{url}{route}", json=body, headers=key).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-one", max_retries=0)
    out = client.chat.completions.create(model="tiny-alias", max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.model == "tiny-alias"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()


def test_sigterm_drains_then_exits_zero(keyed_server: ServerProcess):
    url, headers = keyed_server.base_url, {"Authorization": "Bearer key-one"}
    body = {"model": "tiny", "prompt": "drain", "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    probe = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    lines: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            it = r.iter_lines()
            lines.extend(next(it) for _ in range(2))
            keyed_server.proc.send_signal(signal.SIGTERM)
            for _ in range(50):  # NOTE: until the signal handler has run; the stream is long.
                refused = c.post("/v1/completions", json=probe)
                if refused.status_code != 200:
                    break
                time.sleep(0.01)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == 503
            assert c.get("/health").status_code == 503
            lines.extend(it)
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert keyed_server.proc.wait(30) == 0, keyed_server.log()


# ---- examples/client.py -------------------------------------------------------------------


def load_example_client():
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_client", REPO / "examples/client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there.
    spec.loader.exec_module(module)
    return module


def test_example_client(server: ServerProcess, model_id: str, caplog: pytest.LogCaptureFixture):
    from tenacity import stop_after_attempt, wait_none

    example = load_example_client()
    client = example.make_client(f"{server.base_url}/v1", "unused", 30)
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level("INFO", logger="pagoda.client"):
        full = example.chat(client, model_id, messages, 6, 0.0)
        pieces: list[str] = []
        streamed = example.chat_stream(client, model_id, messages, 6, 0.0, pieces.append)
    assert streamed.text == "".join(pieces) == full.text
    assert streamed.usage.completion_tokens == full.usage.completion_tokens
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.client"]
    assert len(lines) == 2 and all("latency=" in x and "total_tokens=" in x for x in lines)
    dead = example.make_client(f"http://127.0.0.1:{free_port()}/v1", "unused", 5)
    quick = example.chat.retry_with(wait=wait_none(), stop=stop_after_attempt(3))
    with pytest.raises(openai.APIConnectionError):
        quick(dead, model_id, messages, 6, 0.0)
    assert quick.statistics["attempt_number"] == 3


def _nested_schema(depth: int) -> str:
    """A JSON schema `depth` objects deep, as text (json.dumps itself stops near 1,000)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


@pytest.mark.parametrize("depth", [500, 10_000])
def test_bodies_nested_deep_get_a_clear_answer_never_a_500(http: httpx.Client, model_id: str, depth: int) -> None:
    """A schema, tool parameters or messages nested thousands deep: a 400 (or an answer), never a
    500 or a traceback, and the server keeps serving."""
    head = f'{{"model":"{model_id}","max_tokens":2,'
    user = '"messages":[{"role":"user","content":"hi"}]'
    bodies = {
        "response_format": head + user + ',"response_format":{"type":"json_schema","json_schema":'
                           f'{{"name":"x","schema":{_nested_schema(depth)}}}}}}}',
        "tools": head + user + f',"tools":[{{"type":"function","function":{{"name":"f","parameters":'
                 f'{_nested_schema(depth)}}}}}]}}',
        "messages": head + '"messages":' + "[" * depth + "]" * depth + "}",
    }
    for what, body in bodies.items():
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), (what, r.status_code, r.text[:300])
        assert "Traceback" not in r.text and "RecursionError" not in r.text, (what, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["message"], what
    assert http.get("/health").status_code == 200


def test_streams_cut_at_the_drain_timeout_end_with_an_error_then_done(tiny_llama: Path):
    """SIGTERM with --drain-timeout 0.2 while a long stream and a long non-streamed request
    run: the stream ends with an error event naming the cut, then [DONE] (never a silent close
    that passes for a whole answer), the other gets a 5xx naming it; the log has one line per
    cut request and no traceback; the process exits 0."""
    srv = start_server(tiny_llama, "--num-kv-blocks", "512", "--drain-timeout", "0.2")
    try:
        # NOTE: 16 sequences of 480 tokens: seconds of work, far more than the 0.2 s drain
        body = {"prompt": "cut", "max_tokens": 480, "n": 16, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        whole: list[httpx.Response] = []
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]

            def post_whole() -> None:
                with httpx.Client(base_url=srv.base_url, timeout=60) as other:
                    whole.append(other.post("/v1/completions", json={**body, "model": model, "stream": False, "n": 2}))

            unstreamed = threading.Thread(target=post_whole)
            with c.stream("POST", "/v1/completions", json={**body, "model": model}) as r:
                it = r.iter_lines()
                lines.extend(next(it) for _ in range(2))
                unstreamed.start()
                time.sleep(0.3)  # NOTE: the second request admitted before the signal
                srv.proc.send_signal(signal.SIGTERM)
                lines.extend(it)
            unstreamed.join(60)
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert isinstance(error, dict) and "error" in error, events[-3:]
        assert "cut" in error["error"]["message"] and "drain-timeout" in error["error"]["message"]
        assert whole and whole[0].status_code >= 500, whole and whole[0].text
        assert "drain-timeout" in whole[0].json()["error"]["message"], whole[0].text
        assert srv.proc.wait(30) == 0
        log = srv.log()
        assert log.count(" cut: the server is shutting down") == 2, log[-2000:]
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        srv.stop()
