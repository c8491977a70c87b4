"""The ``tools`` suite's data and scoring: BFCL function-calling turns (Berkeley Function Calling Leaderboard).

The questions and their possible answers come from the ``bfcl-eval`` wheel, read as a zip archive: its
dependencies (a pinned numpy, vLLM clients, ...) would disturb this environment, so it is downloaded once with
``pip download --no-deps`` into the fly cache, never installed. An installed ``bfcl_eval`` is used as it is.

Scoring follows BFCL's AST check: the reply makes as many calls as the answer (any order for ``parallel``),
each names the expected function, sets no unknown parameter, sets every parameter the answer requires, and
gives each a value among the possible ones (strings compared as BFCL compares them: case, spaces and
punctuation ignored; numbers as numbers).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from fly_runtime.errors import FlyError

BFCL_REQUIREMENT = "bfcl-eval==2026.3.23"
CATEGORIES = ("simple_python", "parallel")
_TYPES = {"dict": "object", "float": "number", "tuple": "array"}  # BFCL's Python type names -> JSON schema


def _installed_data() -> Path | None:
    try:
        import bfcl_eval  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path(bfcl_eval.__file__).parent / "data"


def bfcl_wheel(cache: Path) -> Path:
    """The bfcl-eval wheel in ``cache``, downloaded (no dependencies) if missing."""
    found = sorted(cache.glob("bfcl_eval-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fly: downloading the BFCL data ({BFCL_REQUIREMENT}, about 2 MB) ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-q", "-d", str(cache), BFCL_REQUIREMENT],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = sorted(cache.glob("bfcl_eval-*.whl"))
    if proc.returncode != 0 or not found:
        said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "nothing"
        raise FlyError(f"could not download {BFCL_REQUIREMENT} for the tools suite (pip said: {said}); check that "
                       "PyPI is reachable, or pip install bfcl-eval")
    return found[-1]


def _read_rows(category: str, kind: str, cache: Path) -> list[dict]:
    name = f"BFCL_v4_{category}.json"
    relative = name if kind == "question" else f"possible_answer/{name}"
    installed = _installed_data()
    if installed is not None:
        text = (installed / relative).read_text(encoding="utf-8")
    else:
        with zipfile.ZipFile(bfcl_wheel(cache)) as archive:
            text = archive.read(f"bfcl_eval/data/{relative}").decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def tool_name(name: str) -> str:
    """A BFCL function name as an OpenAI tool name (``math.factorial`` -> ``math_factorial``), as BFCL itself
    renames them for OpenAI-style APIs."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)


def json_schema(schema: dict) -> dict:
    """BFCL's parameter schema (Python type names) as a JSON schema."""
    out = {}
    for key, value in schema.items():
        if key == "type":
            if value != "any":
                out[key] = _TYPES.get(value, value)
        elif key == "properties":
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def openai_tool(function: dict) -> dict:
    return {"type": "function", "function": {"name": tool_name(function["name"]),
                                             "description": function.get("description", ""),
                                             "parameters": json_schema(function["parameters"])}}


def load_bfcl(cache: Path, categories: tuple[str, ...] = CATEGORIES) -> list[tuple[str, str, list[dict], list[dict],
                                                                                  list[dict]]]:
    """(id, category, messages, OpenAI tools, possible answer) per turn, answers keyed by tool name."""
    turns = []
    for category in categories:
        answers = {row["id"]: row["ground_truth"] for row in _read_rows(category, "answer", cache)}
        for row in _read_rows(category, "question", cache):
            expected = [{tool_name(name): params for name, params in call.items()} for call in answers[row["id"]]]
            turns.append((row["id"], category, row["question"][0], [openai_tool(f) for f in row["function"]],
                          expected))
    return turns


# ------------------------------------------------------------------------------------------------- scoring
def _standard(text: str) -> str:
    return re.sub(r"[ ,./\-_*^'\"]", "", text).lower()


def _same_value(got: object, want: object) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and float(got) == float(want)
    if isinstance(want, str):
        return isinstance(got, str) and _standard(got) == _standard(want)
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_same_value, got, want))
    if isinstance(want, dict):  # a nested object: its own parameters and possible values
        return _params_match(got, want)
    return got == want


def _params_match(got: object, params: dict) -> bool:
    if not isinstance(got, dict) or not set(got) <= set(params):
        return False
    for param, options in params.items():
        if param not in got:
            if "" not in options:
                return False
        elif not any(_same_value(got[param], option) for option in options if option != ""):
            return False
    return True


def call_matches(name: str, arguments: dict, expected: dict) -> bool:
    """One call against one expected call ``{tool name: {parameter: [possible values; "" = may be left out]}}``."""
    (want_name, params), = expected.items()
    return name == want_name and _params_match(arguments, params)


def score_calls(calls: list[tuple[str, dict]], expected: list[dict]) -> bool:
    """The reply's calls answer the turn: one to one with the expected calls, in any order."""
    if len(calls) != len(expected):
        return False
    left = list(expected)
    for name, arguments in calls:
        match = next((i for i, want in enumerate(left) if call_matches(name, arguments, want)), None)
        if match is None:
            return False
        left.pop(match)
    return True
