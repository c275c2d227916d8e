"""Microseconds to build and serialize one streamed chunk (a one-token text delta, no logprobs,
no usage), the old way (pydantic models + model_dump_json per chunk) against the new one
(pagoda/server/chunks.py: a per-request head + json for the varying fields). Best of 5 runs
of N chunks each, one thread.
Usage: python docs/benchmarks/kernels/sse_chunk_time.py [N]   (default 100000)
"""
import sys, timeit
from pagoda.server.chunks import ChunkEncoder, chat_choice, completion_choice, content_delta
from pagoda.server.protocol import (ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionResponse,
                                    CompletionResponseChoice, DeltaMessage)

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
rid, created, model, text = "cmpl-0123456789abcdef0123456789abcdef", 1_700_000_000, "smollm2", " the"
completions = ChunkEncoder(rid, "text_completion", created, model)
chats = ChunkEncoder(rid, "chat.completion.chunk", created, model)
cases = {
    "completion, pydantic": lambda: CompletionResponse(
        id=rid, created=created, model=model, usage=None, choices=[CompletionResponseChoice(
            index=0, text=text, logprobs=None, finish_reason=None, stop_reason=None)]).model_dump_json(),
    "completion, chunks.py": lambda: completions.encode(completion_choice(0, text)),
    "chat, pydantic": lambda: ChatCompletionStreamResponse(
        id=rid, created=created, model=model, usage=None, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None,
            stop_reason=None)]).model_dump_json(),
    "chat, chunks.py": lambda: chats.encode(chat_choice(0, content_delta(text))),
}
for name, build in cases.items():
    best = min(timeit.repeat(build, number=n, repeat=5)) / n
    print(f"{name:24s} {best * 1e6:.2f} us per chunk")
