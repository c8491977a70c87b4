"""An Optimum ONNX export as a model reference: the built-in drafter, exported here by optimum-cli (offline, from
the cached float32 folder), drafts for the target, and exact decoding stays identical to plain decoding."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from fly_runtime import GenerationConfig, ModelSettings
from fly_runtime.chat import encode_chat
from fly_runtime.errors import InvalidSettingsError
from fly_runtime.loader import DEFAULT_DRAFT, load_engine
from fly_runtime.sources import resolve_model
from fly_runtime.sources.resolve import is_onnx_export


@pytest.fixture(scope="module")
def exported_drafter():
    """The export, made once per version of the exporter and of the model, and kept in the cache's
    ``test-fixtures`` (`fly models prune` deletes it): the export is the test's input, and slow to make."""
    from importlib.metadata import version

    from fly_runtime.sources.cache import atomic_directory, cache_dir

    model = resolve_model(DEFAULT_DRAFT)
    versions = "-".join(version(p) for p in ("optimum-onnx", "optimum", "transformers", "torch", "onnx"))
    folder = cache_dir() / "test-fixtures" / f"optimum-export-{model.key}-{versions}"
    if not (folder / "model.onnx").is_file():
        cli = Path(sys.executable).parent / "optimum-cli"  # the dev extra installs optimum-onnx
        with atomic_directory(folder) as scratch:
            proc = subprocess.run([str(cli), "export", "onnx", "--model", str(model.weights()), "--task",
                                   "text-generation-with-past", str(scratch)], capture_output=True, text=True,
                                  timeout=1200)
            assert proc.returncode == 0, proc.stderr[-2000:]
    return folder


def test_an_optimum_export_drafts_and_exact_stays_identical_to_ar(exported_drafter):
    assert is_onnx_export(exported_drafter) and resolve_model(str(exported_drafter)).exported_onnx
    # its own fp32 pair (where rows compute alike), dropped after the test: the export drafts for the same model's
    # fp32 graph as fly builds it (the 0.5B: two float32 copies of the 1.5B would take half the machine)
    engine = load_engine(ModelSettings(target=DEFAULT_DRAFT, draft=str(exported_drafter), precision="fp32"))
    try:
        assert engine.draft_name == str(exported_drafter)
        ids = encode_chat(engine.tokenizer, [
            {"role": "user", "content": "Write a Python function that checks whether a number is prime."}])
        # a fixed K drafts every round: the price check may find model drafts too dear on a fast CPU
        ar, exact = (engine.generate(ids, GenerationConfig(mode=mode, max_new_tokens=48, k=4))
                     for mode in ("ar", "exact"))
        assert exact.token_ids == ar.token_ids
        assert exact.stats.drafter_forwards > 0 and exact.stats.native_accepted > 0  # the export drafted
    finally:
        del engine
        gc.collect()


def test_an_export_on_the_torch_backend_is_a_clear_error(exported_drafter):
    with pytest.raises(InvalidSettingsError, match="ONNX export"):
        load_engine(ModelSettings(draft=str(exported_drafter), backend="torch", device="cpu"))
