"""A tool-calling agent loop with LangChain and FlyChatModel, fully offline.

    python examples/langchain_agent.py "What is 1234 * 5678?"

The model decides which tool to call; the loop runs the tools and feeds their results back until the
model answers in text.
"""

from __future__ import annotations

import ast
import operator
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool

from examples.corpus import load_documents
from fly_integrations import FlyChatModel

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '1234 * 5678' or '(3 + 4) / 2'."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value) if float(value).is_integer() else value)


@tool
def search_notes(query: str) -> str:
    """Search the team's notes (rovers, libraries, programming languages, festivals) for a keyword."""
    words = [w.lower() for w in query.split() if len(w) > 2]
    hits = [text for text in load_documents().values() if any(w in text.lower() for w in words)]
    return "\n\n".join(hits[:2]) if hits else "no notes found"


TOOLS = {t.name: t for t in (calculator, search_notes)}
SYSTEM = "You are a precise assistant. Use a tool when it helps; after tool results, answer in one sentence."


def run_agent(question: str, llm: BaseChatModel | None = None, max_steps: int = 4) -> tuple[str, list[BaseMessage]]:
    """Answer ``question``; returns the answer and the whole conversation (tool calls included)."""
    model = (llm or FlyChatModel(max_tokens=160)).bind_tools(list(TOOLS.values()))
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    for _ in range(max_steps):
        reply = model.invoke(messages)
        messages.append(reply)
        if not isinstance(reply, AIMessage) or not reply.tool_calls:
            return str(reply.content), messages
        for call in reply.tool_calls:
            messages.append(TOOLS[call["name"]].invoke(call))
    return str(messages[-1].content), messages


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What is 1234 * 5678? Use the calculator."
    answer, messages = run_agent(question)
    for m in messages[1:]:
        calls = getattr(m, "tool_calls", None)
        print(f"{m.type}: {m.content}" + (f"  tool calls: {calls}" if calls else ""))
    print(f"\nanswer: {answer}")


if __name__ == "__main__":
    main()
