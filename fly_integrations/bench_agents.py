"""Two-step tool tasks for agents, run as users build agents (LangChain's ``create_agent``, LlamaIndex's
``FunctionAgent`` and ``ReActAgent``): look a value up, then transform it, then answer. Each task has one right answer (a number in the final reply), so a run is scored
on three counts: did the agent finish (a reply without tool calls before the step limit), was the answer right,
and how many tool calls it took. The tools answer from fixed tables, offline."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tools import tool
from pydantic import PrivateAttr

from fly_integrations.bench_tools import ToolTurns
from fly_integrations.langchain import FlyChatModel
from fly_runtime import GenerationConfig
from fly_runtime.backends.openmp_thread import on_openmp_thread
from fly_runtime.bench.runner import LLAMA_CPP, ModeSpec
from fly_runtime.bench.suites import Task
from fly_runtime.engine import GenerationResult, GenerationStats, GenerationStream
from fly_runtime.errors import FlyError
from fly_runtime.loader import get_engine
from fly_runtime.text import StopTextStream

TEMPERATURES_C = {"oslo": 4.0, "cairo": 31.0, "lima": 18.5, "tokyo": 12.0, "denver": -3.0}
PRICES = {"kettle": 40.0, "lamp": 25.0, "chair": 120.0, "backpack": 64.0}
CAPITALS = {"france": "Paris", "kenya": "Nairobi", "peru": "Lima", "japan": "Tokyo"}
POPULATIONS = {"paris": 2_100_000, "nairobi": 4_400_000, "lima": 10_000_000, "tokyo": 14_000_000}
# a conversation's step limit (LangGraph's recursion_limit: a model call and a tool run are a step each); `fly bench
# --agent-steps` sets it for the agent suite
STEPS = 12


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


def run_task(llm, task: AgentTask, recursion_limit: int = STEPS, callbacks: list | None = None) -> dict:
    """One task through ``create_agent(llm, TOOLS)``: finished, right, tool calls, seconds, the final reply
    (``callbacks``: LangChain callback handlers for the run, which reach every model call)."""
    from langchain.agents import create_agent
    from langgraph.errors import GraphRecursionError

    agent = create_agent(llm, TOOLS)
    start = time.perf_counter()
    try:
        state = agent.invoke({"messages": [{"role": "user", "content": task.question}]},
                             {"recursion_limit": recursion_limit, "callbacks": callbacks or []})
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


# ------------------------------------------------------------------------- `fly bench --suite agent`
class _TurnStats(BaseCallbackHandler):
    """Sums what each model call of an agent run reports: tokens written and read, cached prompt tokens, target
    passes (where the model reports them)."""

    def __init__(self) -> None:
        self.calls, self.new_tokens, self.prompt_tokens, self.cached_tokens, self.forwards = 0, 0, 0, 0, 0

    def on_llm_end(self, response, **kwargs) -> None:
        message = response.generations[0][0].message
        usage, meta = message.usage_metadata or {}, message.response_metadata or {}
        self.calls += 1
        self.new_tokens += usage.get("output_tokens", 0)
        self.prompt_tokens += usage.get("input_tokens", 0)
        self.cached_tokens += meta.get("cached_tokens") or 0
        self.forwards += meta.get("target_forwards") or 0


class _LlamaCppEngine:
    """llama-cpp-python decoding, greedily, the prompt FlyChatModel renders, behind the engine's ``stream``: the
    peer an agent's user would run on the same GGUF. It keeps llama-cpp-python's own prefix reuse (each call reads
    only past what it shares with the previous one), as an agent resending its history gets from it."""

    def __init__(self, llm, tokenizer, eos: set[int]) -> None:
        self.llm, self.tokenizer, self.eos_token_ids = llm, tokenizer, frozenset(eos)

    def stream(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationStream:
        if config.json_schema is not None or config.grammar is not None:
            raise FlyError("the llama-cpp peer of the agent suite decodes without grammars (tool_choice='auto')")
        return GenerationStream(lambda stream: self._run(stream, list(prompt_ids), config))

    def _run(self, stream: GenerationStream, ids: list[int], config: GenerationConfig):
        held = self.llm.n_tokens
        cached = next((i for i, (a, b) in enumerate(zip(self.llm.input_ids[:held].tolist(), ids)) if a != b),
                      min(held, len(ids)))
        text = StopTextStream(self.tokenizer, config.stop)
        pieces: list[str] = []

        def decode() -> tuple[int, str]:
            new = 0
            for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
                if token in self.eos_token_ids:
                    return new, "stop"
                new += 1
                if piece := text.push([token]):
                    pieces.append(piece)
                if text.stopped:
                    return new, "stop"
                if new >= config.max_new_tokens:
                    break
            return new, "length"

        start = time.perf_counter()
        # the whole reply on the process's OpenMP thread (on_openmp_thread: one thread drives llama.cpp in a process),
        # its pieces passed on after: the suite times whole conversations, not first tokens
        new, finish = on_openmp_thread(decode)
        yield from pieces
        if tail := text.finish():
            yield tail
        stats = GenerationStats(prompt_tokens=len(ids), cached_tokens=min(cached, len(ids) - 1),
                                new_tokens=len(text.token_ids), target_forwards=new + 1, plain_steps=new,
                                seconds=time.perf_counter() - start)
        stream.result = GenerationResult(text.released, list(text.token_ids), finish, stats)


class LlamaCppChatModel(FlyChatModel):
    """FlyChatModel's prompts, tool parsing and reply rules, decoded by llama-cpp-python (``_LlamaCppEngine``):
    what differs from fly in the agent suite is the decoding alone."""

    _peer: _LlamaCppEngine | None = PrivateAttr(default=None)

    def engine(self, target: str | None = None):
        assert self._peer is not None
        return self._peer


class AgentTurns(ToolTurns):
    """``fly bench --suite agent``: each task of ``TASKS`` through ``create_agent`` in each mode, the whole
    conversation timed (every model call, the tools' instants between them). Each task starts from empty caches;
    within it, each decoder reuses the prefix its last call left (fly's engine its prompt cache, llama.cpp its
    own), as an agent's turns resend the conversation. Registered as the ``fly.bench`` entry point ``agent``; the
    fly modes' models are the tools suite's."""

    @staticmethod
    def tasks() -> list[Task]:
        kinds = {"temperature": "convert", "warm": "convert", "cost": "discount", "much": "discount",
                 "people": "lookup-chain", "population": "lookup-chain"}
        out = []
        for i, task in enumerate(TASKS):
            category = next((v for k, v in kinds.items() if k in task.question.lower()), "agent")
            out.append(Task(f"agent-{i}", category, [{"role": "user", "content": task.question}],
                            {"answer": task.answer}))
        return out

    def __init__(self, *args, steps: int = STEPS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = steps  # each conversation's step limit (LangGraph's recursion_limit)

    # the warm-up's step limit: one model call, its tool, and a second call that reads the tool's result (a whole
    # conversation would double a short run's time for nothing more loaded)
    WARM_UP_STEPS = 4

    def warm_up(self, spec: ModeSpec, task: Task) -> None:
        self(spec, task, recursion_limit=min(self.WARM_UP_STEPS, self.steps))

    def __call__(self, spec: ModeSpec, task: Task, recursion_limit: int | None = None) -> dict:
        model = self._model(spec)
        if spec.mode == LLAMA_CPP:
            self.llama.llm.reset()
        else:
            get_engine(model.model_settings()).clear_cache()
        stats = _TurnStats()
        agent_task = AgentTask(task.messages[0]["content"], task.reference["answer"])
        out = run_task(model, agent_task, recursion_limit or self.steps, callbacks=[stats])
        return {"new_tokens": stats.new_tokens, "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens, "target_forwards": stats.forwards or None,
                "seconds": out["seconds"], "model_calls": stats.calls, "finished": out["finished"],
                "right": out["right"], "tool_calls": out["tool_calls"], "text": out["reply"] or ""}

    def _model(self, spec: ModeSpec) -> FlyChatModel:
        if spec.mode in ("ar", "exact", "fly"):
            return super()._model(spec)
        if spec.mode != LLAMA_CPP:
            raise FlyError(f"the agent suite runs ar, exact, fly and llama-cpp, not {spec.mode}")
        if spec.label not in self.models:
            if self.llama is None:
                raise FlyError("the llama-cpp mode needs the target's GGUF")
            peer = LlamaCppChatModel(target=self.settings.target, draft=None, mode="ar",
                                     max_tokens=self.base.max_new_tokens)
            peer._peer = _LlamaCppEngine(self.llama.llm, self.engine.tokenizer, set(self.engine.eos_token_ids))
            self.models[spec.label] = peer
        return self.models[spec.label]
