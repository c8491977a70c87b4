"""A served default's peak memory: `fly serve` with default settings answers the requests that open each form (long
summaries, JSON extractions under a schema, short poems) and its peak resident memory (VmHWM) is read, with what
its mappings hold then. The issue's budget for a served default with every form loaded is 5 GB (docs/benchmarks.md).

    HF_HUB_OFFLINE=1 FLY_KEEP_PRICES=0 python scripts/served_memory.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "memory-check"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "year"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "year": {"type": "integer"}}}
PEOPLE = ["Ada Lovelace was born in London in 1815.", "Alan Turing was born in Maida Vale, London, in 1912.",
          "Grace Hopper was born in New York City in 1906.", "Edsger Dijkstra was born in Rotterdam in 1930."]
POEMS = ["Write a short poem about rain.", "Write a haiku about the sea.", "Write two lines about autumn."]


def status(pid: int) -> dict[str, float]:
    """The server's peak and current resident memory and its parts, GB."""
    wanted = {"VmHWM:": "peak", "VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, *value = line.split()
        if key in wanted:
            out[wanted[key]] = int(value[0]) / 1e6
    return out


def chat(client: httpx.Client, base: str, messages: list[dict], **extra) -> tuple[float, str]:
    began = time.perf_counter()
    reply = client.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=600,
                        json={"messages": messages, **extra})
    reply.raise_for_status()
    return time.perf_counter() - began, reply.json()["choices"][0]["message"]["content"] or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="summaries and extractions (poems: one fewer)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    fly = Path(sys.executable).parent / "fly"
    server = subprocess.Popen([str(fly), "serve", "--port", str(port), "--api-key", KEY], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=dict(os.environ))
    text = (ROOT / "docs" / "design.md").read_text()
    try:
        with httpx.Client() as client:
            for _ in range(600):
                try:
                    if client.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(1)
            for i in range(args.rounds):
                part = text[3000 * i: 3000 * (i + 1)]
                seconds, _ = chat(client, base, [{"role": "user", "content": f"Summarise in three sentences:\n\n{part}"}],
                                  max_tokens=96)
                print(f"summary {i}: {seconds:5.1f} s  {status(server.pid)}", flush=True)
            for i in range(args.rounds):
                seconds, reply = chat(client, base, [{"role": "user", "content": PEOPLE[i % len(PEOPLE)]}],
                                      max_tokens=64, response_format={"type": "json_schema", "json_schema": {
                                          "name": "person", "schema": SCHEMA}})
                json.loads(reply)
                print(f"json {i}: {seconds:5.1f} s  {status(server.pid)}", flush=True)
            for i, poem in enumerate(POEMS[: max(1, args.rounds - 1)]):
                seconds, _ = chat(client, base, [{"role": "user", "content": poem}], max_tokens=96)
                print(f"poem {i}: {seconds:5.1f} s  {status(server.pid)}", flush=True)
        peak = status(server.pid)
        print(f"peak resident memory of `fly serve`: {peak['peak']:.2f} GB (now {peak['rss']:.2f}: anonymous "
              f"{peak['anon']:.2f}, file-backed {peak['file']:.2f})")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
