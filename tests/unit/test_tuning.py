"""Choosing the target's precision from measured costs (pure logic; the measuring runs on tiny graphs in
tests/test_onnx_build.py)."""

from fly_runtime.bench.runner import ModeSpec
from fly_runtime.tuning import ROW_TOLERANCE, describe, machine_id, pick

# measured on a 2-core AVX2 EPYC: int8 and int4 kernels round a one-token step differently from a pass
MEASURED = {"fp32": {"1": 261, "9": 429, "row_delta": 4e-5},
            "int8": {"1": 114, "9": 461, "row_delta": 0.19},
            "int4": {"1": 59, "9": 241, "row_delta": 0.21}}


def test_the_fastest_step_wins_only_where_steps_and_passes_agree():
    assert pick(MEASURED) == "fp32"
    consistent = {p: dict(c, row_delta=0.0) for p, c in MEASURED.items()}
    assert pick(consistent) == "int4"
    assert pick({"int4": MEASURED["int4"]}) == "fp32"  # nothing agrees: the source weights as they are


def test_the_record_says_why_a_faster_graph_was_passed_over():
    text = describe(MEASURED)
    assert "int4 59 / 241 ms, rows differ by 0.21" in text and "fp32 261 / 429 ms;" in text
    assert MEASURED["fp32"]["row_delta"] < ROW_TOLERANCE


def test_machine_id_names_the_cpu_and_its_vector_units():
    ident = machine_id()
    assert ident.endswith(f"x{__import__('os').cpu_count()}") and "[" in ident


def test_bench_modes_take_a_precision_and_a_k():
    assert ModeSpec.parse("ar:int4") == ModeSpec("ar:int4", "ar", None, "int4")
    assert ModeSpec.parse("fly:k8:int8") == ModeSpec("fly:k8:int8", "fly", 8, "int8")
    assert ModeSpec.parse("llama-cpp").plain and ModeSpec.parse("ar:int4").plain
    assert not ModeSpec.parse("exact").plain
