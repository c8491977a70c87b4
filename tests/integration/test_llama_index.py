"""FlyLLM in LlamaIndex query engines, chat engines and agents, on the real default pair offline."""

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool

from tests.integration.conftest import EXACT_PAIR
from fly_integrations import FlyChatModel, FlyLLM
from fly_runtime.errors import InvalidPromptError


PROMPT = "Write a Python function that returns the cube of a number."


@pytest.fixture(scope="module")
def index():
    from examples.llamaindex_query_engine import build_index

    return build_index()


def test_metadata_tells_the_truth():
    meta = FlyLLM().metadata
    assert meta.is_chat_model and meta.is_function_calling_model
    assert meta.context_window == 8192  # the setting's default, within the model's 32768 positions
    assert FlyLLM(context_window=None).metadata.context_window == 32768  # Qwen2.5-Coder-1.5B's maximum
    assert FlyLLM(context_window=100_000).metadata.context_window == 32768
    assert meta.model_name == "qwen2.5-coder-1.5b-instruct" and meta.num_output == 512


def test_exact_completion_equals_ar(fp32_alone):
    ar = FlyLLM(mode="ar", temperature=0, max_tokens=48, **EXACT_PAIR).complete(PROMPT)
    exact = FlyLLM(mode="exact", temperature=0, max_tokens=48, **EXACT_PAIR).complete(PROMPT)
    assert exact.text == ar.text
    assert exact.additional_kwargs["fly"]["mean_accepted"] > 1.0


def test_a_second_turn_reports_the_history_it_read_from_the_cache():
    llm = FlyLLM(mode="exact", temperature=0, max_tokens=32)
    turn = [ChatMessage(role=MessageRole.USER, content=PROMPT)]
    first = llm.chat(turn)
    second = llm.chat(turn + [first.message, ChatMessage(role=MessageRole.USER, content="Now the square instead.")])
    fly = second.additional_kwargs["fly"]
    assert first.additional_kwargs["fly"]["prompt_tokens"] < fly["cached_tokens"] < fly["prompt_tokens"]


def test_shares_the_engine_with_langchain():
    assert FlyLLM().engine() is FlyChatModel().engine()


def test_stream_complete_uses_the_same_formatting_as_complete():
    llm = FlyLLM(mode="exact", max_tokens=32)
    chunks = list(llm.stream_complete(PROMPT))
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].text == llm.complete(PROMPT).text


def test_stop_strings():
    llm = FlyLLM(mode="exact", max_tokens=48)
    full = llm.complete(PROMPT).text
    stop = full[10:20]
    assert llm.complete(PROMPT, stop=[stop]).text == full[: full.index(stop)]


async def test_async_paths_match_sync():
    llm = FlyLLM(mode="exact", max_tokens=24)
    sync = llm.complete(PROMPT).text
    assert (await llm.acomplete(PROMPT)).text == sync
    pieces = [r.delta async for r in await llm.astream_complete(PROMPT)]
    assert "".join(p or "" for p in pieces) == sync
    chat = await llm.achat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
    assert chat.message.content == sync


def test_query_engine_answers_from_the_retrieved_document(index):
    engine = index.as_query_engine(llm=FlyLLM(max_tokens=96), similarity_top_k=2)
    response = engine.query("How long does the Zephyr-9 rover's battery last on one charge?")
    assert "41" in str(response)
    assert any("zephyr" in n.node.metadata["source"] for n in response.source_nodes)


def test_streaming_query_engine(index):
    engine = index.as_query_engine(llm=FlyLLM(max_tokens=96), similarity_top_k=2, streaming=True)
    response = engine.query("Which keyword declares a function in the Quill language?")
    text = "".join(response.response_gen)
    assert "rite" in text


def test_condense_plus_context_chat_engine_two_turns(index):
    chat = index.as_chat_engine(chat_mode="condense_plus_context", llm=FlyLLM(max_tokens=96))
    first = chat.chat("Who is the head librarian of the Kelpmouth Harbor Library?")
    assert "Weir" in str(first)
    second = chat.chat("On which days is it closed?")
    assert "Sunday" in str(second) or "Monday" in str(second)


def test_predict_and_call_runs_the_tool():
    calls = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    out = FlyLLM(max_tokens=64).predict_and_call([FunctionTool.from_defaults(fn=add)], "What is 17 + 25?")
    assert calls == [(17, 25)] and "42" in str(out)


def test_function_agent_must_call_the_tool():
    import asyncio

    from examples.llamaindex_agent import ask

    answer, calls = asyncio.run(ask("What is 1234 * 5678?"))
    assert [c.tool_name for c in calls][:1] == ["multiply"]
    assert calls[0].tool_kwargs == {"a": 1234, "b": 5678}
    assert "7006652" in answer.replace(",", "").replace(" ", "")


def test_bad_input_then_good_request():
    llm = FlyLLM(max_tokens=8)
    with pytest.raises(InvalidPromptError, match="prompt is empty"):
        llm.complete("   ")
    with pytest.raises(InvalidPromptError, match="message list is empty"):
        llm.chat([])
    assert llm.complete("Say hi.").text


def test_examples_run_as_scripts():
    from tests.integration.test_examples import run_example

    opening = run_example("llamaindex_query_engine.py").lower()
    assert "9:00" in opening or "9 am" in opening or "9am" in opening
    assert "7006652" in run_example("llamaindex_agent.py").replace(",", "")
