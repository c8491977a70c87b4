"""Each request on the form of the target that finishes it soonest: the router's prices (pure), and the engine
serving requests on two forms, the second opened on its first request."""

import pytest
import torch

from fly_runtime import GenerationConfig
from fly_runtime.backends.base import CachedSequence
from fly_runtime.drafters import NgramDrafter
from fly_runtime.engine import FlyEngine, TargetForm
from fly_runtime.routing import OPEN_SECONDS, FormPrices, Router

# as timed on a 2-vCPU AVX-512 EPYC (ms): llama.cpp steps faster, the int4 graph reads faster and verifies cheaply
GGUF_MS = {"1": 45.0, "9": 360.0, "64": 1740.0}
INT4_MS = {"1": 65.0, "9": 190.0, "64": 1320.0}


def router(open_seconds: float = 5.0) -> Router:
    return Router({"gguf": FormPrices.of(GGUF_MS), "int4": FormPrices.of(INT4_MS)}, open_seconds)


def test_prices_from_the_timed_passes():
    p = FormPrices.of(INT4_MS)
    assert (p.step, p.read) == (0.065, 1.32 / 64) and abs(p.row - (0.190 - 0.065) / 8) < 1e-12
    assert FormPrices.of({"1": 40.0, "9": 90.0}).read == 0.01  # no timed read: nine-token passes
    gguf = FormPrices.of(GGUF_MS)
    assert gguf.written("text") == gguf.step  # rows as dear as steps: drafts never pay there
    assert p.written("plain") == p.step and p.written("tools") < p.written("text") < p.step  # cheap rows: they do
    assert p.written("chat") == p.step  # little to copy from a short prompt: no draft expected to pay
    # opening a form is priced as tuning timed it here; one it did not time, at OPEN_SECONDS until one opened
    timed = Router.timed({"gguf": {**GGUF_MS, "open": 900.0}, "int4": INT4_MS}, ["gguf", "int4"])
    assert timed.open_price("gguf") == 0.9 and timed.open_price("int4") == OPEN_SECONDS


def test_a_long_read_goes_to_the_faster_reader_and_a_long_free_reply_to_the_faster_stepper():
    r, both = router(), {"gguf", "int4"}
    assert r.choose("tools", {"gguf": 2000, "int4": 2000}, 60, both) == "int4"  # a RAG prompt, a short reply
    assert r.choose("plain", {"gguf": 40, "int4": 40}, 500, both) == "gguf"  # plain decoding of a long reply
    # what a form holds cached it need not read again: a conversation stays where its history is
    assert r.choose("tools", {"gguf": 30, "int4": 2000}, 60, both) == "gguf"
    # a form not open yet is opened for a request that alone saves what opening it costs (5 s) ...
    assert r.choose("plain", {"gguf": 40, "int4": 40}, 100, {"int4"}) == "int4"  # saves 2 s: not for it
    assert r.choose("tools", {"gguf": 300, "int4": 300}, 60, {"gguf"}) == "gguf"  # saves 1.7 s: not for it
    assert r.choose("tools", {"gguf": 2000, "int4": 2000}, 60, {"gguf"}) == "int4"  # a long read saves 13 s
    # ... and, to be opened beside them, once the requests served elsewhere lost that much there: each the share of
    # its time it was predicted to save (here 7.3 s each, 0.8 read and 6.5 written, predicted 7.3 there and 5.6 here)
    due = [r.record("int4", "plain", 100, 6.5, True, read=(40, 0.8), closed={"gguf": 40}) for _ in range(3)]
    assert due == [[], [], ["gguf"]]
    r.opened("gguf", 0.5)  # opening it took 0.5 s: the price from now on
    assert r.open_price("gguf") == 0.5 and r.choose("plain", {"gguf": 40, "int4": 40}, 100, {"int4"}) == "gguf"


