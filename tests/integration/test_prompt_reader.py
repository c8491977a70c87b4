"""The prompt reader on the real target: keys and values it hands llama.cpp (and the int4 graph) make it choose the
model's next tokens as often as its own reading does (judged against the model's full-precision choices, as every
quantised form is), from an empty cache and after a cached prefix; and an engine request over a long prompt is read
by it."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from fly_runtime.backends.bf16_reader import ReaderSlot

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def target():
    from fly_runtime.sources import resolve_model

    return resolve_model("qwen2.5-coder-1.5b-instruct")


@pytest.fixture(scope="module", autouse=True)
def reader_opens_here(target):
    """The reader's real reads run where fly would open it: on a CPU whose timed bfloat16 product predicts reads
    at least ``ReaderSlot.GAIN`` times as fast as llama.cpp's (AMX, AVX512-BF16). Elsewhere bfloat16 is emulated, a read
    takes ten times llama.cpp's, the reader never opens, and its arithmetic is tested on a small GGUF
    (tests/unit/test_prompt_reader.py)."""
    from fly_runtime.loader import _prompt_readers
    from fly_runtime.tuning import choose_precision

    choose_precision(target)  # tuning's record, with llama.cpp's timed read, which the slot is priced against
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLY_PROMPT_READER", "1")  # the suite's conftest turns it off elsewhere
        slot = _prompt_readers(target).get("gguf")  # the slot an engine here would hold, priced as it prices it
    if slot is None:
        pytest.skip("no prompt reader for this target (a model the reader does not compute)")
    if not slot.promising():
        pytest.skip(f"the prompt reader does not open on this CPU: predicted {slot.reader_ms:.0f} ms a token against "
                    f"llama.cpp's {slot.own_ms:.0f}")
    # the module holds llama.cpp twice and a reader (2.6 GB) at a time: the suite's kept default pair goes first, so
    # that it fits the suite's 12 GB beside what earlier modules left
    from tests.integration.conftest import drop_engines

    drop_engines(keep_default=False)


@pytest.fixture(scope="module")
def reference(target):
    from fly_runtime.backends.registry import load_tokenizer
    from fly_runtime.tuning import reference as choices

    return choices(target, load_tokenizer(target))


@pytest.fixture(scope="module")
def backend(target):
    from fly_runtime.backends.llama_cpp_backend import LlamaCppBackend

    llama = LlamaCppBackend(target.gguf, context=4096)
    yield llama
    llama.close()


def agreement(backend, reference, start: int, count: int = 150) -> float:
    """Teacher-forced: how often the backend's next token after each of ids[start:start + count] is the full
    precision model's."""
    ids = reference["ids"].tolist()
    logits = backend.forward(ids[start:start + count]).numpy()
    return float((logits.argmax(-1) == reference["top_ids"][start:start + count, 0]).mean())


def open_slot(backend, target):
    """A slot that reads every long enough part with the reader (opened now)."""
    slot = ReaderSlot(target.gguf, reader_ms=1.0, open_seconds=0.0)
    slot.own_ms = 100.0
    backend.reader = slot
    return slot


def test_reader_keys_and_values_serve_llama_cpp_as_its_own_do(backend, reference, target):
    ids = reference["ids"].tolist()
    backend.reader = None
    backend.crop(0)
    backend.forward(ids[:600], keep=1)
    llama_cells = backend._cells(0)
    own = agreement(backend, reference, 600)
    slot = open_slot(backend, target)
    try:
        backend.crop(0)
        backend.forward(ids[:600], keep=1)
        assert slot.reader is not None and backend._lengths[0] == 600
        read_cells = backend._cells(0)
        assert read_cells.count == 600
        # the same keys and values as llama.cpp's own pass, within the two computations' rounding (llama.cpp rounds
        # activations to 8 bits; the difference grows with depth)
        def difference(mine, theirs):
            mine, theirs = mine.astype(np.float32), theirs.astype(np.float32)
            return np.abs(mine - theirs).mean() / np.abs(theirs).mean()

        keys = [difference(a, b) for a, b in zip(read_cells.keys, llama_cells.keys)]
        values = [difference(a, b) for a, b in zip(read_cells.values, llama_cells.values)]
        assert keys[0] < 0.01 and values[0] < 0.03, (keys[0], values[0])
        assert np.mean(keys) < 0.06 and np.mean(values) < 0.08, (np.mean(keys), np.mean(values))
        read = agreement(backend, reference, 600)
        assert read >= 0.97 and read >= own - 0.02, (read, own)
        # after a cached prefix that llama.cpp read itself: the reader attends to llama.cpp's cells
        backend.crop(200)
        backend.reader = None
        backend.forward(ids[200:300], keep=1)
        backend.reader = slot
        backend.forward(ids[300:900], keep=1)
        assert backend._lengths[0] == 900
        assert agreement(backend, reference, 900) >= 0.97
    finally:
        backend.reader = slot.reader = None  # its weights given back before the next test opens another
        backend.crop(0)
        gc.collect()


