"""Exact spans (tool calls FLy must not loosen), tracked on the default pair's tokenizer."""

import pytest

from fly_runtime import GenerationConfig, InvalidSettingsError, ModelSettings
from fly_runtime.config import CODE_FENCE
from fly_runtime.loader import load_tokenizer
from fly_runtime.sources.resolve import resolve_model
from fly_runtime.spans import ExactSpans

TOOL_CALL = ("<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(ModelSettings().target))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _inside_call(text: str) -> bool:
    return text.rfind(TOOL_CALL[0]) > text.rfind(TOOL_CALL[1])


def test_tokens_inside_a_call_or_opening_one_are_strict(tokenizer):
    spans = ExactSpans(tokenizer, [TOOL_CALL], ids(tokenizer, "What is 6 times 7?"))
    draft = ids(tokenizer, 'I will compute it.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6}}\n'
                           '</tool_call>\nDone')
    prefixes = [tokenizer.decode(draft[:n]) for n in range(len(draft) + 1)]
    expected = [_inside_call(prefixes[i]) or _inside_call(prefixes[i + 1]) for i in range(len(draft))]
    strict = spans.strict_positions(draft)
    assert strict == expected
    # the markers are several tokens here ('<', 'tool', '_call', '>'): strictness starts at the one completing
    # the opening marker and ends with the one completing the closing marker; the prose around stays loose
    assert not strict[0] and not strict[-1] and sum(strict) >= 15
    assert not spans.inside  # proposing a draft does not move the committed state
    first_strict = strict.index(True)
    spans.commit(draft[: first_strict + 1])
    assert spans.inside and all(spans.strict_positions(ids(tokenizer, ' "a": 6')))
    spans.commit(draft[first_strict + 1 :])
    assert not spans.inside


def test_a_code_block_is_strict_from_its_opening_fence_to_its_closing_one(tokenizer):
    # one marker both opens and closes (```), as Markdown code blocks do; prose on either side stays loose
    spans = ExactSpans(tokenizer, [CODE_FENCE], ids(tokenizer, "Reverse a string in Python."))
    draft = ids(tokenizer, "Here it is:\n```python\ndef rev(s):\n    return s[::-1]\n```\nIt slices backwards.")
    prefixes = [tokenizer.decode(draft[:n]) for n in range(len(draft) + 1)]
    inside = [prefix.count("```") % 2 == 1 for prefix in prefixes]
    assert spans.strict_positions(draft) == [inside[i] or inside[i + 1] for i in range(len(draft))]
    assert sum(inside) >= 10 and not inside[-1]


def test_a_marker_split_across_tokens_and_commits_is_found(tokenizer):
    spans = ExactSpans(tokenizer, [("[[args", "args]]")], ids(tokenizer, "Hello"))
    text = "see [[args 12, 13 args]] then"
    tokens = ids(tokenizer, text)
    assert len(tokens) > 8  # the markers are several tokens each
    for n, token in enumerate(tokens, 1):
        spans.commit([token])
        decoded = tokenizer.decode(tokens[:n])
        assert spans.inside == ("[[args" in decoded and "args]]" not in decoded)


def test_a_prompt_ending_inside_a_call_starts_strict(tokenizer):
    # a forced tool call's prompt ends with the opening marker; the instructions before it hold balanced ones
    prompt = ids(tokenizer, "Reply with <tool_call>{...}</tool_call> blocks.\nassistant\n<tool_call>\n")
    spans = ExactSpans(tokenizer, [TOOL_CALL], prompt)
    assert spans.inside and spans.strict_positions(ids(tokenizer, '{"name"')) == [True] * 3


def test_only_the_reply_part_of_a_chat_prompt_can_open_a_span(tokenizer):
    # the question quotes an unclosed fence; the reply starts outside every span
    question = [{"role": "user", "content": "Reply in one ```python block.\n\n```python\ndef f(x):\n```"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    assert tokenizer.decode(prompt).count("```") % 2 == 1
    assert not ExactSpans(tokenizer, [CODE_FENCE], prompt).inside
    # a reply the prompt has already begun with a fence (or a forced call with its marker) starts inside
    assert ExactSpans(tokenizer, [CODE_FENCE], prompt + ids(tokenizer, "```python\n")).inside


def test_exact_spans_must_be_marker_pairs():
    assert GenerationConfig(exact_spans=[["<a>", "</a>"]]).exact_spans == (("<a>", "</a>"),)
    for bad in [("<a>", "</a>"), [("<a>",)], [("<a>", "")]]:
        with pytest.raises(InvalidSettingsError, match="exact_spans must be"):
            GenerationConfig(exact_spans=bad)
