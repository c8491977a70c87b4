"""The examples run offline as a user would run them, and answer from their tools and documents."""

import contextlib
import io
import runpy
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    """The script as `python examples/NAME ARGS` runs it (its own top level under ``__main__``, argv as given), in
    this process so that it shares the engine the other tests loaded: a new interpreter would load the pair again."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [str(ROOT / "examples" / name), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (None, 0), f"{name} exited with {stop.code}"
    finally:
        sys.argv = argv
    return out.getvalue()


def test_langchain_rag_chain_answers_from_the_corpus():
    from examples.langchain_rag import build_chain

    answer = build_chain().invoke("How long does the Zephyr-9 rover's battery last on one charge?")
    assert "41" in answer
    answer = build_chain().invoke("Which keyword declares a function in the Quill language?")
    assert "rite" in answer


def test_langchain_agent_calls_the_calculator():
    from examples.langchain_agent import run_agent

    answer, messages = run_agent("What is 1234 * 5678? Use the calculator.")
    calls = [c for m in messages for c in getattr(m, "tool_calls", [])]
    assert calls and calls[0]["name"] == "calculator"
    assert "1234" in calls[0]["args"]["expression"] and "5678" in calls[0]["args"]["expression"]
    assert "7006652" in answer.replace(",", "").replace(" ", "")
    # every step reads only what the conversation added since the last: this model answers a tool result by
    # repeating the call, and the retry that steers it to answer keeps the prompt it read (tools and all). The
    # final reply's usage counts both of its generations, each reading fewer than 48 new tokens
    usage = messages[-1].usage_metadata
    assert usage["input_tokens"] - usage["input_token_details"]["cache_read"] < 2 * 48


def test_langchain_examples_run_as_scripts():
    assert "41" in run_example("langchain_rag.py")
    assert "7006652" in run_example("langchain_agent.py").replace(",", "")