def test_learned_prices_move_the_choice():
    r, both = router(), {"gguf", "int4"}
    assert r.choose("text", {"gguf": 50, "int4": 50}, 256, both) == "gguf"
    for _ in range(3):  # replies of this kind came out at 3.5 tokens a pass on the graph: 19 ms a token
        r.record("int4", "text", 200, 200 * 0.019, stopped=True)
    assert r.choose("text", {"gguf": 50, "int4": 50}, 256, both) == "int4"
    r.record("gguf", "text", 1, 0.04, stopped=True)  # a one-token reply teaches nothing
    assert ("gguf", "text") not in r._written
    # replies that end by themselves teach how long one runs; a cut one only that it runs at least that long
    r.record("int4", "tools", 30, 1.0, stopped=True)
    expected = 0.7 * 100 + 0.3 * 30
    assert abs(r._reply["tools"] - expected) < 1e-9
    r.record("int4", "tools", 50, 1.0, stopped=False)  # cut below what is expected: nothing learned
    assert abs(r._reply["tools"] - expected) < 1e-9
    r.record("int4", "tools", 500, 10.0, stopped=False)  # cut above it: longer than expected
    assert abs(r._reply["tools"] - (0.7 * expected + 0.3 * 500)) < 1e-9


def test_long_free_replies_cut_by_max_tokens_move_to_the_faster_stepper():
    """Chat replies cut at max_tokens among short ones that stop by themselves (Spec-Bench's mix): the cut ones keep
    the expected length up, so the time llama.cpp would have saved soon adds up to opening it. Prices as timed on a
    2-vCPU Zen 4 EPYC, where the graph wrote these replies at 48 ms a token and llama.cpp at 32."""
    r = Router({"gguf": FormPrices.of({"1": 36.9, "9": 324.9, "64": 1093.8}),
                "int4": FormPrices.of({"1": 47.8, "9": 146.4, "64": 871.6})})
    replies = [(128, False), (33, True), (128, False), (13, True), (128, False), (128, False)]
    chosen, opened = [], {"int4"}
    for new_tokens, stopped in replies:
        form = r.choose("text", {"gguf": 60, "int4": 60}, 128, opened)
        chosen.append(form)
        closed = {f: 60 for f in ("gguf", "int4") if f not in opened}
        opened |= set(r.record(form, "text", new_tokens, new_tokens * 0.048, stopped, (60, 0.8), closed))
    assert r._reply["text"] > 90 and chosen[:3] == ["int4"] * 3 and "gguf" in chosen


def test_what_a_process_learned_is_where_the_next_one_on_this_machine_starts(monkeypatch, tmp_path):
    import json
    from types import SimpleNamespace

    from fly_runtime import tuning

    r, both = router(), {"gguf", "int4"}
    for _ in range(3):  # free text came out at 19 ms a token on the graph; tool replies run 30 tokens
        r.record("int4", "text", 200, 200 * 0.019, stopped=True)
        r.record("gguf", "tools", 30, 30 * 0.045, stopped=True, read=(250, 250 * 0.014))
    assert r.choose("text", {"gguf": 50, "int4": 50}, 256, both) == "int4"
    ms = {"gguf": GGUF_MS, "int4": INT4_MS}
    learned = json.loads(json.dumps(r.learned()))  # as tuning.json keeps it
    again = Router.timed(ms, ["gguf", "int4"], learned)
    assert again.choose("text", {"gguf": 50, "int4": 50}, 256, both) == "int4"  # a fresh router would say gguf
    assert Router.timed(ms, ["gguf", "int4"]).choose("text", {"gguf": 50, "int4": 50}, 256, both) == "gguf"
    for form, kind in (("int4", "text"), ("gguf", "tools")):
        assert again.predict(form, kind, 300, 256) == r.predict(form, kind, 300, 256)
    assert Router.timed(ms, ["gguf"], learned).learned()["written"] == [["gguf", "tools", r._written["gguf", "tools"]]]

    # kept with this machine's record of the model, its measurement date untouched; nothing without a record
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path))
    model, other = SimpleNamespace(key="k" * 16), SimpleNamespace(key="o" * 16)
    tuning._record(f"{tuning.machine_id()}|{model.key}", {"precision": "int4", "ms": ms, "held": ["gguf"]})
    monkeypatch.setenv("FLY_KEEP_PRICES", "0")  # each process learns anew: nothing kept, nothing read back
    tuning.keep_prices(model, learned)
    assert "learned" not in tuning.load_records()[f"{tuning.machine_id()}|{model.key}"]
    monkeypatch.setenv("FLY_KEEP_PRICES", "1")
    tuning.keep_prices(model, learned)
    monkeypatch.setenv("FLY_KEEP_PRICES", "0")
    assert tuning.recorded_prices(model) == {}
    monkeypatch.setenv("FLY_KEEP_PRICES", "1")
    tuning.keep_prices(other, learned)
    assert tuning.recorded_prices(model) == learned and tuning.recorded_prices(other) == {}
    assert list(tuning.load_records()) == [f"{tuning.machine_id()}|{model.key}"]
    assert tuning.recorded_forms(model) == (ms, ["gguf"])


