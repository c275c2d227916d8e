"""Short prompts among long ones: a probe's served time to first token while --long-clients
clients keep sending long prompts (RAG-like: --long-words random words, --long-max-tokens out),
and what the long requests get. Against a running server (`pagoda serve smollm2 [...]`).

For --duration seconds the long clients send one request after another; a probe (a short
prompt, streamed, 2 tokens) goes every --interval seconds. Prints the idle probe TTFT (before
the load), the loaded probes' p50 and max, and the long requests' TTFT p50 and output tok/s.

    python docs/benchmarks/fairness/mixed_prefill.py --url http://127.0.0.1:8000
"""
import argparse
import asyncio
import json
import random
import statistics
import time

import httpx
from served_probe import PROBE, stream_ttft  # NOTE: this folder, the script's own

WORDS = ("river stone market window garden letter engine paper winter signal harbor lantern "
         "orchard canyon meadow copper violin ladder candle thunder").split()


async def main(a: argparse.Namespace) -> None:
    rng = random.Random(a.seed)
    async with httpx.AsyncClient(base_url=a.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        idle = [await stream_ttft(client, model, PROBE, 2) for _ in range(5)]
        end = time.perf_counter() + a.duration
        long_ttfts: list[float] = []

        async def long_client() -> None:
            while time.perf_counter() < end:
                prompt = " ".join(rng.choice(WORDS) for _ in range(a.long_words))
                long_ttfts.append(await stream_ttft(client, model, prompt, a.long_max_tokens))

        clients = [asyncio.create_task(long_client()) for _ in range(a.long_clients)]
        await asyncio.sleep(a.interval)
        loaded: list[float] = []
        while time.perf_counter() < end:
            loaded.append(await stream_ttft(client, model, PROBE, 2))
            await asyncio.sleep(a.interval)
        start_wait = time.perf_counter()
        await asyncio.gather(*clients)
        took = a.duration + (time.perf_counter() - start_wait)
    idle_s = statistics.median(idle)
    print(json.dumps({
        "idle_probe_ttft_s": round(idle_s, 4), "probes": len(loaded),
        "loaded_probe_ttft_p50_s": round(statistics.median(loaded), 4),
        "loaded_probe_ttft_max_s": round(max(loaded), 4),
        "p50_over_idle": round(statistics.median(loaded) / idle_s, 2),
        "long_requests": len(long_ttfts), "long_ttft_p50_s": round(statistics.median(long_ttfts), 3),
        "long_output_tok_s": round(len(long_ttfts) * a.long_max_tokens / took, 1)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--long-clients", type=int, default=4)
    ap.add_argument("--long-words", type=int, default=1800, help="about 2,000 tokens with SmolLM2")
    ap.add_argument("--long-max-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main(ap.parse_args()))
