"""`fly serve` without a model: OpenAI requests translated to fly's, and the engine's queue."""

import asyncio
import os
import platform
import subprocess
import sys

import pytest
from fastapi.openapi.utils import get_openapi
from pydantic import ValidationError

from fly_integrations.messages import response_schema
from fly_integrations.server import protocol, schema
from fly_integrations.server.app import router
from fly_integrations.server.admission import Admission, QueueFull, QueueTimeout
from fly_runtime.errors import InvalidPromptError


def test_openai_messages_become_flys_chat_dicts():
    messages = protocol.chat_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    with pytest.raises(InvalidPromptError, match="image_url"):
        protocol.chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    # arguments that are no JSON object stay the text the model wrote (OpenAI's API takes any text there)
    kept = protocol.chat_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    assert kept[0]["tool_calls"][0]["function"]["arguments"] == "{"
    # only the assistant calls tools: another role's tool_calls are not read
    assert "tool_calls" not in protocol.chat_messages([{"role": "user", "content": "hi", "tool_calls": [[True]]}])[0]


def test_settings_fields_and_formats_translate():
    request = protocol.ChatRequest(messages=[], max_completion_tokens=7, temperature=0.5, mode="exact", k=4,
                                   user="someone")
    assert protocol.overrides(request) == {"max_tokens": 7, "temperature": 0.5, "mode": "exact", "k": 4}
    with pytest.raises(InvalidPromptError, match="unknown request field"):
        protocol.overrides(protocol.ChatRequest(messages=[], warp=9))
    with pytest.raises(ValidationError, match="n"):
        protocol.ChatRequest(messages=[], n=2)
    with pytest.raises(InvalidPromptError, match="logprobs"):
        protocol.overrides(protocol.ChatRequest(messages=[], logprobs=True))
    assert protocol.overrides(protocol.ChatRequest(messages=[], window=3.0))["window"] == 3  # JSON's integer
    assert response_schema({"type": "json_object"}) == {}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}) \
        == {"type": "object"}
    assert response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_schema", "json_schema": {"name": "x"}}) == {}  # no schema: any object
    with pytest.raises(InvalidPromptError, match="json_object or json_schema"):
        response_schema({"type": "yaml"})


def test_sampling_fields_users_bring_are_honoured_under_their_names_and_llama_servers():
    """OpenAI's penalties, min_p, and llama-server's / Ollama's names for the same settings become fly's settings;
    cache_prompt is taken (fly reuses a cached prefix anyway)."""
    request = protocol.ChatRequest(messages=[], frequency_penalty=0.5, presence_penalty=0.25, min_p=0.05,
                                   repeat_penalty=1.1, n_predict=9, cache_prompt=True)
    assert protocol.overrides(request) == {"frequency_penalty": 0.5, "presence_penalty": 0.25, "min_p": 0.05,
                                           "repetition_penalty": 1.1, "max_tokens": 9}
    both = protocol.CompletionRequest(prompt="x", max_tokens=5, num_predict=9)
    assert protocol.overrides(both)["max_tokens"] == 5  # OpenAI's own field wins
    assert protocol.overrides(protocol.CompletionRequest(prompt="x", num_predict=9))["max_tokens"] == 9
    assert protocol.overrides(protocol.CompletionRequest(prompt="x", n_predict=9.0))["max_tokens"] == 9  # JSON's 9.0


