"""Many callers at once against OpenAI-compatible servers: the same requests one after another, then from
N clients at once; wall time and aggregate completion tokens a second. Figures as JSON on stdout.

    fly serve --port 8000 &                                   # or: python -m llama_cpp.server --model X.gguf
    python scripts/concurrency_bench.py --url http://127.0.0.1:8000/v1 --clients 4 16 --tokens 96

Given several ``--url``s (servers up side by side), each concurrent run is repeated ``--repeats`` times in
turns (A, B, A, B, ...), so that a VM's drift hits every server alike, and the medians are compared with the
first server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

PROMPTS = [
    "Explain what a hash map is and when to use one.",
    "Write a short story about a lighthouse keeper.",
    "List the steps to make a cup of green tea.",
    "Describe how photosynthesis works, simply.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What are the pros and cons of remote work?",
    "Summarise the plot of Romeo and Juliet.",
    "Explain the difference between TCP and UDP.",
    "Give advice to someone learning to play the guitar.",
    "Describe a walk through a forest in autumn.",
    "Explain what recursion is with an example.",
    "Write a polite email declining a meeting invitation.",
    "What should a beginner know about investing?",
    "Explain how a bicycle stays upright.",
    "Write a haiku sequence about the sea, then explain it.",
    "Compare cats and dogs as pets.",
]


async def ask(http: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0}
    start = time.perf_counter()
    response = await http.post(url + "/chat/completions", json=body)
    response.raise_for_status()
    reply = response.json()
    return {"seconds": time.perf_counter() - start, "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"]}


async def run(url: str, model: str, prompts: list[str], tokens: int, clients: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as http:
        queue = list(reversed(prompts))
        replies: list[dict] = []

        async def client() -> None:
            while queue:
                replies.append(await ask(http, url, model, queue.pop(), tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    made = sum(r["tokens"] for r in replies)
    return {"clients": clients, "requests": len(replies), "wall_s": round(wall, 1),
            "tok_per_s": round(made / wall, 2), "completion_tokens": made,
            "median_latency_s": round(sorted(r["seconds"] for r in replies)[len(replies) // 2], 1)}


async def main(args: argparse.Namespace) -> dict:
    results = {"urls": args.url, "tokens": args.tokens, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": [],
               "summary": []}
    models = {}
    async with httpx.AsyncClient(timeout=None) as http:  # warm: the first request loads and measures
        for url in args.url:
            models[url] = args.model or (await http.get(url + "/models")).json()["data"][0]["id"]
            await ask(http, url, models[url], "Hello", 4)
    for clients in args.clients:
        prompts = PROMPTS[:clients] * args.rounds
        serial = {url: await run(url, models[url], prompts, args.tokens, 1) for url in args.url}
        rates: dict[str, list[float]] = {url: [] for url in args.url}
        for _ in range(args.repeats):
            for url in args.url:
                together = await run(url, models[url], prompts, args.tokens, clients)
                together["url"] = url
                together["wall_vs_serial"] = round(together["wall_s"] / serial[url]["wall_s"], 2)
                together["tok_per_s_vs_serial"] = round(together["tok_per_s"] / serial[url]["tok_per_s"], 2)
                rates[url].append(together["tok_per_s"])
                results["runs"].append(together)
                print(json.dumps(together), file=sys.stderr, flush=True)
        results["runs"] += [dict(run, url=url) for url, run in serial.items()]
        first = statistics.median(rates[args.url[0]])
        for url in args.url:
            median = statistics.median(rates[url])
            results["summary"].append({"clients": clients, "url": url, "median_tok_per_s": median,
                                       "vs_first": round(median / first, 2), "serial_tok_per_s":
                                       serial[url]["tok_per_s"]})
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", nargs="+", default=["http://127.0.0.1:8000/v1"],
                        help="one server, or several compared in turns")
    parser.add_argument("--model", default=None, help="default: the first the server lists")
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=1, help="requests per client")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="concurrent runs per server and client count")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
