"""A LlamaIndex FunctionAgent on FlyLLM that must call a tool to answer, fully offline.

    python examples/llamaindex_agent.py "What is 1234 * 5678?"
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool

from examples.corpus import load_documents
from fly_integrations import FlyLLM


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


def festival_price(person: str) -> str:
    """Entry price of the Bramblecote Orchard Festival for 'adult' or 'child'."""
    text = load_documents()["orchard_festival.md"]
    return "free for children under 12" if person.lower().startswith("child") else \
        text.split("Entry costs ")[1].split(" for adults")[0]


def build_agent() -> FunctionAgent:
    tools = [FunctionTool.from_defaults(fn=multiply), FunctionTool.from_defaults(fn=festival_price)]
    return FunctionAgent(tools=tools, llm=FlyLLM(max_tokens=160),
                         system_prompt="You are a precise assistant. Use the tools; answer in one sentence.")


async def ask(question: str) -> tuple[str, list[ToolCallResult]]:
    """The agent's answer and the tool calls it made on the way."""
    handler = build_agent().run(user_msg=question)
    calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    output: AgentOutput = await handler
    return str(output.response.content), calls


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What is 1234 * 5678?"
    answer, calls = asyncio.run(ask(question))
    for call in calls:
        print(f"tool {call.tool_name}({call.tool_kwargs}) -> {call.tool_output.content}")
    print(f"answer: {answer}")


if __name__ == "__main__":
    main()
