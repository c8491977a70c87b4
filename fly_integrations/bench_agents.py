"""Two-step tool tasks for agents, run as users build agents (LangChain's ``create_agent``, LlamaIndex's
``FunctionAgent`` and ``ReActAgent``): look a value up, then transform it, then answer. Each task has one right answer (a number in the final reply), so a run is scored
on three counts: did the agent finish (a reply without tool calls before the step limit), was the answer right,
and how many tool calls it took. The tools answer from fixed tables, offline."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from langchain_core.tools import tool

TEMPERATURES_C = {"oslo": 4.0, "cairo": 31.0, "lima": 18.5, "tokyo": 12.0, "denver": -3.0}
PRICES = {"kettle": 40.0, "lamp": 25.0, "chair": 120.0, "backpack": 64.0}
CAPITALS = {"france": "Paris", "kenya": "Nairobi", "peru": "Lima", "japan": "Tokyo"}
POPULATIONS = {"paris": 2_100_000, "nairobi": 4_400_000, "lima": 10_000_000, "tokyo": 14_000_000}


@tool
def get_temperature(city: str) -> str:
    """The current temperature of a city, in degrees Celsius."""
    value = TEMPERATURES_C.get(city.strip().lower())
    return f"{value} C" if value is not None else f"unknown city {city!r}"


@tool
def celsius_to_fahrenheit(celsius: float) -> str:
    """Convert a temperature from degrees Celsius to degrees Fahrenheit."""
    return f"{round(celsius * 9 / 5 + 32, 1)} F"


@tool
def get_price(item: str) -> str:
    """The list price of an item in the shop, in dollars."""
    value = PRICES.get(item.strip().lower())
    return f"${value}" if value is not None else f"unknown item {item!r}"


@tool
def apply_discount(price: float, percent: float) -> str:
    """The price after a discount of the given percent."""
    return f"${round(price * (1 - percent / 100), 2)}"


@tool
def get_capital(country: str) -> str:
    """The capital city of a country."""
    return CAPITALS.get(country.strip().lower(), f"unknown country {country!r}")


@tool
def get_population(city: str) -> str:
    """The population of a city."""
    value = POPULATIONS.get(city.strip().lower())
    return str(value) if value is not None else f"unknown city {city!r}"


TOOLS = [get_temperature, celsius_to_fahrenheit, get_price, apply_discount, get_capital, get_population]


@dataclass(frozen=True)
class AgentTask:
    question: str
    answer: str  # the number the final reply must state


TASKS = [
    AgentTask("What is the temperature in Oslo right now, in Fahrenheit?", "39.2"),
    AgentTask("How warm is it in Cairo in degrees Fahrenheit?", "87.8"),
    AgentTask("What does a kettle cost after a 25 percent discount?", "30"),
    AgentTask("What is the population of the capital of Kenya?", "4400000"),
    AgentTask("Give me the temperature in Lima in Fahrenheit.", "65.3"),
    AgentTask("How much is a chair with a 10 percent discount?", "108"),
    AgentTask("How many people live in the capital of Peru?", "10000000"),
    AgentTask("What is the temperature in Denver in Fahrenheit?", "26.6"),
    AgentTask("What does a backpack cost with 50 percent off?", "32"),
]


def _numbers(text: str) -> set[str]:
    """The numbers a reply states, without thousands separators or trailing zeros (4,400,000 -> 4400000)."""
    found = set()
    for raw in re.findall(r"-?\d[\d,]*(?:\.\d+)?", text):
        value = raw.replace(",", "")
        found.add(value.rstrip("0").rstrip(".") if "." in value else value)
    if re.search(r"\b(\d+(?:\.\d+)?)\s*million\b", text):
        for m in re.findall(r"\b(\d+(?:\.\d+)?)\s*million\b", text):
            found.add(str(int(float(m) * 1_000_000)))
    return found


def run_task(llm, task: AgentTask, recursion_limit: int = 12) -> dict:
    """One task through ``create_agent(llm, TOOLS)``: finished, right, tool calls, seconds, the final reply."""
    from langchain.agents import create_agent
    from langgraph.errors import GraphRecursionError

    agent = create_agent(llm, TOOLS)
    start = time.perf_counter()
    try:
        state = agent.invoke({"messages": [{"role": "user", "content": task.question}]},
                             {"recursion_limit": recursion_limit})
    except GraphRecursionError:
        return {"finished": False, "right": False, "tool_calls": None, "seconds": time.perf_counter() - start,
                "reply": None}
    messages = state["messages"]
    calls = sum(len(getattr(m, "tool_calls", None) or []) for m in messages)
    reply = messages[-1].content if isinstance(messages[-1].content, str) else str(messages[-1].content)
    return {"finished": True, "right": task.answer in _numbers(reply), "tool_calls": calls,
            "seconds": time.perf_counter() - start, "reply": reply}


def run_llama_index_task(llm, task: AgentTask, kind: str = "function", max_iterations: int = 12) -> dict:
    """One task through LlamaIndex's ``FunctionAgent`` (native tool calls) or ``ReActAgent`` (Thought / Action
    text) over the same tools: finished, right, tool calls, seconds, the final reply."""
    import asyncio

    from llama_index.core.agent.workflow import FunctionAgent, ReActAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool
    from workflows.errors import WorkflowRuntimeError

    tools = [FunctionTool.from_defaults(fn=t.func, name=t.name, description=t.description) for t in TOOLS]
    agent = (FunctionAgent if kind == "function" else ReActAgent)(tools=tools, llm=llm)

    async def run() -> tuple[str, int]:
        handler = agent.run(user_msg=task.question, max_iterations=max_iterations)
        calls = sum([isinstance(event, ToolCallResult) async for event in handler.stream_events()])
        return str((await handler).response.content), calls

    start = time.perf_counter()
    try:
        reply, calls = asyncio.run(run())
    except WorkflowRuntimeError:  # the step limit, as GraphRecursionError in LangGraph
        return {"finished": False, "right": False, "tool_calls": None, "seconds": time.perf_counter() - start,
                "reply": None}
    return {"finished": True, "right": task.answer in _numbers(reply), "tool_calls": calls,
            "seconds": time.perf_counter() - start, "reply": reply}
