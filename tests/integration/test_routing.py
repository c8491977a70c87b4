"""The default pair held in both its forms (the int4 graph and the GGUF under llama.cpp), each request served on
the form the router predicts finishes it soonest: the second form opened beside the requests at load, or (where
memory is short) on the first request it suits."""

import importlib.util

import pytest

from fly_runtime import GenerationConfig
from fly_runtime.chat import encode_chat
from fly_runtime.loader import DEFAULT_TARGET, ModelSettings, load_engine, target_precision
from fly_runtime.sources import resolve_model
from fly_runtime.sources.convert import GGUF

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs the llama-cpp extra")


@pytest.fixture(scope="module")
def routed(engine):
    """An engine of the default pair holding both forms whatever this machine's record held: the chosen form
    first, the other beside it, priced as timed here (1-token step, 9-token pass, 64-token read), opened at load
    (the memory reserve it leaves set to 0: a machine short of memory opens it once it pays, tests/unit)."""
    from fly_runtime import loader, tuning

    model = resolve_model(DEFAULT_TARGET)
    chosen = target_precision(ModelSettings(), model, engine.tokenizer)
    other = "int4" if chosen == GGUF else GGUF
    ms = {GGUF: {"1": 45.0, "9": 360.0, "64": 1400.0}, "int4": {"1": 68.0, "9": 195.0, "64": 1000.0}}
    patch = pytest.MonkeyPatch()
    patch.setattr(tuning, "recorded_forms", lambda m: (ms, [other]))
    patch.setattr(tuning, "recorded_prices", lambda m: {})  # nothing learned by earlier processes
    patch.setattr(loader, "OPEN_RESERVE", 0)
    try:
        routed = load_engine(ModelSettings(draft=None))
    finally:
        patch.undo()
    routed.settle()
    yield routed
    routed.clear_cache()


def test_each_request_runs_on_the_form_that_suits_it_and_writes_the_model(routed):
    assert [f.name for f in routed.forms][1:] and routed.forms[1].slots is not None  # opened beside, at load
    # prompt lookup drafts here: each form starts from tuning's prices instead of timing itself on its first request
    prices = {f.name: f.learned.costs for f in routed.forms}
    assert prices[GGUF].step == pytest.approx(0.045) and prices[GGUF].row == pytest.approx((0.360 - 0.045) / 8)
    assert prices["int4"].step == pytest.approx(0.068) and prices["int4"].draft == 0.0
    tok = routed.tokenizer
    story = encode_chat(tok, [{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    plain = routed.generate(story, GenerationConfig(mode="ar", max_new_tokens=48))
    assert plain.form == GGUF and "light" in plain.text.lower()  # plain decoding: the faster stepper
    document = " ".join(f"Item {i}: the harbor library opens at {8 + i % 3} am on weekday {i % 7}." for i in range(30))
    rag = encode_chat(tok, [{"role": "user", "content": document + "\nWhen does item 5 open? Quote the line."}])
    quoted = routed.generate(rag, GenerationConfig(mode="exact", max_new_tokens=24))
    assert len(rag) > 400 and quoted.form == "int4"  # a long read: the faster reader
    assert "opens at" in quoted.text  # copied from the prompt
    # a conversation continues where its history is cached
    again = routed.generate(story + plain.token_ids, GenerationConfig(mode="ar", max_new_tokens=8))
    assert again.form == GGUF and again.stats.cached_tokens >= len(story)
    seeded = routed.generate(story, GenerationConfig(mode="fly", temperature=0.8, seed=3, max_new_tokens=16))
    assert seeded.form == routed.forms[0].name  # a seeded request stays on the first form: it repeats itself
