"""fly bench: one short real run, checking every output."""

import importlib.util
import json
import subprocess
import sys

import pytest


# the llama.cpp peer is the `llama-cpp` extra, which .ci/run installs (it compiles llama.cpp once)
PEER = "llama-cpp" if importlib.util.find_spec("llama_cpp") else "ar:int4"


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
