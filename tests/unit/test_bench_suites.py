"""fly bench without a model: suite loading, scoring, mode specs, argument checks. The suites are read from
../shared/data; tests that need it skip where it is missing."""

import json
import subprocess
import sys

import pytest

from fly_runtime.bench.runner import ModeSpec
from fly_runtime.bench.suites import default_data_dir, last_number, load_tasks, score_gsm8k, score_humaneval


@pytest.fixture(scope="module")
def data_dir():
    try:
        return default_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"benchmark data not found: {exc}")


def test_spec_bench_first_turns_per_category(data_dir):
    tasks = load_tasks("spec-bench", data_dir, per_category=2)
    categories = {t.category for t in tasks}
    assert len(categories) == 13 and len(tasks) == 26
    assert all(len(t.messages) == 1 and t.messages[0]["role"] == "user" for t in tasks)


def test_skip_and_limit_select_one_shard(data_dir):
    everything = load_tasks("gsm8k", data_dir)
    shard = load_tasks("gsm8k", data_dir, limit=3, skip=40)
    assert [t.task_id for t in shard] == [t.task_id for t in everything[40:43]]


def test_gsm8k_scoring_uses_the_last_number(data_dir):
    task = load_tasks("gsm8k", data_dir, limit=1)[0]
    assert task.reference["answer"] == "18"
    assert score_gsm8k(task, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is 18.")
    assert not score_gsm8k(task, "The answer is 18. Wait, no: 20")
    assert last_number("costs $1,234.50.") == "1234.50" and last_number("no digits") is None


def test_humaneval_runs_tests_in_a_subprocess(data_dir):
    import gzip

    rows = [json.loads(line) for line in gzip.open(data_dir / "HumanEval.jsonl.gz", "rt")]
    task = load_tasks("humaneval", data_dir, limit=1)[0]
    good = f"```python\n{rows[0]['prompt']}{rows[0]['canonical_solution']}```"
    assert score_humaneval(task, good)
    assert not score_humaneval(task, "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```")
    assert not score_humaneval(task, "```python\ndef has_close_elements(n, t):\n    while True: pass\n```",
                               timeout=2)


def test_mode_specs():
    assert ModeSpec.parse("fly:k10") == ModeSpec("fly:k10", "fly", 10)
    assert ModeSpec.parse("llama-cpp") == ModeSpec("llama-cpp", "llama-cpp")
    with pytest.raises(ValueError, match="unknown mode"):
        ModeSpec.parse("fast")


@pytest.mark.parametrize("flags, message", [(["--skip", "-1"], "--skip must be >= 0"),
                                            (["--skip", "100000"], "no prompts selected"),
                                            (["--agent-steps", "2"], "--agent-steps must be >= 3")])
def test_bench_rejects_bad_settings_before_loading_models(tmp_path, data_dir, flags, message):
    proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "bench", "--suite", "gsm8k", *flags,
                           "--out", str(tmp_path / "bench")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr


def test_rag_suite_is_spec_bench_rag_and_summarization(data_dir):
    tasks = load_tasks("rag", data_dir, per_category=2)
    assert len(tasks) == 4 and {t.category for t in tasks} == {"rag", "summarization"}


def test_json_suite_scores_parsed_valid_and_matching_extractions(data_dir):
    from fly_runtime.bench.suites import score_json

    tasks = load_tasks("json", data_dir)
    assert len(tasks) == 8 and all("schema" in t.reference for t in tasks)
    invoice = tasks[0]
    right = dict(invoice.reference["expected"], seller="norrvik  timber ab", total=548.0)
    assert score_json(invoice, json.dumps(right))
    assert not score_json(invoice, json.dumps(dict(right, total=584)))  # a wrong number
    assert not score_json(invoice, json.dumps({k: v for k, v in right.items() if k != "buyer"}))  # invalid
    assert not score_json(invoice, json.dumps(right)[:-1])  # cut short: does not parse


@pytest.mark.parametrize("suite", ["tools", "agent"])
def test_tool_suites_refuse_a_mode_without_tool_calling_before_loading_models(tmp_path, suite):
    proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "bench", "--suite", suite, "--modes",
                           "ar,hf-assisted", "--out", str(tmp_path / "bench")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "hf-assisted has no tool calling" in proc.stderr


def test_agent_suite_tasks_come_from_the_integration_and_are_scored_by_the_final_number():
    """The agent suite's tasks are the LangChain tools' (registered by fly_integrations), needing no data folder."""
    from fly_integrations.bench_agents import TASKS
    from fly_runtime.bench.suites import SCORERS

    tasks = load_tasks("agent", None)
    assert [t.messages[0]["content"] for t in tasks] == [t.question for t in TASKS]
    assert {t.category for t in tasks} == {"convert", "discount", "lookup-chain"}
    assert [t.task_id for t in load_tasks("agent", None, limit=2, skip=1)] == ["agent-1", "agent-2"]
    assert SCORERS["agent"](tasks[0], {"right": True}) and not SCORERS["agent"](tasks[0], {"right": False})
