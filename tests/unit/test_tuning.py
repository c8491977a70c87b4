"""Choosing the target's precision from measured costs (pure logic; the measuring runs on tiny graphs in
tests/test_onnx_build.py)."""

import time
from types import SimpleNamespace

from fly_runtime.bench.runner import ModeSpec

import pytest

from fly_runtime import tuning
from fly_runtime.tuning import (
    AGREEMENT_FLOOR,
    describe,
    drafter_share,
    drafts_can_pay,
    held_forms,
    machine_candidates,
    machine_id,
    pick,
)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The choices below are made on a quiet machine, whatever else runs beside the tests; tests of the busy rule
    set it themselves."""
    monkeypatch.setattr(tuning, "others_busy", lambda seconds=0.5: 0.0)


# measured on a 2-core AVX2 EPYC (2026-12-02): the GGUF-grid int4 graph agrees with the fp32 weights on 99.3%
# of teacher-forced tokens, a builder re-quantisation of it on 89.9%
MEASURED = {"fp32": {"1": 261, "9": 429, "row_delta": 4e-5},
            "int8": {"1": 114, "9": 461, "row_delta": 0.19, "agreement": 0.985},
            "int4": {"1": 97, "9": 323, "row_delta": 0.24, "agreement": 0.993}}


def test_the_fastest_graph_that_is_still_the_model_wins():
    assert pick(MEASURED) == "int4"  # its steps and passes differ: reported, not a gate
    second_rounding = dict(MEASURED, int4=dict(MEASURED["int4"], agreement=0.899))
    assert pick(second_rounding) == "int8"
    assert pick({"int4": second_rounding["int4"]}) == "fp32"  # nothing qualifies: the source weights as they are
    assert pick({"int4": dict(MEASURED["int4"], agreement=AGREEMENT_FLOOR)}) == "int4"


def test_the_form_that_serves_a_typical_turn_fastest_wins_not_the_fastest_step():
    """Pass times (ms: one step, nine tokens, a 64-token prompt read), 2026-12-03 on an AVX-512 EPYC: llama.cpp
    steps faster, but its verified rows cost about a step (no free draft pays) and it reads prompts slower; the
    int4 graph's rows cost a fifth of a step. On the AVX2 EPYC the same graph read prompts at half the speed."""
    gguf = {"1": 45, "9": 360, "64": 1184}
    int4 = {"1": 68, "9": 195, "64": 960, "agreement": 0.992}
    assert pick({"gguf": gguf, "int4": int4}) == "int4"
    assert tuning.turn_seconds(int4) < tuning.turn_seconds(gguf)
    assert pick({"gguf": gguf, "int4": dict(int4, **{"64": 2300})}) == "gguf"
    # the reply's part: plain steps where a row costs about a step, faster than steps where rows are cheap
    write = {name: tuning.turn_seconds(dict(ms, **{"64": 0})) for name, ms in (("gguf", gguf), ("int4", int4))}
    assert write["gguf"] == pytest.approx(tuning.TURN_WRITE * 0.045)
    assert write["int4"] < tuning.TURN_WRITE * 0.068
    assert "a typical turn" in describe({"gguf": gguf})


def test_the_record_says_why_a_faster_graph_was_passed_over():
    text = describe({"int4": dict(MEASURED["int4"], agreement=0.899), "int8": MEASURED["int8"]})
    assert "a typical turn" not in text  # an older record, without a timed prompt read
    assert "int4 97 / 323 ms, agrees 89.9% (< 97%: not the model), steps and passes differ by 0.24" in text
    assert "int8 114 / 461 ms, agrees 98.5%" in text


def test_int8_is_a_candidate_only_where_the_cpu_multiplies_int8():
    flags = open("/proc/cpuinfo").read()
    has_dot = any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp"))
    assert machine_candidates() == (("int4", "int8") if has_dot else ("int4",))


