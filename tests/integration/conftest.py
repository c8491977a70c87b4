"""Integration tests run the real default pair from the fly cache (fetched by `fly models fetch`)."""

from __future__ import annotations

import pytest

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


@pytest.fixture(scope="session")
def engine():
    from fly_runtime import ModelSettings, get_engine

    return get_engine(ModelSettings())


@pytest.fixture(scope="session")
def chat_ids(engine):
    def encode(text: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    return encode


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.real_model)