def test_reader_keys_and_values_serve_the_int4_graph_as_its_own_do(reference, target):
    """The int4 graph written from the same GGUF takes the reader's keys and values into its cache: it then picks
    the full-precision model's next tokens as often as after its own read."""
    from fly_runtime.backends.registry import open_target

    ids = reference["ids"].tolist()
    graph = open_target(target, "int4")
    slot = ReaderSlot(target.gguf, reader_ms=1.0, open_seconds=0.0)
    slot.own_ms = 100.0  # the graph's reads priced far above the reader's: it opens on the first read
    try:
        graph.forward(ids[:600], keep=1)
        own = agreement(graph, reference, 600)
        graph.crop(0)
        graph.reader = slot
        graph.forward(ids[:600], keep=1)
        assert slot.reader is not None and graph._length == 600
        read = agreement(graph, reference, 600)  # every logit wanted: the graph's own pass
        assert read >= 0.97 and read >= own - 0.02, (read, own)
    finally:
        graph.reader = slot.reader = None  # the weights of both given back before the next test
        del graph
        gc.collect()


def test_short_reads_and_steps_stay_on_llama_cpp(backend, target):
    slot = open_slot(backend, target)
    try:
        backend.crop(0)
        backend.forward([100 + i % 300 for i in range(ReaderSlot.MIN_TOKENS)], keep=1)  # one short of the minimum
        assert slot.reader is None and backend._lengths[0] == ReaderSlot.MIN_TOKENS
        backend.forward([7, 8, 9])  # a verification pass: every logit wanted, nothing to read ahead
        assert slot.reader is None and backend._lengths[0] == ReaderSlot.MIN_TOKENS + 3
    finally:
        backend.reader = None
        backend.crop(0)


def test_an_engine_request_over_a_long_prompt_is_read_by_the_reader(target, monkeypatch):
    """Through the engine: a RAG-sized prompt on the llama.cpp target, the reader opened by its rule (here at once:
    no opening cost, llama.cpp's reads priced high); the answer starts as the one llama.cpp's own read gives
    (quantised forms may part later), and is right where llama.cpp's is."""
    from fly_runtime import GenerationConfig, ModelSettings
    from fly_runtime.loader import load_engine

    monkeypatch.setattr(ReaderSlot, "SECONDS_PER_PARAM", 0.0)
    monkeypatch.setenv("FLY_PROMPT_READER", "1")  # the suite's conftest turns it off for every other test
    engine = load_engine(ModelSettings(draft=None, precision="gguf", max_batch=1))
    backend = engine.forms[0].slots.sequences[0].backend
    slot = backend.reader
    if slot is None:
        pytest.skip("no prompt reader for this target here (a model the reader does not compute)")

    def ask(question: str):
        facts = " ".join(f"Record {i}: the sensor in room {i % 7} read {20 + i % 9} degrees at {i % 24}:00."
                         for i in range(32))  # ~780 tokens: two of the reader's chunks
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{facts}\n\n{question} Answer in one sentence."}], add_generation_prompt=True)
        return engine.generate(prompt, GenerationConfig(max_new_tokens=24, mode="ar"))

    question = "Which room did record 12 come from?"
    slot.own_ms = 100.0  # llama.cpp's reads priced far above the reader's: it opens on the first read
    predicted = slot.reader_ms
    by_reader = ask(question)
    assert slot.reader is not None and slot.reader_ms != predicted  # opened, and its reads were timed
    backend.reader = None
    engine.clear_cache()  # the same prompt read again from its start, by llama.cpp itself
    by_llama = ask(question)
    backend.reader = slot
    assert by_reader.token_ids[:4] == by_llama.token_ids[:4], (by_reader.text, by_llama.text)
    assert ("5" in by_reader.text) >= ("5" in by_llama.text), (by_reader.text, by_llama.text)  # record 12: room 5
