"""Checks on tools and tool_choice shared by the adapters (OpenAI-style tool dicts)."""

from __future__ import annotations

from typing import Any

from fly_runtime.errors import InvalidPromptError

_JSON_TYPES = {"object", "string", "number", "integer", "boolean", "array", "null"}


def validate_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """Reject a tool whose parameters are not a JSON-schema object, naming the tool and the fix."""
    function = tool.get("function", {})
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidPromptError(f"a tool has no name: {tool!r}")
    params = function.get("parameters", {"type": "object", "properties": {}})
    problem = _schema_problem(params)
    if problem:
        raise InvalidPromptError(
            f"tool {name!r} has an invalid JSON schema for its parameters ({problem}); "
            'describe them as {"type": "object", "properties": {...}}'
        )
    return tool


def _schema_problem(schema: Any, path: str = "parameters") -> str | None:
    if not isinstance(schema, dict):
        return f"{path} must be an object, got {type(schema).__name__}"
    if path == "parameters" and schema.get("type", "object") != "object":
        return f"{path}.type must be 'object', got {schema.get('type')!r}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _JSON_TYPES:
            return f"{path}.type {k!r} is not a JSON-schema type"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        return f"{path}.properties must be an object"
    for key, sub in properties.items():
        problem = _schema_problem(sub, f"{path}.properties.{key}")
        if problem:
            return problem
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{path}.required must be a list of property names"
    return None


def normalize_tool_choice(choice: Any, names: list[str]) -> str | None:
    """'auto' / 'none' / 'any' / a tool name from the many spellings frameworks use."""
    if choice is None or choice is False:
        return None
    if choice is True or choice in ("any", "required"):
        return "any"
    if choice in ("auto", "none"):
        return choice
    if isinstance(choice, dict):
        choice = choice.get("function", {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise InvalidPromptError(
        f"tool_choice {choice!r} is not 'auto', 'none', 'any' or a bound tool ({', '.join(names) or 'none bound'})"
    )
