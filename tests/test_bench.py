"""fly bench: suite loading and scoring (no model), and one short real run checking every output."""

import importlib.util
import json
import subprocess
import sys

import pytest

from fly_runtime.bench.runner import ModeSpec
from fly_runtime.bench.suites import default_data_dir, last_number, load_tasks, score_gsm8k, score_humaneval


@pytest.fixture(scope="module")
def data_dir():
    return default_data_dir()


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


@pytest.mark.parametrize("skip, message", [("-1", "--skip must be >= 0"), ("100000", "no prompts selected")])
def test_bench_rejects_a_bad_shard_before_loading_models(tmp_path, skip, message):
    proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "bench", "--suite", "gsm8k", "--skip", skip,
                           "--out", str(tmp_path / "bench")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr


# the llama.cpp peer is the `llama-cpp` extra, which .ci/run installs (it compiles llama.cpp once)
PEER = "llama-cpp" if importlib.util.find_spec("llama_cpp") else "ar:int4"


@pytest.mark.real_model
def test_bench_run_writes_results_summary_and_plot(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "bench", "--suite", "gsm8k", "--limit", "2",
                           "--max-new-tokens", "24", "--modes", f"ar,exact,fly,{PEER}", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["ar", "exact", "fly", PEER] * 2  # interleaved per prompt
    assert all(r["new_tokens"] > 0 for r in rows)
    assert all({"tokens_per_second", "mean_accepted", "fly_forgiven", "text", "correct"} <= set(r) for r in rows)
    assert all(r["cached_tokens"] == 0 for r in rows)  # each mode reads the prompt afresh, as the others did
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "gsm8k" and summary["n_prompts"] == 2 and summary["max_new_tokens"] == 24
    for mode in ("ar", "exact", "fly", PEER):
        assert set(summary["overall"][mode]) == {"tokens_per_second", "speedup_vs_ar", "speedup_vs_best_plain",
                                                 "mean_accepted", "accuracy"}
    assert summary["overall"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    # per prompt the best plain mode is the faster of the two plain ones: neither beats it
    plain = {m: [r["tokens_per_second"] for r in rows if r["mode"] == m] for m in ("ar", PEER)}
    best = [max(a, b) for a, b in zip(plain["ar"], plain[PEER])]
    for mode in ("ar", PEER):
        ratios = [t / b for t, b in zip(plain[mode], best)]
        assert summary["overall"][mode]["speedup_vs_best_plain"] == pytest.approx(sum(ratios) / len(ratios))
    assert set(summary["verify_cost"]) == {"step_ms", "verify_8_ms", "ratio"}
    assert "fly_retention" in summary and "math" in summary["categories"]
    assert (out / "speed.png").stat().st_size > 10_000
    assert "| **overall** |" in (out / "summary.md").read_text()