class CountingLM:
    """The next id up, whatever came before; records the ids it reads."""

    name = "counting"

    def __init__(self, vocab: int, max_context: int = 4096) -> None:
        self.vocab, self.max_context, self.read = vocab, max_context, []

    def forward(self, ids, keep=None):
        self.read.extend(ids)
        rows = torch.zeros(len(ids), self.vocab)
        rows[torch.arange(len(ids)), (torch.tensor(list(ids)) + 1) % self.vocab] = 5.0
        return rows[-(keep or len(ids)):]

    def crop(self, length: int) -> None:
        pass


def two_forms(tokenizer, gguf_context: int = 4096):
    graph, opened = CountingLM(len(tokenizer)), []

    def opener() -> CachedSequence:
        backend = CountingLM(len(tokenizer), gguf_context)
        opened.append(backend)
        return CachedSequence(backend)

    engine = FlyEngine(CachedSequence(graph), tokenizer, NgramDrafter(), vocab_size=len(tokenizer), eos_token_ids=[0],
                       max_context=4096, form="int4", alternates=[TargetForm("gguf", gguf_context, opener=opener)],
                       router=router(open_seconds=0.0))  # opened for the first request it suits
    return engine, graph, opened


def test_the_engine_serves_each_request_on_the_routed_form_opening_it_once(tokenizer):
    engine, graph, opened = two_forms(tokenizer)
    long_reply = GenerationConfig(mode="ar", max_new_tokens=300)
    first = engine.generate([5, 6, 7], long_reply)  # plain decoding: the faster stepper, opened for it
    assert first.form == "gguf" and len(opened) == 1 and graph.read == []
    assert first.token_ids == list(range(8, 308))
    second = engine.generate(list(range(10, 1010)), GenerationConfig(mode="exact", k=4, max_new_tokens=8))
    assert second.form == "int4" and len(graph.read) > 0  # a long read: the faster reader
    third = engine.generate([5, 6, 7, 8, 9], long_reply)  # its start is cached on gguf only
    assert third.form == "gguf" and third.stats.cached_tokens > 0 and len(opened) == 1
    assert engine.max_context == 4096


def test_a_form_is_opened_beside_the_requests_once_they_lost_what_opening_it_costs(tokenizer):
    """Requests served on the graph took longer than llama.cpp was predicted to take them: once that adds up to what
    opening it costs, it opens on a thread of its own (no request waits for it) and the next request goes there; a
    form whose opening fails is left out and the requests stay where they are. A form opened for a request counts
    in that request's time."""
    import time

    from fly_runtime.routing import request_kind

    engine, graph, opened = two_forms(tokenizer)
    # both predicted to write a token in a microsecond, llama.cpp a little sooner: no request alone pays for opening
    engine.router = Router({"gguf": FormPrices(1e-6, 1e-6, 1e-6), "int4": FormPrices(1e-6, 2e-6, 2e-6)}, 1e-4)
    reply = GenerationConfig(mode="ar", max_new_tokens=40)
    first = engine.generate([5, 6, 7], reply)
    assert first.form == "int4" and first.stats.seconds > 2e-4  # the half predicted saved exceeds the price
    engine.settle()
    assert len(opened) == 1 and engine.forms[1].slots is not None and engine.forms[1].opening is None
    assert engine.generate([5, 6, 7], reply).form == "gguf"

    engine, graph, opened = two_forms(tokenizer)
    engine.router = Router({"gguf": FormPrices(1e-6, 1e-6, 1e-6), "int4": FormPrices(1e-6, 2e-6, 2e-6)}, 1e-4)
    engine.forms[1].opener = lambda: (_ for _ in ()).throw(MemoryError("no room for a second form"))
    assert engine.generate([5, 6, 7], reply).form == "int4"
    engine.settle()
    assert engine.forms[1].broken and engine.generate([5, 6, 7], reply).form == "int4"

    engine, graph, opened = two_forms(tokenizer)  # opened for the first request it suits (priced at nothing)
    opener = engine.forms[1].opener
    engine.forms[1].opener = lambda: (time.sleep(0.2), opener())[1]
    plain = engine.generate([5, 6, 7], GenerationConfig(mode="ar", max_new_tokens=300))
    assert plain.form == "gguf" and plain.stats.seconds >= 0.2
    # free text from a short prompt is priced apart from free text over retrieved passages
    assert [request_kind(GenerationConfig(), n) for n in (40, 2000)] == ["chat", "text"]


