"""Locust load test for an OpenAI-compatible server: pagoda, vLLM or llama.cpp's llama-server.

Each simulated user is a chatbot user: it streams `/v1/chat/completions` (3 times in 4) or
`/v1/completions`, reads the reply token by token, thinks for up to `--think-time` seconds,
and asks again. Besides Locust's row per endpoint (failures, and the time to the response
headers), it reports per streamed reply, under request types of their own:

- `TTFT` (names `chat`, `completions`): from sending to the first chunk with text;
- `ITL`: every gap between two consecutive chunks with text (pooled, as `vllm bench serve`);
- `E2E`: from sending to the end of the stream.

A stream that answers non-200, carries an error event, or ends without text is a failure.

    pip install 'pagoda[bench]'         # Locust (pagoda's dev install has it)
    locust -f examples/locustfile.py --host http://127.0.0.1:8000      # web UI on :8089
    locust -f examples/locustfile.py --host http://127.0.0.1:8000 --headless \\
        -u 50 -r 10 -t 2m --max-tokens 800 --csv results/locust

Options added to Locust's: `--model` (default: the first of `/v1/models`), `--max-tokens`,
`--ignore-eos` (generate exactly --max-tokens; pagoda and vLLM accept it), `--think-time`,
`--api-key` (default: $PAGODA_API_KEY or $OPENAI_API_KEY). In Locust's "Aggregated" row
the TTFT/ITL/E2E samples count as requests: read the rows by type and name.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from locust import HttpUser, events, task

SYSTEM_PROMPT = ("You are the customer-support assistant of an online shop. Answer politely, "
                 "precisely and in a few short paragraphs.")
QUESTIONS = [
    "My order has not arrived after ten days. What can I do?",
    "How do I return a pair of shoes that do not fit?",
    "Can I change the delivery address of an order I placed an hour ago?",
    "The discount code from your newsletter is refused at checkout. Why?",
    "Do you ship to Japan, and how long does it take?",
    "I was charged twice for the same order. Please help.",
    "Which payment methods do you accept?",
    "How do I delete my account and my personal data?",
]


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument("--model", default="", help="model name (default: first of /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --max-tokens (pagoda, vLLM)")
    parser.add_argument("--think-time", type=float, default=1.0,
                        help="a user waits up to this many seconds between requests")
    parser.add_argument("--api-key", is_secret=True,
                        default=os.environ.get("PAGODA_API_KEY") or os.environ.get("OPENAI_API_KEY", ""),
                        help="sent as Authorization: Bearer")


class StreamError(Exception):
    """The stream failed after its headers: an error event, or no text at all."""


class ChatbotUser(HttpUser):
    """A user chatting with the model; every reply streamed and timed token by token."""

    def wait_time(self) -> float:
        return random.uniform(0.0, self.environment.parsed_options.think_time)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.model = options.model or self.first_model()

    def first_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                raise RuntimeError(f"cannot list the models: HTTP {resp.status_code}")
            return str(resp.json()["data"][0]["id"])

    def sampling(self) -> dict[str, Any]:
        options = self.environment.parsed_options
        body: dict[str, Any] = {"model": self.model, "max_tokens": options.max_tokens,
                                "temperature": 0.7, "stream": True,
                                "stream_options": {"include_usage": True}}
        if options.ignore_eos:
            body["ignore_eos"] = True
        return body

    @task(3)
    def chat(self) -> None:
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": random.choice(QUESTIONS)}]
        self.stream("/v1/chat/completions", {**self.sampling(), "messages": messages}, "chat")

    @task(1)
    def completion(self) -> None:
        prompt = f"{SYSTEM_PROMPT}\n\nCustomer: {random.choice(QUESTIONS)}\nAssistant:"
        self.stream("/v1/completions", {**self.sampling(), "prompt": prompt}, "completions")

    def stream(self, path: str, body: dict[str, Any], name: str) -> None:
        start = time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, stream=True,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                self.read_stream(resp, start, name)
            except (StreamError, ValueError, OSError) as exc:
                resp.failure(f"{type(exc).__name__}: {exc}")
                return
            resp.success()
        self.record("E2E", name, time.perf_counter() - start)

    def read_stream(self, resp: Any, start: float, name: str) -> None:
        """Times each chunk with text: the first as TTFT, the others as ITL samples."""
        last: float | None = None
        for line in resp.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(chunk["error"].get("message", chunk["error"]))
            if not chunk_text(chunk):
                continue
            now = time.perf_counter()
            self.record("TTFT" if last is None else "ITL", name, now - (last or start))
            last = now
        if last is None:
            raise StreamError("the stream ended without text")

    def record(self, kind: str, name: str, seconds: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=name,
                                             response_time=seconds * 1000.0, response_length=0,
                                             exception=None, context={})


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chat or completion stream chunk carries ('' for none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta")
    if delta is not None:
        return str(delta.get("content") or "")
    return str(choices[0].get("text") or "")
