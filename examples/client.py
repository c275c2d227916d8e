"""Talk to pagoda with the official `openai` client: retries, streaming, one log line a request.

    pagoda serve                      # in another terminal (or: make serve)
    python examples/client.py "What is the capital of France?"
    python examples/client.py "Tell me a story." --stream --max-tokens 128

Connection errors and timeouts are retried with exponential backoff (tenacity); anything the
server answers (a 400, a 401...) is not, since asking again would get the same answer. A
stream is retried only until its first token: after that, a retry would repeat the text.
Every request logs its latency (and, streaming, its time to first token) and token usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

log = logging.getLogger("pagoda.client")

# NOTE: APITimeoutError is a subclass of APIConnectionError; both mean "no answer came".
RETRYABLE = (openai.APIConnectionError, openai.APITimeoutError)
with_backoff = retry(
    retry=retry_if_exception_type(RETRYABLE),
    wait=wait_exponential(multiplier=0.5, min=0.5, max=8),
    stop=stop_after_attempt(5),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)


class StreamInterrupted(RuntimeError):
    """The connection broke after tokens arrived; not retried (they were already shown)."""


@dataclass
class Reply:
    text: str
    usage: CompletionUsage | None
    latency_s: float
    ttft_s: float | None = None


def make_client(base_url: str, api_key: str, timeout: float) -> openai.OpenAI:
    # NOTE: max_retries=0 leaves all retrying to tenacity: one policy, logged.
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)


def log_reply(kind: str, model: str, reply: Reply) -> None:
    usage = reply.usage
    tokens = (f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
              f"total_tokens={usage.total_tokens}" if usage else "usage=unknown")
    ttft = f" ttft={reply.ttft_s:.3f}s" if reply.ttft_s is not None else ""
    log.info("%s model=%s latency=%.3fs%s %s", kind, model, reply.latency_s, ttft, tokens)


@with_backoff
def first_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@with_backoff
def chat(client: openai.OpenAI, model: str, messages: list[ChatCompletionMessageParam], max_tokens: int,
         temperature: float) -> Reply:
    """One non-streaming chat completion."""
    started = time.perf_counter()
    out = client.chat.completions.create(model=model, messages=messages,
                                         max_tokens=max_tokens, temperature=temperature)
    reply = Reply(out.choices[0].message.content or "", out.usage, time.perf_counter() - started)
    log_reply("chat", model, reply)
    return reply


@with_backoff
def chat_stream(client: openai.OpenAI, model: str, messages: list[ChatCompletionMessageParam],
                max_tokens: int, temperature: float, on_text: Callable[[str], None]) -> Reply:
    """One streaming chat completion; `on_text` receives each piece as it arrives."""
    started, ttft, pieces, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=temperature, stream=True, stream_options={"include_usage": True})
    try:
        for chunk in stream:
            usage = chunk.usage or usage
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                pieces.append(text)
                on_text(text)
    except RETRYABLE as e:
        if pieces:
            raise StreamInterrupted(f"stream broke after {len(pieces)} pieces: {e}") from e
        raise
    reply = Reply("".join(pieces), usage, time.perf_counter() - started, ttft)
    log_reply("chat-stream", model, reply)
    return reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                             "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY", "EMPTY"))
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    client = make_client(args.base_url, args.api_key, args.timeout)
    try:
        model = args.model or first_model(client)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": args.prompt}]
        if args.stream:
            chat_stream(client, model, messages, args.max_tokens, args.temperature,
                        lambda text: print(text, end="", flush=True))
            print()
        else:
            print(chat(client, model, messages, args.max_tokens, args.temperature).text)
    except (openai.APIError, StreamInterrupted) as e:
        log.error("request failed: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
