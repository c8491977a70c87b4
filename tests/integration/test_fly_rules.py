"""FLy's loosening and its guards on the default pair with its fp32 target, offline: the 0.5B drafter disagrees
with the 1.5B often enough to exercise every forgiveness rule, and the fp32 target computes a token alike in any
pass, so a guarded reply is compared with plain decoding token for token."""

import pytest

from fly_runtime import GenerationConfig
from tests.integration.conftest import PROMPTS, greedy_runs


TOKENS = 48


@pytest.fixture(scope="module")
def runs(fp32_engine, chat_ids):
    """exact and fly greedy runs of a few prompts."""
    return greedy_runs(fp32_engine, chat_ids, PROMPTS[:3], {mode: GenerationConfig(mode=mode, max_new_tokens=TOKENS)
                                                            for mode in ("exact", "fly")})


@pytest.fixture(scope="module")
def engine(fp32_engine):
    return fp32_engine


def test_fly_accepts_more_tokens_per_forward_than_exact(runs):
    def tau(results):
        return sum(r.stats.new_tokens for r in results) / sum(r.stats.target_forwards for r in results)

    assert tau(runs["exact"]) > 1.5
    assert tau(runs["fly"]) > tau(runs["exact"])
    assert sum(r.stats.fly_forgiven for r in runs["fly"]) > 0
    assert all(r.stats.fly_forgiven == 0 for r in runs["exact"])


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


SEARCH_TOOL = {"type": "function", "function": {
    "name": "web_search", "description": "Search the web and return the top results.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the search query"}},
                   "required": ["query"]}}}


def test_fly_verifies_a_tool_call_exactly_inside_exact_spans(engine):
    # FLy loosened as far as it goes (any mismatch followed by one native match is forgiven), so that it
    # rewrites a call if nothing stops it; the guard is judged on the first question whose call it rewrites (the
    # drafter writes some calls exactly as the target does, and then there is nothing to guard)
    loose = dict(mode="fly", window=1, entropy_threshold=0.0, min_prob_ratio=0.0, max_new_tokens=96)
    questions = [([WEATHER_TOOL], "What's the weather like in Reykjavik today, in fahrenheit?"),
                 ([SEARCH_TOOL], "Find me recent work on protein structure prediction that uses diffusion models, "
                                 "preferably with open code."),
                 ([SEARCH_TOOL], "Look up how people keep sourdough starters alive while travelling.")]
    for tools, question in questions:
        messages = [{"role": "system", "content": "You are a precise assistant. Use the tools."},
                    {"role": "user", "content": question}]
        ids = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        # the target's own reply: exact decoding, plain decoding's token for token on this fp32 target
        # (test_engine_real.py), in fewer passes
        ar = engine.generate(ids, GenerationConfig(mode="exact", max_new_tokens=96))
        assert ar.text.startswith("<tool_call>") and tools[0]["function"]["name"] in ar.text
        unguarded = engine.generate(ids, GenerationConfig(**loose))
        if unguarded.stats.fly_forgiven > 0 and unguarded.token_ids != ar.token_ids:
            break
    else:
        pytest.fail("unguarded FLy rewrote none of the calls: nothing here shows the guard at work")
    guarded = engine.generate(ids, GenerationConfig(**loose, exact_spans=[("<tool_call>", "</tool_call>")]))
    assert guarded.token_ids == ar.token_ids and guarded.stats.fly_forgiven == 0


def test_fly_never_forgives_a_drafted_number(engine, chat_ids):
    ids = chat_ids("Compute each product and write only the results, comma separated: "
                   "17*23, 45*67, 89*12, 34*56, 78*91, 23*45, 67*89, 56*78.")
    # FLy loosened as far as it goes, so that the drafter's arithmetic slips through unless numbers are guarded
    loose = dict(mode="fly", window=1, entropy_threshold=0.0, min_prob_ratio=0.0, max_new_tokens=64)
    ar = engine.generate(ids, GenerationConfig(mode="exact", max_new_tokens=64))  # the target's own, as below
    unguarded = engine.generate(ids, GenerationConfig(**loose, exact_numbers=False))
    assert unguarded.stats.fly_forgiven > 0 and unguarded.text != ar.text
    guarded = engine.generate(ids, GenerationConfig(**loose))
    assert guarded.text == ar.text


def test_fly_verifies_a_code_block_exactly(engine, chat_ids):
    ids = chat_ids("Reply with only a Python code block, no explanation: a function that merges two sorted lists.")
    loose = dict(mode="fly", window=1, entropy_threshold=0.0, min_prob_ratio=0.0, max_new_tokens=96)
    ar = engine.generate(ids, GenerationConfig(mode="exact", max_new_tokens=96))  # the target's own, as above
    assert ar.text.startswith("```python")
    unguarded = engine.generate(ids, GenerationConfig(**loose, exact_code=False))
    assert unguarded.stats.fly_forgiven > 0 and unguarded.text != ar.text
    # everything from the opening fence to the closing one is the target's own; prose after it may be loosened
    guarded = engine.generate(ids, GenerationConfig(**loose))
    block = ar.text[: ar.text.index("```", 3) + 3] if "```" in ar.text[3:] else ar.text
    assert guarded.text.startswith(block)
