"""`fly serve` as a real server process on a free port, with the clients users have: the OpenAI Python client,
LangChain's ChatOpenAI, LlamaIndex's OpenAILike, and fly's own classes given base_url."""

import asyncio
import json

import httpx
import psutil
import pytest

from fly_runtime import GenerationConfig
from fly_runtime.chat import encode_chat

from tests.integration.conftest import EXTERNAL, KEY, MODEL
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(fly_server):
    return fly_server


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"], api_key=KEY)


def test_the_openai_client_chats_streams_and_calls_a_tool(server):
    openai = client(server)
    answer = openai.chat.completions.create(model="fly", messages=[{"role": "user", "content": "Count to three."}],
                                            max_tokens=16)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    assert EXTERNAL or answer.model_extra["fly"]["mode"] == "exact"
    pieces, usage = [], None
    for chunk in openai.chat.completions.create(model="fly", messages=[{"role": "user", "content": "Count to three."}],
                                                max_tokens=16, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == answer.choices[0].message.content  # exact: the same answer streamed
    assert usage.completion_tokens == answer.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: read from the cache
    called = openai.chat.completions.create(
        model="fly", messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=40)
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    text = openai.completions.create(model="fly", prompt="def add(a, b):", max_tokens=8)
    assert text.choices[0].text and text.usage.prompt_tokens > 0
    assert [m.id for m in openai.models.list().data] == [MODEL]


@pytest.mark.skipif(bool(EXTERNAL), reason="compares with this machine's engine")
def test_the_server_answers_what_the_engine_answers_here(server, engine):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    local = engine.generate(encode_chat(engine.tokenizer, messages), GenerationConfig(mode="ar", max_new_tokens=40))
    served = client(server).chat.completions.create(model="fly", messages=messages, max_tokens=40,
                                                    extra_body={"mode": "ar"})
    assert served.choices[0].message.content == local.text
    assert served.usage.completion_tokens == len(local.token_ids)


def test_langchain_chat_openai_works_unchanged(server):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=server["url"], api_key=KEY, model="fly", max_tokens=16)
    answer = model.invoke("Count to three.")
    assert answer.content and answer.usage_metadata["output_tokens"] > 0
    assert "".join(c.content for c in model.stream("Count to three.")) == answer.content
    call = model.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?").tool_calls[0]
    assert call["name"] == "get_weather" and call["args"] == {"city": "Oslo"}


def test_llama_index_openai_like_works_unchanged(server):
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = OpenAILike(model="fly", api_base=server["url"], api_key=KEY, is_chat_model=True,
                     is_function_calling_model=True, max_tokens=16, context_window=8192)
    answer = llm.chat([ChatMessage(role="user", content="Count to three.")]).message.content
    assert "three" in answer.lower()
    # streamed: the deltas make the message (the answer itself may take another near-tie on the quantised
    # target: the second request reads its prompt from the cache, in a pass of another size)
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Count to three.")]))
    assert "".join(r.delta for r in streamed) == streamed[-1].message.content and "three" in \
        streamed[-1].message.content.lower()
    response = llm.chat_with_tools([FunctionTool.from_defaults(get_weather)], user_msg="Weather in Oslo?",
                                   tool_required=True)
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "get_weather" and selection.tool_kwargs == {"city": "Oslo"}


