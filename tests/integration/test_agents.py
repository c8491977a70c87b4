"""Agents as users build them: LangChain's create_agent over FlyChatModel runs two-step tool tasks (look a value up,
transform it) to a final answer. The tasks (fly_integrations/bench_agents.py) were written for this; how often
the built-in 1.5B pair finishes them, greedy and sampled, is measured by scripts/agent_eval.py (docs/benchmarks.md):
here, two tasks it answers greedily, so that the loop's plumbing (calls, results fed back, an answer) is tested on
the real model."""

from fly_integrations import FlyChatModel
from fly_integrations.bench_agents import TASKS, run_task


def test_create_agent_runs_two_step_tool_tasks_to_an_answer():
    llm = FlyChatModel(max_tokens=256, temperature=0)
    rows = [run_task(llm, TASKS[i]) for i in (1, 3)]
    assert all(r["finished"] for r in rows), rows
    assert all(r["tool_calls"] >= 2 for r in rows), rows  # looked the value up, then transformed it
    assert any(r["right"] for r in rows), rows
