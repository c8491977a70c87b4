"""Integration tests run the real default pair from the fly cache (fetched by `fly models fetch`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# The prompt reader (bf16 prompt reads for llama.cpp, 2.6 GB beside the 1.5B) stays off in the suite, whose engines
# must fit 12 GB together; tests/integration/test_prompt_reader.py turns it on where it tests it.
os.environ.setdefault("FLY_PROMPT_READER", "0")

EXTERNAL = os.environ.get("FLY_SERVER_URL")
KEY = os.environ.get("FLY_SERVER_KEY", "test-key-123")
MODEL = os.environ.get("FLY_SERVER_MODEL", "qwen2.5-coder-1.5b-instruct")

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "Write a SQL query that counts the orders per customer in a table orders(customer_id, id).",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "What is 17 multiplied by 23? Show the steps.",
    "Write a bash one-liner that counts the lines of all .py files in a folder.",
    "Give three tips for writing readable code.",
    "Write a JavaScript function that debounces another function.",
    "Summarise: Speculative decoding uses a small model to draft tokens that a large model verifies in one pass.",
    "Write a Python class Stack with push, pop and peek methods.",
]


def drop_engines(keep_default: bool = True) -> None:
    """Forget the loaded engines but, with ``keep_default``, the default pair's, whose prompt cache is cleared."""
    from fly_runtime.loader import ModelSettings, loaded, unload

    default = ModelSettings() if keep_default else None
    unload(keep=default)
    if default is not None and (engine := loaded(default)) is not None:
        engine.clear_cache()


@pytest.fixture(scope="module", autouse=True)
def _models_per_module():
    """Each module's models are dropped after it but the default pair (2.7 GB; most modules use it, and reloading
    it cost 5-20 s a module): the suite needs the memory of its largest module beside that pair, not of every pair
    any module loaded (a machine of 24 GB holds about three). The fixture loading the fp32 1.5B drops even that."""
    yield
    drop_engines()


# Where the adapters' answers are compared token for token: the 0.5B at fp32 (its one-token steps and
# multi-token passes compute a token alike), drafted for by its own int4 graph. The check is the model's
# arithmetic, not its size: this pair loads in 9 s at 3 GB where the 1.5B at fp32 took 40 s and 6.6 GB.
EXACT_PAIR = {"model": "qwen2.5-coder-0.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct", "precision": "fp32"}


@pytest.fixture
def fp32_alone():
    """A test that loads an fp32 pair loads it beside the default pair alone: every other one is dropped before and
    after it."""
    drop_engines()
    yield
    drop_engines()


@pytest.fixture(scope="module")
def engine():
    from fly_runtime import ModelSettings, get_engine

    return get_engine(ModelSettings())


@pytest.fixture(scope="module")
def fp32_engine():
    """The default pair with its fp32 target, whose one-token steps and multi-token passes compute a token alike:
    where the algorithm is tested token for token (quantised targets are judged by accuracy instead). Its 0.5B
    drafter disagrees with the 1.5B often enough to exercise every forgiveness rule. It loads alone (6.7 GB)."""
    from fly_runtime import ModelSettings, get_engine

    drop_engines(keep_default=False)
    return get_engine(ModelSettings(precision="fp32"))


@pytest.fixture(scope="module")
def exact_engine():
    """The small exact pair (EXACT_PAIR) as an engine."""
    from fly_runtime import ModelSettings, get_engine

    return get_engine(ModelSettings(target=EXACT_PAIR["model"], draft=EXACT_PAIR["draft"], precision="fp32"))


@pytest.fixture(scope="session")
def chat_ids():
    """Chat prompt ids for the pair's tokenizer (the same at every target precision)."""
    from fly_runtime.loader import DEFAULT_TARGET, load_tokenizer
    from fly_runtime.sources import resolve_model

    tokenizer = load_tokenizer(resolve_model(DEFAULT_TARGET))

    def encode(text: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    return encode


def greedy_runs(engine, chat_ids, prompts: list[str], configs: dict) -> dict[str, list]:
    """Each prompt decoded under each named ``GenerationConfig`` in turn (interleaved per prompt), for the tests
    that compare modes on the same prompts."""
    out: dict[str, list] = {name: [] for name in configs}
    for prompt in prompts:
        ids = chat_ids(prompt)
        for name, config in configs.items():
            out[name].append(engine.generate(ids, config))
    return out


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.real_model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(args: list[str], log) -> tuple[subprocess.Popen, str]:
    """`fly serve ARGS` with the test key on a free port, once it answers /health; its output goes to ``log``."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fly"), "serve", "--port", str(port), "--api-key", KEY,
                             *args], stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"fly serve exited: {log.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    return proc, base


@pytest.fixture(scope="module")
def fly_server(tmp_path_factory):
    """`fly serve` on the default pair in a process of its own, on a free port (or, with FLY_SERVER_URL, a
    server already running: scripts/gpu-check.sh points the tests at vLLM)."""
    if EXTERNAL:
        yield {"base": EXTERNAL.removesuffix("/v1"), "url": EXTERNAL, "pid": None}
        return
    log = open(tmp_path_factory.mktemp("fly-serve") / "serve.log", "w+")
    proc, base = launch_server(["--mode", "exact", "--queue-depth", "16", "--max-new-tokens", "48"], log)
    yield {"base": base, "url": base + "/v1", "pid": proc.pid}
    proc.terminate()
    proc.wait(timeout=60)
    log.close()
