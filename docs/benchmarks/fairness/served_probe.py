"""A probe's served time to first token while one request of many prompts runs, and what the
probes cost that request: against a running server (`pagoda serve smollm2`, or any OpenAI-
compatible one).

First --idle-probes probes one after another on the idle server (their median is the idle
TTFT); then one /v1/completions request of --num-prompts prompts (--batch-max-tokens each) and,
while it runs, a probe (streamed, 2 tokens) every --interval seconds. Prints the idle and loaded
probe TTFTs (client-side: the request sent to its first token's chunk) and the batch's time.

    python docs/benchmarks/fairness/served_probe.py --url http://127.0.0.1:8000 [--interval 0.5]
"""
import argparse
import asyncio
import json
import statistics
import time

import httpx

PROBE = "Write one sentence about the sea."


async def stream_ttft(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> float:
    """A streamed completion's time to its first chunk, text or not (this probe's first token
    is often the end of text, sent as an empty chunk as vLLM does; `ignore_eos` goes on)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # NOTE: read to the end, the first chunk timed
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("no token came")
    return ttft


async def probe(client: httpx.AsyncClient, model: str) -> float:
    return await stream_ttft(client, model, PROBE, 2)


async def main(a: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=a.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        idle = [await probe(client, model) for _ in range(a.idle_probes)]
        prompts = [f"Item {i}: name a colour and a fruit." for i in range(a.num_prompts)]
        body = {"model": model, "prompt": prompts, "max_tokens": a.batch_max_tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.perf_counter()
        batch = asyncio.create_task(client.post("/v1/completions", json=body))
        loaded: list[float] = []
        await asyncio.sleep(a.interval)
        while not batch.done():
            loaded.append(await probe(client, model))
            await asyncio.sleep(a.interval)
        (await batch).raise_for_status()
        took = time.perf_counter() - start
    idle_s = statistics.median(idle)
    print(json.dumps({
        "idle_probe_ttft_s": round(idle_s, 4), "probes_during_batch": len(loaded),
        "loaded_probe_ttft_p50_s": round(statistics.median(loaded), 4) if loaded else None,
        "loaded_probe_ttft_max_s": round(max(loaded), 4) if loaded else None,
        "p50_over_idle": round(statistics.median(loaded) / idle_s, 2) if loaded else None,
        "batch_s": round(took, 2), "batch_output_tok_s": round(a.num_prompts * a.batch_max_tokens / took, 1)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--batch-max-tokens", type=int, default=16)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between a probe's end and the next")
    ap.add_argument("--idle-probes", type=int, default=5)
    asyncio.run(main(ap.parse_args()))