def test_the_queue_serves_in_arrival_order_refuses_beyond_its_depth_and_times_out():
    async def scenario() -> tuple[list[int], bool, bool]:
        admission, order = Admission(depth=2), []

        async def request(i: int, hold: float) -> None:
            async with admission.turn(None):
                order.append(i)
                await asyncio.sleep(hold)

        first = asyncio.create_task(request(0, 0.2))
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(request(i, 0.01)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        try:
            async with admission.turn(None):
                pass
            refused = False
        except QueueFull as exc:
            refused = exc.retry_after >= 1
        await asyncio.gather(first, *waiting)
        blocker = asyncio.create_task(request(3, 0.3))
        await asyncio.sleep(0.01)
        try:
            async with admission.turn(0.05):
                timed_out = False
        except QueueTimeout:
            timed_out = True
        await blocker
        return order, refused, timed_out

    order, refused, timed_out = asyncio.run(scenario())
    assert order == [0, 1, 2, 3] and refused and timed_out


def test_the_queue_lets_as_many_requests_in_as_the_engine_decodes_together():
    async def scenario() -> tuple[int, list[int]]:
        admission, inside, most, order = Admission(depth=8, turns=2), [0], [0], []

        async def request(i: int) -> None:
            async with admission.turn(None):
                order.append(i)
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                await asyncio.sleep(0.05)
                inside[0] -= 1

        await asyncio.gather(*(request(i) for i in range(5)))
        return most[0], order

    most, order = asyncio.run(scenario())
    assert most == 2 and order == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def document():
    """The served document's routes and request rules, as create_app completes them (no model needed)."""
    built = get_openapi(title="fly", version="1", routes=router.routes)
    schema.limit_max_tokens(built, 8192)
    return built


def test_the_document_states_every_status_the_server_answers(document):
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413", "429", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["429"]["headers"] and "Retry-After" in responses["503"]["headers"]
    chat = document["components"]["schemas"]["ChatCompletion"]
    assert {"id", "choices", "usage", "fly"} <= set(chat["properties"])


def test_requests_are_checked_as_the_document_states_them(document):
    check = schema.BodyCheck(document).check
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 3.0, "mode": "fly", "window": 2}
    check("ChatRequest", ok)  # 3.0 is an integer in JSON
    check("ChatRequest", {**ok, "tools": None, "tool_choice": None, "response_format": None, "stop": None,
                          "stream_options": None, "k": None})  # optional fields sent as null, as clients do
    for bad, says in [({"window": False}, "window"), ({"turbo": 1}, "turbo"), ({"max_tokens": 5000}, "max_tokens"),
                      ({"messages": [{"role": "user", "content": "  "}]}, "messages"),
                      ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0"),
                      ({"logprobs": True}, "logprobs"), ({"context_window": 1}, "context_window")]:
        with pytest.raises(InvalidPromptError, match=says):
            check("ChatRequest", {**ok, **bad})
    # an assistant turn that only calls a tool says something; tool arguments may be any text
    check("ChatRequest", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]})
    check("CompletionRequest", {"prompt": "Once upon", "max_tokens": 4})
    with pytest.raises(InvalidPromptError, match="prompt"):
        check("CompletionRequest", {"prompt": ""})


def test_embedding_requests_take_texts_and_refuse_what_they_cannot_honour_by_name():
    request = protocol.EmbeddingRequest(input=["a cat", "a dog"], model="text-embedding-3-small", dimensions=384)
    assert protocol.embedding_texts(request, 384) == ["a cat", "a dog"]
    assert protocol.embedding_texts(protocol.EmbeddingRequest(input="one"), 384) == ["one"]
    with pytest.raises(InvalidPromptError, match="check_embedding_ctx_length=False"):  # another model's token ids
        protocol.embedding_texts(protocol.EmbeddingRequest(input=[[1, 2, 3]]), 384)
    with pytest.raises(InvalidPromptError, match="input 1 is an empty string"):
        protocol.embedding_texts(protocol.EmbeddingRequest(input=["x", ""]), 384)
    with pytest.raises(InvalidPromptError, match="writes 384"):
        protocol.embedding_texts(protocol.EmbeddingRequest(input="x", dimensions=256), 384)
    with pytest.raises(InvalidPromptError, match="at most 2048"):
        protocol.embedding_texts(protocol.EmbeddingRequest(input=["x"] * 2049), 384)
    with pytest.raises(ValidationError, match="truncate"):  # an unknown field is refused by its name
        protocol.EmbeddingRequest(input="x", truncate=True)


