"""How often agents (LangChain's create_agent, LlamaIndex's FunctionAgent or ReActAgent) finish the two-step tool
tasks of fly_integrations/bench_agents.py, and finish right, under each decoding setting asked for.

    HF_HUB_OFFLINE=1 python scripts/agent_eval.py --out agents.json \
        --setting greedy --setting qwen:temperature=0.7,top_p=0.8,top_k=20 --seeds 0 1 2
    HF_HUB_OFFLINE=1 python scripts/agent_eval.py --agent function   # LlamaIndex FunctionAgent over FlyLLM

A setting is NAME or NAME:key=value,...: FlyChatModel / FlyLLM keywords (greedy is temperature=0). Sampled
settings run once a seed. Progress goes to stderr, the summary to stdout and ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fly_integrations import FlyChatModel, FlyLLM  # noqa: E402
from fly_integrations.bench_agents import TASKS, run_llama_index_task, run_task  # noqa: E402


def parse_setting(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    values = {}
    for pair in filter(None, body.split(",")):
        key, _, value = pair.partition("=")
        values[key] = float(value) if "." in value else int(value)
    return name, values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", action="append", default=None, help="NAME[:key=value,...] (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of sampled settings")
    parser.add_argument("--model", default=None, help="target (FlyChatModel model=); default: the built-in pair")
    parser.add_argument("--agent", choices=["create_agent", "function", "react"], default="create_agent",
                        help="LangChain's create_agent, or LlamaIndex's FunctionAgent / ReActAgent")
    parser.add_argument("--recursion-limit", type=int, default=12, help="agent steps before giving up")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="write every run and the summary here (JSON)")
    args = parser.parse_args()
    runs, summary = [], {}
    for setting in args.setting or ["greedy"]:
        name, values = parse_setting(setting)
        sampled = values.get("temperature", 0) > 0
        for seed in args.seeds if sampled else [None]:
            extra = {"model": args.model} if args.model else {}
            keywords = dict(max_tokens=args.max_tokens, seed=seed, **({"temperature": 0} | extra | values))
            for i, task in enumerate(TASKS):
                if args.agent == "create_agent":
                    outcome = run_task(FlyChatModel(**keywords), task, args.recursion_limit)
                else:
                    outcome = run_llama_index_task(FlyLLM(**keywords), task, args.agent, args.recursion_limit)
                row = {"setting": name, "seed": seed, "task": i, **outcome}
                runs.append(row)
                print(f"{name} seed={seed} task {i}: finished={row['finished']} right={row['right']} "
                      f"calls={row['tool_calls']} {row['seconds']:.0f} s", file=sys.stderr, flush=True)
        mine = [r for r in runs if r["setting"] == name]
        summary[name] = {"runs": len(mine), "finished": sum(r["finished"] for r in mine),
                         "right": sum(r["right"] for r in mine), "settings": values,
                         "seconds": round(sum(r["seconds"] for r in mine), 1)}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