def test_a_thread_holding_a_stream_is_served_on_a_form_with_a_free_sequence(tokenizer):
    """A request from the thread that holds a stream open on one form goes to a form with a sequence free now,
    whatever the router would prefer: on the held form it would wait for its own stream (a hang, seen in the suite
    once both forms of the kept default engine were open)."""
    import threading

    engine, graph, opened = two_forms(tokenizer)
    engine.generate([5, 6, 7], GenerationConfig(mode="ar", max_new_tokens=300))  # opens gguf
    long_read = GenerationConfig(mode="exact", k=4, max_new_tokens=8)
    outcome: list = []

    def same_thread() -> None:
        stream = engine.stream(list(range(10, 1010)), long_read)  # a long read: the graph's
        next(iter(stream))
        outcome.append(engine.generate(list(range(20, 1020)), long_read).form)  # the graph's too, were it free
        stream.close()

    worker = threading.Thread(target=same_thread, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the request waited for its own thread's stream"
    assert outcome == ["gguf"]


def test_a_request_goes_to_an_open_form_with_a_free_sequence_while_a_stream_sits_on_the_other(tokenizer):
    """A stream left open on the graph (its reader slow, or gone) holds its one sequence: another thread's request the
    graph would suit is served on the open form with a sequence free instead of waiting behind it."""
    import threading

    engine, graph, opened = two_forms(tokenizer)
    engine.generate([5, 6, 7], GenerationConfig(mode="ar", max_new_tokens=300))  # opens gguf
    long_read = GenerationConfig(mode="exact", k=4, max_new_tokens=8)
    stream = engine.stream(list(range(10, 1010)), long_read)
    next(iter(stream))  # on the graph, and left there
    outcome: list = []
    other = threading.Thread(target=lambda: outcome.append(engine.generate(list(range(20, 1020)), long_read).form),
                             daemon=True)
    other.start()
    other.join(timeout=30)
    assert not other.is_alive() and outcome == ["gguf"]
    stream.close()


def test_a_request_too_long_for_a_form_goes_to_one_that_holds_it(tokenizer):
    engine, graph, opened = two_forms(tokenizer, gguf_context=512)
    ends_at_once = [5, 6, len(tokenizer) - 1]  # the next id is 0, the end: a reply that teaches no price
    assert engine.generate(ends_at_once, GenerationConfig(mode="ar", max_new_tokens=600)).form == "int4"
    assert opened == []  # never opened: it could not hold the request
    assert engine.generate([5, 6, 7], GenerationConfig(mode="ar", max_new_tokens=400)).form == "gguf"
    engine.clear_cache()  # every open form's cache
    assert all(len(s) == 0 for f in engine.forms for s in f.slots.sequences)


def test_an_engine_of_one_form_serves_every_request_there(tokenizer):
    engine = FlyEngine(CachedSequence(CountingLM(len(tokenizer))), tokenizer, NgramDrafter(),
                       vocab_size=len(tokenizer), eos_token_ids=[0], max_context=4096)
    result = engine.generate([5, 6], GenerationConfig(mode="ar", max_new_tokens=4))
    assert engine.router is None and result.form is None and result.token_ids == [7, 8, 9, 10]


def test_the_read_price_is_learned_from_long_reads_only():
    r = router()
    r.record("gguf", "tools", 40, 1.8, stopped=True, read=(250, 250 * 0.014))  # llama.cpp reads long prompts faster
    assert abs(r._read["gguf"] - 0.014) < 1e-12
    r.record("gguf", "tools", 40, 1.8, stopped=True, read=(20, 1.0))  # a short read prices a call, not reading
    assert abs(r._read["gguf"] - 0.014) < 1e-12
    assert r.choose("plain", {"gguf": 2000, "int4": 2000}, 10, {"gguf", "int4"}) == "gguf"  # now the faster reader


def test_a_one_shot_request_opens_only_the_form_that_serves_it_soonest(monkeypatch):
    """`fly generate` serves one request: the loader picks its form before anything opens, by the router's own
    prediction over the forms tuning held; a set precision, a seeded request or a single form change nothing."""
    from types import SimpleNamespace

    from fly_runtime import loader, tuning
    from fly_runtime.backends import llama_cpp_backend
    from fly_runtime.loader import ModelSettings, form_for_one_request

    model = SimpleNamespace(exported_onnx=False, gguf="model.gguf", has_graph=lambda p: p == "int4")
    held = ["gguf"]
    monkeypatch.setattr(loader, "resolve_model", lambda name: model)
    monkeypatch.setattr(loader, "target_precision", lambda settings, m, tokenizer=None: "int4")
    monkeypatch.setattr(tuning, "recorded_forms", lambda m: ({"gguf": GGUF_MS, "int4": INT4_MS}, held))
    learned = {}
    monkeypatch.setattr(tuning, "recorded_prices", lambda m: learned)
    monkeypatch.setattr(llama_cpp_backend, "available", lambda: True)
    auto = ModelSettings()
    assert form_for_one_request(auto, 40, GenerationConfig(max_new_tokens=256)) == "gguf"  # a free reply
    assert form_for_one_request(auto, 40, GenerationConfig(mode="ar", max_new_tokens=256)) == "gguf"
    assert form_for_one_request(auto, 3000, GenerationConfig(max_new_tokens=64)) == "int4"  # a long read
    # earlier processes here found the graph answering short prompts at 19 ms a token: a free reply goes there now
    learned["written"] = [["int4", "chat", 0.019]]
    assert form_for_one_request(auto, 40, GenerationConfig(max_new_tokens=256)) == "int4"
    learned.clear()
    assert form_for_one_request(auto, 40, GenerationConfig(temperature=0.7, seed=1)) is None  # stays first
    assert form_for_one_request(ModelSettings(precision="int4"), 40, GenerationConfig()) is None
    held.clear()
    assert form_for_one_request(auto, 40, GenerationConfig()) is None  # nothing held beside the choice


def test_long_reads_go_to_llama_cpp_where_its_prompt_reader_is_expected_to_pay():
    """A prompt reader on the llama.cpp form (bf16_reader.ReaderSlot, not opened here), predicted to pay: long reads
    on llama.cpp are priced at its price, so they go there (it opens within them once they have paid for its
    opening) instead of opening the graph, a second copy of the weights, to read them (a served default measured
    7.1 GB that way, 4.9 GB this way); reads other forms serve still count toward its opening; the reads it serves do
    not teach llama.cpp's own read price; a reader dropped as not worth its memory prices nothing."""
    from pathlib import Path

    from fly_runtime.backends.bf16_reader import ReaderSlot

    r, both = router(), {"gguf", "int4"}
    slot = ReaderSlot(Path("unused.gguf"), reader_ms=3.0, open_seconds=20.0)
    slot.own_ms = GGUF_MS["64"] / 64  # llama.cpp's timed read: 27 ms a token
    r.readers = {"gguf": slot}
    rag = {"gguf": 700, "int4": 700}
    assert not slot.ready() and r.choose("tools", rag, 60, {"gguf"}) == "gguf"  # the graph is not opened for it
    assert r.choose("tools", rag, 60, both) == "gguf"
    r.record("int4", "tools", 60, 3.0, True, read=(700, 14.4))  # 14.4 s there; the reader would have taken 2.1
    assert slot.missed == pytest.approx(14.4 - 2.1)
    learned = r.learned()["read"].get("gguf")
    slot.reader = object()  # as if opened by llama.cpp's backend on a read
    r.record("gguf", "tools", 60, 3.0, True, read=(700, 2.5))
    assert r.learned()["read"].get("gguf") == learned  # llama.cpp's own read price stays its own
    assert r.choose("plain", {"gguf": 40, "int4": 40}, 500, both) == "gguf"
    slot.reader, slot.reader_ms = None, 30.0  # its reads turned out slower than llama.cpp's: dropped, never again
    assert slot.for_read(700) is None and not slot.expected()
    assert r.choose("tools", rag, 60, both) == "int4"  # the graph reads faster than llama.cpp alone


def test_one_prompt_reader_reads_for_every_form_it_has_a_slot_on():
    """The reader reads for the graph too (bf16_reader.ReaderSlot.for_form: one reader, one copy of its weights):
    long reads there are priced at its price while it is expected to pay there, so a read-heavy request goes to the
    form that verifies cheaply instead of the one that steps fastest; a form it is dropped on (its reads turned out
    slower than the form's own) keeps its own price, while the other keeps the reader."""
    from pathlib import Path

    from fly_runtime.backends.bf16_reader import ReaderSlot

    # the AMX Xeon's timed passes (twenty-first session): llama.cpp steps a little faster, the graph verifies cheaper
    gguf_ms, int4_ms = {"1": 79.0, "9": 304.0, "64": 1158.0}, {"1": 84.0, "9": 202.0, "64": 952.0}
    r, both = Router({"gguf": FormPrices.of(gguf_ms), "int4": FormPrices.of(int4_ms)}, 5.0), {"gguf", "int4"}
    llama = ReaderSlot(Path("unused.gguf"), reader_ms=3.0, open_seconds=20.0)
    llama.own_ms = gguf_ms["64"] / 64
    graph = llama.for_form(int4_ms["64"] / 64)
    r.readers = {"gguf": llama, "int4": graph}
    rag = {"gguf": 700, "int4": 700}
    assert r.predict("int4", "tools", 700, 60) < r.predict("gguf", "tools", 700, 60)
    assert r.choose("tools", rag, 60, both) == "int4"
    llama.reader = object()  # opened by a read on either form: open for both
    assert graph.reader is llama.reader and graph.ready()
    llama.reader_ms = 16.0  # now slower than the graph's own reads (14.9 ms a token), faster than llama.cpp's (18.1)
    assert graph.for_read(700) is None and graph.dropped and not graph.expected()
    assert llama.reader is not None and llama.for_read(700) is llama.reader  # still faster than llama.cpp's
    assert r.predict("int4", "tools", 700, 60) == pytest.approx(
        700 * int4_ms["64"] / 64 / 1000 + r.predict("int4", "tools", 0, 60))


def test_the_first_form_prices_a_read_at_the_readers_price_only_where_it_is_expected_to_read():
    """load_engine's first form (loader.first_form) prices a typical turn's read as the router does: at the prompt
    reader's price on a form where the reader is expected to read (promising, not dropped), else at the form's own.
    Here the graph reads at 4 ms a token, under 1.5x the reader's 3: the reader is not expected there, so the graph's
    turn keeps its own read and llama.cpp, which the reader is expected to speed up, serves first."""
    from pathlib import Path

    from fly_runtime.backends.bf16_reader import ReaderSlot
    from fly_runtime.loader import first_form

    graph_ms = {"1": 57.0, "9": 170.0, "64": 256.0}  # steps and verifies cheaply, reads 4 ms a token
    ms = {"gguf": GGUF_MS, "int4": graph_ms}
    slot = ReaderSlot(Path("unused.gguf"), reader_ms=3.0, open_seconds=20.0)
    slot.own_ms = GGUF_MS["64"] / 64
    graph = slot.for_form(own_ms=graph_ms["64"] / 64)
    assert slot.expected() and not graph.expected()
    assert first_form(ms, {"gguf": slot, "int4": graph}) == "gguf"
    graph.own_ms = 20.0  # reads slower there: the reader is expected there too, and the graph's cheap rows win
    assert graph.expected() and first_form(ms, {"gguf": slot, "int4": graph}) == "int4"
    assert first_form(ms, {}) == "int4"  # no reader: the graph reads faster than llama.cpp as well


def test_held_forms_open_at_load_only_where_free_memory_holds_them_and_a_reserve(monkeypatch, tmp_path):
    """A served engine opens its held forms beside the requests at load where the memory free holds their files'
    sizes and ``OPEN_RESERVE`` beside; with less free, a form waits until the requests it suits have paid for it."""
    from types import SimpleNamespace

    import psutil

    from fly_runtime import loader

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 3000)
    graph = tmp_path / "int4"
    (graph / "sub").mkdir(parents=True)
    (graph / "model.onnx").write_bytes(b"\0" * 1000)
    (graph / "sub" / "model.onnx.data").write_bytes(b"\0" * 500)
    model = SimpleNamespace(gguf=gguf, graph_folder=lambda p: graph)
    monkeypatch.setattr(loader, "OPEN_RESERVE", 10_000)
    free = {"available": 0}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(**free))
    for available, forms, room in [(13_000, ["gguf"], True), (12_999, ["gguf"], False), (11_500, ["int4"], True),
                                   (14_499, ["gguf", "int4"], False), (14_500, ["gguf", "int4"], True)]:
        free["available"] = available
        assert loader._room_for(model, forms) is room, (available, forms)