def test_fly_classes_with_base_url_talk_to_the_server(server):
    from fly_integrations import FlyChatModel, FlyLLM

    chat = FlyChatModel(base_url=server["url"], api_key=KEY, max_tokens=16)
    answer = chat.invoke("Count to three.", mode="ar")
    assert answer.content and answer.usage_metadata["output_tokens"] > 0
    assert "".join(c.content for c in chat.stream("Count to three.")) == answer.content  # exact == ar
    assert asyncio.run(chat.ainvoke("Count to three.")).content == answer.content
    call = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?").tool_calls[0]
    assert call["args"] == {"city": "Oslo"}
    llm = FlyLLM(base_url=server["url"], api_key=KEY, max_tokens=16)
    assert llm.complete("Count to three.").text == answer.content
    assert asyncio.run(llm.acomplete("Count to three.")).text == answer.content


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "JSON"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "unknown role 'robot'"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "at max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', 400, "logprobs"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40000}', 400, "maximum of 16384 at max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "mode": "fly", "window": 9}', 400,
     "window (9) must be smaller than k"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "turbo": true}', 400, "unknown request field"),
])
def test_a_bad_request_gets_its_status_and_an_openai_error_then_the_next_is_served(server, body, status, says):
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    response = httpx.post(server["url"] + "/chat/completions", content=body, headers=headers, timeout=120)
    assert response.status_code == status and says in response.json()["error"]["message"]
    assert set(response.json()["error"]) >= {"message", "type"}
    ok = httpx.post(server["url"] + "/chat/completions", headers=headers, timeout=300,
                    json={"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 4})
    assert ok.status_code == 200


def test_keys_and_body_size_are_checked(server):
    message = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(server["url"] + "/chat/completions", json=message).status_code == 401
    wrong = httpx.post(server["url"] + "/chat/completions", json=message, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    huge = httpx.post(server["url"] + "/chat/completions", content=b"x" * (10 * 1024 * 1024),
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=120)
    assert huge.status_code == 413


def test_a_full_queue_answers_429_with_retry_after_and_recovers(server):
    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(server["url"] + "/chat/completions", timeout=600, headers={
            "authorization": f"Bearer {KEY}"}, json={"messages": [{"role": "user", "content": "Say OK."}],
                                                   "max_tokens": 3})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as http:
            # up to 16 decoded together (max_batch, measured) + 16 waiting (--queue-depth): the rest refused
            return await asyncio.gather(*(one(http) for _ in range(48)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.status_code in (200, 429) for r in responses)
    assert asyncio.run(_single(server)).status_code == 200


async def _single(server) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(server["url"] + "/chat/completions", timeout=600, headers={
            "authorization": f"Bearer {KEY}"}, json={"messages": [{"role": "user", "content": "Say OK."}],
                                                   "max_tokens": 3})


def test_a_client_that_leaves_mid_stream_frees_the_engine(server):
    headers = {"authorization": f"Bearer {KEY}"}
    long = {"messages": [{"role": "user", "content": "Write a long essay about the history of computing."}],
            "max_tokens": 2000, "context_window": 4096, "stream": True}
    with httpx.stream("POST", server["url"] + "/chat/completions", json=long, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break  # the first text arrived: leave
    # 2000 tokens would take minutes here; freed, the engine serves the next request within its 60 s
    after = httpx.post(server["url"] + "/chat/completions", headers=headers, timeout=120, json={
        "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 3, "timeout": 60})
    assert after.status_code == 200, after.text


def test_concurrent_streaming_clients_each_get_their_own_answer(server):
    """16 clients at once, 32 requests in all (scripts/load_test.py runs the 200 of docs/benchmarks.md): every
    answer is complete and its own request's, none is lost, and the server's memory does not grow. Decoded
    together on the llama.cpp target, a near-tie may go another way than alone (docs/design.md, "Batched
    decoding"), so each question has one right answer to check instead."""
    sums = [(a, b) for a, b in zip(range(21, 37, 2), range(13, 80, 9))]
    prompts = {f"What is {a} + {b}? Answer with the number only.": str(a + b) for a, b in sums}
    assert all(prompts[p] in _stream_text(server, p) for p in prompts)  # alone, each is right
    rss = psutil.Process(server["pid"]).memory_info().rss if server["pid"] else None

    async def run() -> list[tuple[str, str]]:
        todo, questions = list(range(32)), list(prompts)
        results: list[tuple[str, str]] = []
        async with httpx.AsyncClient(timeout=600) as http:
            async def client_loop() -> None:  # one client: its requests one after another
                while todo:
                    prompt = questions[todo.pop() % len(questions)]
                    results.append((prompt, await _astream_text(http, server, prompt)))
            await asyncio.gather(*(client_loop() for _ in range(16)))
        return results

    results = asyncio.run(run())
    assert len(results) == 32 and all(prompts[prompt] in text for prompt, text in results), results
    if server["pid"]:
        assert psutil.Process(server["pid"]).memory_info().rss < rss * 1.05


def _stream_text(server, prompt: str) -> str:
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", server["url"] + "/chat/completions", json=body, headers=headers, timeout=600) as r:
        return _collect([line for line in r.iter_lines()])


async def _astream_text(http: httpx.AsyncClient, server, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "stream": True}
    async with http.stream("POST", server["url"] + "/chat/completions", json=body,
                           headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        return _collect([line async for line in r.aiter_lines()])


def _collect(lines: list[str]) -> str:
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
    text = ""
    for line in lines:
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


def test_openai_and_langchain_embedding_clients_get_the_bundled_models_vectors(server):
    """/v1/embeddings as a RAG app reaches it: OpenAI's client (which asks for base64) and LangChain's
    OpenAIEmbeddings pointed at the server; the vectors are all-MiniLM-L6-v2's own, unit length."""
    if EXTERNAL:
        pytest.skip("vLLM serves embeddings from a pooling model of its own")
    import numpy as np
    from langchain_openai import OpenAIEmbeddings
    from sentence_transformers import SentenceTransformer

    from fly_runtime.embeddings import embedding_model_path

    texts = ["A kitten sleeps on the sofa.", "A young cat naps on the couch.", "Bond yields rose after the report."]
    got = client(server).embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (3, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert got.usage.prompt_tokens > len(texts)
    direct = SentenceTransformer(embedding_model_path("all-MiniLM-L6-v2"), device="cpu").encode(
        texts, normalize_embeddings=True)
    assert np.allclose(vectors, direct, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3  # near meanings lie near
    langchain = OpenAIEmbeddings(model="all-MiniLM-L6-v2", base_url=server["url"], api_key=KEY,
                                 check_embedding_ctx_length=False)
    assert np.allclose(langchain.embed_documents(texts[:1])[0], vectors[0], atol=1e-5)
    # LangChain's default sends tiktoken ids, which name another model's tokenizer: refused, with the fix
    refused = httpx.post(server["url"] + "/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                         json={"input": [[791, 8415]], "model": "x"}, timeout=30)
    assert refused.status_code == 400 and "check_embedding_ctx_length=False" in refused.json()["error"]["message"]


def test_metrics_count_what_the_server_did_in_prometheus_text(server):
    if EXTERNAL:
        pytest.skip("vLLM's metrics have names of their own")
    headers = {"Authorization": f"Bearer {KEY}"}

    def samples() -> dict[str, float]:
        response = httpx.get(server["base"] + "/metrics", headers=headers, timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {key: float(value) for key, value in (line.rsplit(" ", 1) for line in response.text.splitlines()
                                                     if not line.startswith("#"))}

    before = samples()
    answer = client(server).chat.completions.create(
        model="fly", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8)
    after = samples()
    ok = 'fly_http_responses_total{path="/v1/chat/completions",status="200"}'
    assert after[ok] == before.get(ok, 0) + 1
    grew = {name: after[name] - before[name] for name in ("fly_generation_tokens_total", "fly_prompt_tokens_total")}
    assert grew == {"fly_generation_tokens_total": answer.usage.completion_tokens,
                    "fly_prompt_tokens_total": answer.usage.prompt_tokens}
    assert after["fly_target_forwards_total"] > before["fly_target_forwards_total"]
    assert 0 < after["fly_mean_accepted"] and after["fly_requests_running"] == 0
    assert httpx.get(server["base"] + "/metrics", timeout=30).status_code == 401  # the key guards it too