@pytest.mark.parametrize("llama_cpp", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_a_gguf_model_is_timed_as_it_is_its_written_int4_and_the_graphs_already_built(monkeypatch, llama_cpp, direct):
    """An int4 graph written from the GGUF (seconds) is timed beside it; one that would need a float32 copy of the
    model first (gigabytes) is built only where asked for."""
    monkeypatch.setattr("fly_runtime.backends.llama_cpp_backend.available", lambda: llama_cpp)
    built: set[str] = set()
    model = SimpleNamespace(gguf="model.gguf", has_graph=lambda p: p in built, builds_from_gguf=lambda: direct)
    graphs = ("int4",) if direct else ()
    assert machine_candidates(model) == (("gguf", *graphs) if llama_cpp else ("int4",))
    built.add("int8")
    assert machine_candidates(model) == (("gguf", *graphs, "int8") if llama_cpp else (*graphs, "int8"))


def test_a_drafter_is_fetched_only_where_model_drafts_could_pay():
    # one-token step / nine-token pass, ms, 2026-12-03 (AVX-512 EPYC): llama.cpp, the int4 graph
    assert not drafts_can_pay({"1": 45, "9": 360})  # a verified row costs about a step
    assert drafts_can_pay({"1": 65, "9": 195})  # a row costs a fifth of one
    # ... but not for a drafter whose steps cost 0.44 of the target's (the built-in pair's file sizes)
    share = drafter_share("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert 0.4 < share < 0.5 and not drafts_can_pay({"1": 65, "9": 195}, share)
    assert drafter_share("my-model", "qwen2.5-coder-0.5b-instruct") == 0.0  # unknown sizes: priced free
    # beside the target at fp32 (6.6 times the bytes a step) the same drafter pays: MEASURED's fp32 passes
    fp32 = drafter_share("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "fp32")
    assert fp32 < 0.1 and drafts_can_pay(MEASURED["fp32"], fp32)
    assert drafts_can_pay(MEASURED["fp32"])


def test_a_record_of_other_candidates_is_timed_again(monkeypatch, tmp_path):
    """llama-cpp-python installed, or a graph built, since the choice: the choice is made again."""
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path))
    model = SimpleNamespace(key="k" * 16, name="m", gguf="model.gguf")
    tuning._record(f"{machine_id()}|{model.key}", {"model": "m", "precision": "int4", "ms": {}, "candidates": ["int4"]})
    assert tuning.choose_precision(model, candidates=("int4",)) == "int4"  # as recorded, nothing opened
    monkeypatch.setattr("fly_runtime.backends.registry.open_target", lambda m, p, **kw: pytest.fail(f"opened {p}") if p != "gguf"
                        else SimpleNamespace())
    monkeypatch.setattr(tuning, "measure", lambda backend, **kw: {"1": 30.0, "9": 250.0, "row_delta": 0.0})
    assert tuning.choose_precision(model, candidates=("gguf",)) == "gguf"
    assert tuning.recorded_precision(model.key)["candidates"] == ["gguf"]


def _gguf_model(monkeypatch, tmp_path) -> SimpleNamespace:
    """A GGUF model whose int4 graph is not written yet (writing it makes a folder in a fresh cache)."""
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "onnx" / "m-int4"
    return SimpleNamespace(key="k" * 16, name="m", gguf="model.gguf", graph_folder=lambda p: folder,
                           has_graph=lambda p: (folder / "model.onnx").is_file(), on_own_grid=lambda p: True,
                           build_onnx=lambda p: (folder.mkdir(parents=True), (folder / "model.onnx").write_text("g")))


@pytest.mark.parametrize("graph_wins", [True, False])
def test_a_graph_written_only_to_be_timed_stays_only_if_chosen(monkeypatch, tmp_path, graph_wins):
    """The int4 graph written from the GGUF for the comparison is timed one form at a time, not checked against a
    reference (it is on the file's own grid), and deleted where the GGUF wins; the record keeps both timings, so
    the choice is not made again."""
    model = _gguf_model(monkeypatch, tmp_path)
    open_now: list[str] = []

    def open_target(m, p, **kw):
        assert not open_now, "two forms open at once"
        open_now.append(p)
        return SimpleNamespace(form=p, close=open_now.clear)

    monkeypatch.setattr("fly_runtime.backends.registry.open_target", open_target)
    monkeypatch.setattr(tuning, "reference", lambda *a: pytest.fail("a graph on its own grid was checked"))
    fast, slow = {"1": 40.0, "9": 120.0, "64": 600.0}, {"1": 45.0, "9": 400.0, "64": 1600.0}
    monkeypatch.setattr(tuning, "measure", lambda backend, **kw: dict(
        (fast if (backend.form == "int4") == graph_wins else slow), row_delta=0.0))
    choice = tuning.choose_precision(model, tokenizer=object(), candidates=("gguf", "int4"))
    assert choice == ("int4" if graph_wins else "gguf")
    assert model.has_graph("int4") == graph_wins
    record = tuning.recorded_precision(model.key)
    assert sorted(record["ms"]) == ["gguf", "int4"] and record["candidates"] == ["gguf", "int4"]
    monkeypatch.setattr("fly_runtime.backends.registry.open_target", lambda m, p, **kw: pytest.fail(f"opened {p}"))
    assert tuning.choose_precision(model, candidates=("gguf", "int4")) == choice  # kept: nothing opened again


# each wins something: llama.cpp steps faster, the graph reads faster (and llama.cpp wins a typical turn)
SPLIT = {"gguf": {"1": 40.0, "9": 360.0, "64": 1344.0}, "int4": {"1": 80.0, "9": 200.0, "64": 1200.0}}


def test_a_form_that_steps_or_reads_faster_is_held_beside_the_chosen_one():
    assert pick(SPLIT) == "gguf" and held_forms(SPLIT, "gguf") == ["int4"]  # reads 11% faster
    assert held_forms(SPLIT, "int4") == ["gguf"]  # steps twice as fast
    slower = {"gguf": SPLIT["gguf"], "int4": {"1": 41.0, "9": 200.0, "64": 1344.0}}  # faster at neither
    assert held_forms(slower, "gguf") == []
    slower["int4"]["64"] = 1300.0  # reads 3% faster: held (holding costs nothing until the router opens it)
    assert held_forms(slower, "gguf") == ["int4"]
    unfaithful = {"gguf": SPLIT["gguf"], "int4": {**SPLIT["int4"], "agreement": AGREEMENT_FLOOR - 0.01}}
    assert held_forms(unfaithful, "gguf") == []  # not the model: never served
    assert held_forms({**SPLIT, "fp32": {"1": 20.0, "9": 30.0, "64": 200.0}}, "gguf") == ["int4"]  # fp32: too big


def test_a_graph_written_to_be_timed_stays_where_it_is_held(monkeypatch, tmp_path):
    model = _gguf_model(monkeypatch, tmp_path)
    monkeypatch.setattr("fly_runtime.backends.registry.open_target", lambda m, p, **kw: SimpleNamespace(form=p))
    monkeypatch.setattr(tuning, "measure", lambda backend, **kw: dict(SPLIT[backend.form], row_delta=0.0))
    assert tuning.choose_precision(model, tokenizer=object(), candidates=("gguf", "int4")) == "gguf"
    assert model.has_graph("int4")  # not chosen, but held: kept
    assert tuning.recorded_forms(model) == (tuning.recorded_precision(model.key)["ms"], ["int4"])


def test_machine_id_names_the_cpu_and_its_vector_units():
    ident = machine_id()
    assert ident.endswith(f"x{__import__('os').cpu_count()}") and "[" in ident


def test_bench_modes_take_a_precision_and_a_k():
    assert ModeSpec.parse("ar:int4") == ModeSpec("ar:int4", "ar", None, "int4")
    assert ModeSpec.parse("fly:k8:int8") == ModeSpec("fly:k8:int8", "fly", 8, "int8")
    assert ModeSpec.parse("llama-cpp").plain and ModeSpec.parse("ar:int4").plain
    assert not ModeSpec.parse("exact").plain


def test_backends_are_opened_by_name_with_the_sequences_asked_for(monkeypatch):
    """The loader and the tuning open every form through one registry; a llama.cpp target is opened with the
    sequences batched decoding asks for, on this machine's cores."""
    import os

    from fly_runtime.backends import registry

    opened = []
    monkeypatch.setitem(registry.FACTORIES, "gguf", lambda *args: opened.append(args) or "llama.cpp")
    monkeypatch.setitem(registry.FACTORIES, "onnx", lambda *args: opened.append(args) or "graph")
    assert registry.open_backend("m", "onnx", "gguf", sequences=16) == "llama.cpp"
    assert registry.open_target("m", "int4", context=2048) == "graph"
    assert opened == [("m", "gguf", None, os.cpu_count(), 16, 0), ("m", "int4", None, os.cpu_count(), 1, 2048)]
    with pytest.raises(TypeError):  # device, threads and sequences are named, never taken by position
        registry.open_backend("m", "onnx", "gguf", None, 16)


def test_other_processes_busy_count_and_this_ones_own_work_does_not(monkeypatch):
    """Judged against what else runs now (the bounds hold on a loaded machine too): a process spinning beside this
    one adds a core, up to the machine's count; this process's own spinning thread adds nothing."""
    import os
    import subprocess
    import sys
    import threading

    monkeypatch.undo()  # the real measure
    from fly_runtime.tuning import others_busy

    before = others_busy(1.0)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)  # started
        assert others_busy(1.0) >= min(before + 0.6, os.cpu_count() - 0.4)
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()
    own = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])  # this process spins a core
    own.start()
    try:
        assert others_busy(1.0) <= before + 0.4
    finally:
        stop.set()
        own.join()


