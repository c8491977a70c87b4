"""Many calls at once: the bridge from a blocking generation to asyncio, and LangChain's batch (no model)."""

import asyncio
import threading

from fly_integrations.streaming import aiter_in_thread


def test_many_generations_run_at_once_beyond_the_loops_default_executor():
    # the default executor holds min(32, CPUs + 4) workers; a batched engine serves up to 16 requests at once,
    # so every generation must get its thread, or the ones past the executor's size would wait for the others
    together = 12
    barrier = threading.Barrier(together, timeout=20)

    def generation(i: int):
        barrier.wait()  # returns only once all the generations are running at the same time
        yield f"piece {i}"

    async def consume(i: int) -> list[str]:
        return [piece async for piece in aiter_in_thread(lambda: generation(i))]

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(consume(i) for i in range(together)))

    assert asyncio.run(main()) == [[f"piece {i}"] for i in range(together)]


def test_a_failure_in_the_generation_reaches_the_consumer():
    def failing():
        yield "first"
        raise ValueError("the model failed")

    async def main() -> list[str]:
        seen = []
        try:
            async for piece in aiter_in_thread(failing):
                seen.append(piece)
        except ValueError as exc:
            seen.append(str(exc))
        return seen

    assert asyncio.run(main()) == ["first", "the model failed"]


def test_langchain_batch_runs_every_input_at_once(monkeypatch):
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    from fly_integrations import FlyChatModel

    together = 12  # more than LangChain's default pool on a small machine (CPUs + 4)
    barrier = threading.Barrier(together, timeout=20)

    def generate(self, messages, stop=None, run_manager=None, **kwargs):
        barrier.wait()  # returns only once all the calls are running at the same time
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=messages[-1].content.upper()))])

    monkeypatch.setattr(FlyChatModel, "_generate", generate)
    replies = FlyChatModel().batch([f"question {i}" for i in range(together)])
    assert [r.content for r in replies] == [f"QUESTION {i}" for i in range(together)]
    # an explicit max_concurrency still rules
    barrier = threading.Barrier(1)
    assert len(FlyChatModel().batch(["a", "b"], config={"max_concurrency": 1})) == 2
