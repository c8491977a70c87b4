"""fly bench: one short real run, checking every output."""

import importlib.util
import json

import pytest


# the llama.cpp peer is the `llama-cpp` extra, which .ci/run installs (it compiles llama.cpp once)
PEER = "llama-cpp" if importlib.util.find_spec("llama_cpp") else "ar:int4"


def bench(out, *args: str) -> list[dict]:
    """`fly bench ARGS --out OUT` through the command's own entry point (in this process: its imports and the
    tokenizer are loaded once for the module, not once a run); the rows of its results.jsonl."""
    from fly_runtime.cli import main

    assert main(["--debug", "bench", *args, "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_bench_run_writes_results_summary_and_plot(tmp_path):
    out = tmp_path / "bench"
    rows = bench(out, "--suite", "gsm8k", "--limit", "2", "--max-new-tokens", "24", "--modes", f"ar,exact,fly,{PEER}")
    assert [r["mode"] for r in rows] == ["ar", "exact", "fly", PEER] * 2  # interleaved per prompt
    assert all(r["new_tokens"] > 0 for r in rows)
    assert all({"tokens_per_second", "mean_accepted", "fly_forgiven", "text", "correct"} <= set(r) for r in rows)
    assert all(r["cached_tokens"] == 0 for r in rows)  # each mode reads the prompt afresh, as the others did
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "gsm8k" and summary["n_prompts"] == 2 and summary["max_new_tokens"] == 24
    for mode in ("ar", "exact", "fly", PEER):
        assert set(summary["overall"][mode]) == {"tokens_per_second", "seconds", "speedup_vs_ar",
                                                 "speedup_vs_best_plain", "wall_speedup_vs_best_plain",
                                                 "mean_accepted", "accuracy"}
        assert summary["overall"][mode]["seconds"] == pytest.approx(sum(r["seconds"] for r in rows if r["mode"] == mode))
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


def test_bench_tools_suite_runs_bfcl_turns_through_bind_tools(tmp_path):
    """BFCL turns through FlyChatModel.bind_tools (and llama.cpp on the same rendered prompt), scored by their calls."""
    out = tmp_path / "tools"
    rows = bench(out, "--suite", "tools", "--limit", "1", "--max-new-tokens", "64", "--modes", f"fly,{PEER}")
    assert [r["mode"] for r in rows] == ["fly", PEER]  # (interleaving per prompt and `ar`: the gsm8k run above)
    assert all(r["task_id"].startswith("tools/simple_python_") for r in rows)
    for row in rows:
        assert row["prompt_tokens"] > 100  # the tool's schema is rendered into the prompt
        assert isinstance(row["tool_calls"], list) and isinstance(row["correct"], bool)
    # the first turn (a triangle's area from its base and height) is one the model answers with the right call
    assert all(r["task_id"] == "tools/simple_python_0" and r["correct"] for r in rows), [r["tool_calls"] for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "tools" and summary["overall"]["fly"]["wall_speedup_vs_best_plain"] > 0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs the llama-cpp extra")
def test_llama_cpp_peer_reads_the_whole_prompt_every_run(engine):
    """llama-cpp-python reuses the previous prompt's cache by itself; the bench's modes all start empty."""
    from fly_runtime.bench.runner import LlamaCpp
    from fly_runtime.loader import DEFAULT_TARGET
    from fly_runtime.sources import resolve_model

    peer = LlamaCpp(resolve_model(DEFAULT_TARGET).gguf, context=512)
    fed: list[int] = []
    evaluate = peer.llm.eval
    peer.llm.eval = lambda tokens: (fed.append(len(tokens)), evaluate(tokens))[1]
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    for _ in range(2):
        fed.clear()
        peer.generate(prompt, 2, set(engine.eos_token_ids), engine.tokenizer)
        assert fed[0] == len(prompt)


def test_bench_agent_suite_times_whole_create_agent_conversations(tmp_path):
    """Each task a whole create_agent conversation per mode: its model calls summed, the prefix each call shares
    with the last one reused (fly's prompt cache; llama-cpp-python's own), scored by the final reply's number."""
    out = tmp_path / "agent"
    # four steps: two model calls and their tools at most (this model re-calls tools until the limit)
    rows = bench(out, "--suite", "agent", "--limit", "1", "--max-new-tokens", "96", "--agent-steps", "4",
                 "--modes", f"fly,{PEER}")
    assert [r["mode"] for r in rows] == ["fly", PEER]
    for row in rows:
        assert row["model_calls"] == 2 and row["new_tokens"] > 0  # a tool call, one more turn; the step limit
        assert 0 < row["cached_tokens"] < row["prompt_tokens"]  # later turns read only past the conversation so far
        assert isinstance(row["correct"], bool) and row["correct"] == (row["finished"] and "39.2" in row["text"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "agent" and summary["overall"]["fly"]["wall_speedup_vs_best_plain"] > 0