def test_embeddings_are_returned_as_floats_or_as_the_base64_the_openai_client_decodes():
    import base64

    import numpy as np

    vectors = np.array([[0.5, -0.25, 1e-8], [1.0, 0.0, -1.0]], dtype=np.float32)
    floats = protocol.embedding_list("m", vectors, 7, None)
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and floats["model"] == "m"
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["data"][0]["embedding"][:2] == [0.5, -0.25]
    packed = protocol.embedding_list("m", vectors, 7, "base64")["data"][1]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="float32"), vectors[1])
    schema.EmbeddingList(**floats)  # the shape the document states


def test_metrics_add_up_generations_and_responses_in_prometheus_text():
    from types import SimpleNamespace

    from fly_integrations.server.metrics import Metrics
    from fly_runtime.engine import GenerationStats

    metrics = Metrics()
    for new, forwards in ((30, 10), (10, 10)):
        stats = GenerationStats(prompt_tokens=100, cached_tokens=40, new_tokens=new, target_forwards=forwards,
                                drafted_tokens=25, native_accepted=20, fly_forgiven=2, seconds=1.5)
        metrics.generation(SimpleNamespace(result=SimpleNamespace(finish_reason="stop", stats=stats)))  # a Reply
    metrics.response("/v1/chat/completions", 200)
    metrics.response("/v1/chat/completions", 200)
    metrics.response("other", 404)
    metrics.embedding(3, 17)
    text = metrics.render(waiting=2, running=1, slots=4)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['fly_http_responses_total{path="/v1/chat/completions",status="200"}'] == "2"
    assert samples['fly_http_responses_total{path="other",status="404"}'] == "1"
    assert samples['fly_generations_total{finish_reason="stop"}'] == "2"
    assert samples["fly_prompt_tokens_total"] == "200" and samples["fly_cached_prompt_tokens_total"] == "80"
    assert samples["fly_generation_tokens_total"] == "40" and samples["fly_forgiven_draft_tokens_total"] == "4"
    assert samples["fly_mean_accepted"] == "2" and samples["fly_generation_seconds_total"] == "3"
    assert samples["fly_requests_waiting"] == "2" and samples["fly_requests_running"] == "1"
    assert samples["fly_embedding_inputs_total"] == "3" and samples["fly_embedding_tokens_total"] == "17"
    # every sample is announced by its HELP and TYPE lines, as Prometheus' text format asks
    names = {key.split("{")[0] for key in samples}
    assert all(f"# TYPE {name} " in text for name in names)


def test_the_queue_reports_requests_running_and_waiting():
    async def scenario():
        admission = Admission(depth=4, turns=1)
        async with admission.turn(None):
            waiter = asyncio.create_task(_hold(admission))
            await asyncio.sleep(0.01)
            seen = (admission.running, admission.waiting)
        await waiter
        return seen, (admission.running, admission.waiting)

    assert asyncio.run(scenario()) == ((1, 1), (0, 0))


async def _hold(admission: Admission) -> None:
    async with admission.turn(None):
        pass


ARENAS = r"""
import ctypes, ctypes.util, os, sys, tempfile, threading
from fly_integrations.server.cli import one_malloc_arena
set_here = one_malloc_arena() if sys.argv[1] == "1" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def work():
    for _ in range(100):
        libc.free(libc.malloc(200_000))
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.TemporaryFile("w+") as out:
    libc.fdopen.restype = ctypes.c_void_p
    stream = libc.fdopen(os.dup(out.fileno()), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    out.seek(0)
    print(set_here, out.read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_servers_threads_share_one_malloc_arena():
    """`fly serve` keeps every thread's allocations in glibc's main arena (freed memory stays where the next request
    reuses it: 5.13 -> 4.97 GB peak for a served default); a MALLOC_ARENA_MAX the user set is left alone."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def heaps(flag: str, **extra) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", ARENAS, flag], capture_output=True, text=True, check=True,
                             env={**env, **extra}).stdout.split()
        return out[0], int(out[1])

    assert heaps("0")[1] > 1  # threads get arenas of their own by default
    assert heaps("1") == ("True", 1)
    assert heaps("1", MALLOC_ARENA_MAX="3")[0] == "False"
