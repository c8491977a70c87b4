"""Benchmark prompts and how each suite scores an answer."""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fly_runtime.bench.sandbox import run_python

# the users' workloads beside Spec-Bench: answers that copy retrieved text (rag: Spec-Bench's rag and
# summarization prompts), function-calling turns (tools: BFCL simple_python and parallel) and JSON-schema
# extraction (json), multi-turn agent tasks (agent: tools looked up then transformed, through an agent framework)
SUITES = ("spec-bench", "rag", "tools", "json", "agent", "gsm8k", "humaneval")


@dataclass
class Task:
    task_id: str
    category: str
    messages: list[dict]
    reference: dict = field(default_factory=dict)  # what scoring needs (answer number, tests, ...)


def default_data_dir() -> Path:
    """``$FLY_BENCH_DATA``, else the ``shared/data`` folder beside the project checkout."""
    env = os.environ.get("FLY_BENCH_DATA")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[3] / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        "benchmark data not found (looked in " + ", ".join(map(str, candidates)) + "); pass --data PATH"
    )


def load_tasks(suite: str, data_dir: Path | None, limit: int | None = None, per_category: int | None = None,
               skip: int = 0) -> list[Task]:
    """The suite's prompts: the first ``per_category`` of each category (if given), then ``limit`` of them
    after the first ``skip`` (a long accuracy run split into shards: ``skip=40, limit=40`` is prompts 41-80)."""
    loaders: dict[str, Callable[[Path], list[Task]]] = {
        "spec-bench": _spec_bench, "rag": _rag, "tools": _tools, "json": _json, "gsm8k": _gsm8k,
        "humaneval": _humaneval, "agent": lambda _: _registered_tasks("agent"),
    }
    if suite not in loaders:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    tasks = loaders[suite](data_dir)
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for task in tasks:
            if seen.get(task.category, 0) < per_category:
                seen[task.category] = seen.get(task.category, 0) + 1
                kept.append(task)
        tasks = kept
    tasks = tasks[skip:]
    return tasks[:limit] if limit is not None else tasks


def registered_runner(suite: str):
    """The runner class an integration registers for a suite whose turns go through it (the ``fly.bench`` entry
    point: the tools suite calls LangChain's bind_tools), which the runtime does not import; None if none is."""
    from importlib.metadata import entry_points

    for found in entry_points(group="fly.bench", name=suite):
        return found.load()
    return None


def _registered_tasks(suite: str) -> list[Task]:
    """The tasks of a suite an integration defines with its runner (the agent suite's tools are LangChain tools)."""
    runner = registered_runner(suite)
    if runner is None:
        raise ValueError(f"the {suite} suite needs fly_integrations installed (pip install -e .)")
    return runner.tasks()


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _spec_bench(data_dir: Path) -> list[Task]:
    return [Task(f"spec-bench/{row['question_id']}", row["category"],
                 [{"role": "user", "content": row["turns"][0]}])
            for row in _jsonl(data_dir / "spec_bench_question.jsonl")]


def _rag(data_dir: Path) -> list[Task]:
    return [t for t in _spec_bench(data_dir) if t.category in ("rag", "summarization")]


def _json(data_dir: Path) -> list[Task]:
    """JSON extraction under a schema (``reference["schema"]`` is decoded to); data ships with fly."""
    from fly_runtime.bench.extraction import EXTRACTIONS

    return [Task(f"json/{name}", "extraction",
                 [{"role": "system", "content": "Extract the requested fields from the user's text as JSON."},
                  {"role": "user", "content": text}], {"schema": schema, "expected": expected})
            for name, text, schema, expected in EXTRACTIONS]


def _tools(data_dir: Path) -> list[Task]:
    """BFCL turns (``reference["tools"]`` bound, ``reference["expected"]`` the possible answers); the data comes
    from the bfcl-eval wheel (``fly_runtime.bench.bfcl``), not from ``data_dir``."""
    from fly_runtime.bench.bfcl import load_bfcl
    from fly_runtime.sources.cache import cache_dir

    return [Task(f"tools/{turn_id}", category, messages, {"tools": tools, "expected": expected})
            for turn_id, category, messages, tools, expected in load_bfcl(cache_dir() / "bench")]


GSM8K_INSTRUCTION = "Solve the problem step by step. End with a line 'The answer is N.' where N is a number."


def _gsm8k(data_dir: Path) -> list[Task]:
    tasks = []
    for i, row in enumerate(_jsonl(data_dir / "gsm8k_test.jsonl")):
        answer = row["answer"].split("####")[-1].strip().replace(",", "")
        tasks.append(Task(f"gsm8k/{i}", "math", [{"role": "system", "content": GSM8K_INSTRUCTION},
                                                 {"role": "user", "content": row["question"]}], {"answer": answer}))
    return tasks


def _humaneval(data_dir: Path) -> list[Task]:
    tasks = []
    for row in _jsonl(data_dir / "HumanEval.jsonl.gz"):
        ask = ("Complete the following Python function. Reply with the whole function in one ```python block.\n\n"
               f"```python\n{row['prompt']}```")
        tasks.append(Task(row["task_id"], "coding", [{"role": "user", "content": ask}],
                          {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}))
    return tasks


# --------------------------------------------------------------------------------------------- scoring
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def score_gsm8k(task: Task, text: str) -> bool:
    got = last_number(text)
    if got is None:
        return False
    try:
        return float(got) == float(task.reference["answer"])
    except ValueError:
        return False


_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def extract_program(task: Task, text: str) -> str:
    """The program to test: the reply's code block, completed with the prompt's imports if it needs them."""
    blocks = _CODE_BLOCK.findall(text) or [text.split("```python\n")[-1]]
    code = max(blocks, key=len)
    if f"def {task.reference['entry_point']}" not in code:
        code = task.reference["prompt"] + code  # a body without its signature
    header = "\n".join(line for line in task.reference["prompt"].splitlines()
                       if line.startswith(("import ", "from ")))
    return f"{header}\n{code}"


def score_humaneval(task: Task, text: str, timeout: float = 15.0) -> bool:
    """Run the reply against the problem's tests in a separate, confined Python process (``sandbox``)."""
    program = (f"{extract_program(task, text)}\n\n{task.reference['test']}\n\n"
               f"check({task.reference['entry_point']})\n")
    return run_python(program, timeout).passed


def score_json(task: Task, text: str) -> bool:
    from fly_runtime.bench.extraction import score_extraction

    return score_extraction(text, task.reference["schema"], task.reference["expected"])


def score_tools(task: Task, calls: list[tuple[str, dict]]) -> bool:
    from fly_runtime.bench.bfcl import score_calls

    return score_calls(calls, task.reference["expected"])


# each scores a result row: its text, or (tools) the calls parsed from it
SCORERS: dict[str, Callable[[Task, dict], bool]] = {
    "gsm8k": lambda task, row: score_gsm8k(task, row["text"]),
    "humaneval": lambda task, row: score_humaneval(task, row["text"]),
    "json": lambda task, row: score_json(task, row["text"]),
    "tools": lambda task, row: score_tools(task, [(c["name"], c["arguments"]) for c in row["tool_calls"]]),
    "agent": lambda task, row: bool(row["right"]),  # the agent finished, stating the task's number
}