def test_forms_timed_on_a_busy_machine_are_timed_again_once_it_is_quiet(monkeypatch, tmp_path):
    """A test run beside tuning once doubled llama.cpp's step and left the graph's reads alone: the slower form was
    chosen. Such a record says so, serves while the machine stays busy, and is replaced once a process finds it
    quiet."""
    model = _gguf_model(monkeypatch, tmp_path)
    busy = {"cores": 1.6}
    monkeypatch.setattr(tuning, "others_busy", lambda seconds=0.5: busy["cores"])
    opened: list[str] = []
    monkeypatch.setattr("fly_runtime.backends.registry.open_target",
                        lambda m, p, **kw: (opened.append(p), SimpleNamespace(form=p))[1])
    # under load llama.cpp's timings suffer most: the graph looks faster
    loaded = {"gguf": {"1": 127.0, "9": 941.0, "64": 3209.0}, "int4": {"1": 178.0, "9": 471.0, "64": 2810.0}}
    quiet = {"gguf": {"1": 69.0, "9": 402.0, "64": 1561.0}, "int4": {"1": 84.0, "9": 322.0, "64": 2053.0}}
    timings = {"now": loaded}
    monkeypatch.setattr(tuning, "measure", lambda backend, **kw: dict(timings["now"][backend.form], row_delta=0.0))
    assert tuning.choose_precision(model, tokenizer=object(), candidates=("gguf", "int4")) == "int4"
    assert tuning.recorded_precision(model.key)["busy_cores"] == 1.6
    opened.clear()
    assert tuning.choose_precision(model, candidates=("gguf", "int4")) == "int4" and not opened  # still busy: kept
    busy["cores"], timings["now"] = 0.1, quiet
    assert tuning.choose_precision(model, candidates=("gguf", "int4")) == "gguf" and opened  # quiet: timed again
    assert "busy_cores" not in tuning.recorded_precision(model.key)
    opened.clear()
    assert tuning.choose_precision(model, candidates=("gguf", "int4")) == "gguf" and not opened