def test_a_kind_served_on_one_form_is_priced_on_the_other_by_the_survival_its_drafts_showed():
    """Summaries served first on llama.cpp, where drafted rows cost most of a step: their drafts survived 3 positions
    in 4, which the graph's cheap rows turn into far more tokens a pass, so the graph is predicted faster for the next
    one (the engine's overhead beyond llama.cpp's timed passes carried over); a kind whose drafts survive little
    stays on the faster stepper."""
    r, both = router(), {"gguf", "int4"}
    # as timed on the AMX Xeon, llama.cpp's row 0.38 of a step, the graph's 0.19; both read by the prompt reader
    r.prices["gguf"] = FormPrices.of({"1": 64.6, "9": 260.3, "64": 1000.0})
    r.prices["int4"] = FormPrices.of({"1": 71.0, "9": 176.9, "64": 1000.0})
    assert r.choose("text", {"gguf": 700, "int4": 700}, 128, both) == "gguf"  # at the prior's survival: a tie
    modeled = r.prices["gguf"].written("text", 0.75)
    r.record("gguf", "text", 128, 128 * modeled * 1.1, True, drafts=(60, 20))
    assert r._survival["text"] == pytest.approx(0.7 * 0.3 + 0.3 * 0.75)
    for _ in range(4):
        r.record("gguf", "text", 128, 128 * modeled * 1.1, True, drafts=(60, 20))
    assert r.choose("text", {"gguf": 700, "int4": 700}, 128, both) == "int4"
    graph = r.predict("int4", "text", 0, 128, reply=100) / 100
    assert graph == pytest.approx(r.prices["int4"].written("text", r._survival["text"]) * r._written["gguf", "text"]
                                  / r.prices["gguf"].written("text", r._survival["text"]))
    r.record("gguf", "chat", 128, 128 * 0.07, True, (40, 0.6), drafts=(2, 30))  # a chat reply: little survives
    assert r.choose("chat", {"gguf": 40, "int4": 40}, 128, both) == "gguf"
    r.record("gguf", "chat", 128, 128 * 0.07, True, (40, 0.6), drafts=(2, 5))  # too few drafts to teach anything
    assert r._survival["chat"] == pytest.approx(0.7 * 0.1 + 0.3 * 2 / 32)


def test_each_request_starts_its_lookup_gate_from_its_kinds_learned_survival(tokenizer, monkeypatch):
    """The router's survival for a kind is where a routed request's lookup gate starts; before any was learned,
    the policy's own prior."""
    from fly_runtime.adaptive import DraftPolicy

    engine, _, _ = two_forms(tokenizer)
    seen = []
    original = DraftPolicy.__init__

    def spy(self, config, plain_step_seconds, costs=None, lookup_prior=None):
        seen.append(lookup_prior)
        original(self, config, plain_step_seconds, costs, lookup_prior)

    monkeypatch.setattr(DraftPolicy, "__init__", spy)
    config = GenerationConfig(mode="fly", max_new_tokens=4)
    engine.generate([5, 6, 7, 5, 6], config)
    engine.router._survival["chat"] = 0.12
    engine.generate([5, 6, 7, 5, 6], config)
    assert seen == [None, 0.12]
