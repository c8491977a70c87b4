"""Checks on tools and tool_choice shared by the adapters (OpenAI-style tool dicts)."""

from __future__ import annotations

import re
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


def conform_arguments(arguments: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """Arguments with numbers and booleans the model wrote as strings converted to the types the tool declares.

    Qwen2.5 at times quotes a number, and FLy's loosened verification can keep a drafted quote the target
    would not have written: the LlamaIndex agent example under `fly` called multiply(a='1234', b='5678') where
    `ar` wrote integers, and the tool failed. Only a string that reads exactly as the declared type is
    converted; anything else is passed on as written, for the tool's own validation to judge.
    """
    properties = parameters.get("properties", {})
    conformed = dict(arguments)
    for key, value in arguments.items():
        spec = properties.get(key)
        declared = spec.get("type") if isinstance(spec, dict) else None
        kinds = declared if isinstance(declared, list) else [declared]
        if isinstance(value, str) and "string" not in kinds:
            for kind in kinds:
                converted = _from_string(value.strip(), kind)
                if converted is not None:
                    conformed[key] = converted
                    break
    return conformed


def _from_string(text: str, kind: Any) -> int | float | bool | None:
    if kind == "integer" and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
        return float(text) if any(c in text for c in ".eE") else int(text)
    if kind == "boolean" and text in ("true", "false"):
        return text == "true"
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


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others (``additionalProperties: false``
    where it says nothing), as OpenAI's strict structured output reads a schema: decoded under an open schema,
    a small model goes on inventing keys until its token budget cuts the JSON short."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_schema(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
