"""Text held back while it may still become a marker: stop strings and exact spans (a small real tokenizer)."""

from fly_runtime.spans import ExactSpans
from fly_runtime.text import StopTextStream, partial_marker_length


def test_partial_marker_length_is_the_longest_suffix_that_starts_a_marker():
    assert partial_marker_length("say <tool", ["<tool_call>"]) == 5
    assert partial_marker_length("say <tool_call>", ["<tool_call>"]) == 0  # a whole marker is not partial
    assert partial_marker_length("end.\n``", ["```", "\n```"]) == 3
    assert partial_marker_length("nothing here", ["STOP", "END"]) == 0


def test_a_stop_string_split_across_pieces_is_never_released(tokenizer):
    stream = StopTextStream(tokenizer, ["STOP"])
    released = ""
    for piece in ["The answer", " is Paris", " ST", "OP and more"]:
        released += stream.push(tokenizer.encode(piece))
        assert "ST" not in released
    assert stream.stopped and released == "The answer is Paris " and stream.finish() == ""


def test_an_exact_span_opened_across_tokens_makes_its_drafts_strict(tokenizer):
    spans = ExactSpans(tokenizer, [("```", "```")], tokenizer.encode("<|im_start|>assistant\n"))
    ids = tokenizer.encode("Here: ``")
    spans.commit(ids)
    assert not spans.inside
    tail = tokenizer.encode("`code`")
    strict = spans.strict_positions(tail)
    assert strict[0] and all(strict)  # the first draft completes the opening marker: inside from there
    spans.commit(tail)
    assert spans.inside
    spans.commit(tokenizer.encode("``` done"))
    assert not spans.inside
