"""Load test of a running `fly serve`: N concurrent streaming clients, R requests in all, questions with one right
answer each: every answer checked for being complete (a finish reason) and right, and compared with the same
request served alone; with --leavers, that many more clients keep opening long streams and leaving after their
first piece. Figures as JSON on stdout.

    fly serve --port 8000 &
    python scripts/load_test.py --url http://127.0.0.1:8000/v1 --clients 16 --requests 200 --leavers 4 --pid $!
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

# a question per client slot, each with one right answer (decoded beside others on a llama.cpp target, a near-tie
# may go another way than alone: the answer must still be right and complete)
ANSWERS = {f"What is {a} + {b}? Answer with the number only.": str(a + b)
           for a, b in zip(range(21, 37, 2), range(13, 80, 9))}
PROMPTS = list(ANSWERS)


async def stream(http: httpx.AsyncClient, url: str, key: str | None, prompt: str,
                 tokens: int) -> tuple[int, str, float, str | None]:
    """(status, text, seconds, finish reason) of one streamed chat request."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": True}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    start, text, finish = time.perf_counter(), "", None
    async with http.stream("POST", url + "/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return response.status_code, "", time.perf_counter() - start, None
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return 200, text, time.perf_counter() - start, finish


async def main(args: argparse.Namespace) -> dict:
    import psutil

    server = psutil.Process(args.pid) if args.pid else None
    async with httpx.AsyncClient(timeout=None) as http:
        alone = {p: (await stream(http, args.url, args.key, p, args.tokens))[1] for p in PROMPTS}
        rss_before = server.memory_info().rss if server else None
        todo, results = list(range(args.requests)), []

        async def client() -> None:
            while todo:
                prompt = PROMPTS[todo.pop() % len(PROMPTS)]
                status, text, seconds, finish = await stream(http, args.url, args.key, prompt, args.tokens)
                results.append((prompt, status, text, seconds, finish))

        left = []

        async def leaver() -> None:  # a long answer asked for, and abandoned at its first piece
            body = {"messages": [{"role": "user", "content": "Write a long essay about rivers."}], "max_tokens": 400,
                    "stream": True}
            headers = {"authorization": f"Bearer {args.key}"} if args.key else {}
            while todo:
                async with http.stream("POST", args.url + "/chat/completions", json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        if '"content": "' in line and '"content": ""' not in line:
                            break
                left.append(1)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)), *(leaver() for _ in range(args.leavers)))
        wall = time.perf_counter() - start
    latencies = [r[3] for r in results]
    return {
        "clients": args.clients, "requests": len(results), "max_tokens": args.tokens,
        "ok": sum(r[1] == 200 for r in results), "complete": sum(r[4] in ("stop", "length") for r in results),
        "right": sum(ANSWERS[r[0]] in r[2] for r in results), "equal_to_alone": sum(r[2] == alone[r[0]] for r in results),
        "leavers": args.leavers, "abandoned_streams": len(left), "wall_seconds": round(wall, 1), "median_latency_s": round(statistics.median(latencies), 2),
        "p95_latency_s": round(sorted(latencies)[int(0.95 * (len(latencies) - 1))], 2),
        "rss_growth": (server.memory_info().rss / rss_before - 1) if server else None,
        "date": time.strftime("%Y-%m-%d"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--key", default=None)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--leavers", type=int, default=0, help="clients that abandon long streams meanwhile")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id, to measure its memory")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
