"""The first run a user makes: an empty cache but for the downloaded GGUF, then `fly generate`. It keeps only what
it runs (the GGUF, its tokenizer, the graph written from it where that serves turns faster here) and fits a
laptop's memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fly_runtime.backends import llama_cpp_backend
from fly_runtime.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from fly_runtime.sources import BUILTIN_MODELS
from fly_runtime.sources.builtin import gguf_path

pytestmark = pytest.mark.skipif(not llama_cpp_backend.available(), reason="llama-cpp-python is not installed")

PEAK_RSS_BYTES = 4e9  # the first run's budget: about the model (1.1 GB) with its cache and buffers


def _seed_cache(root: Path) -> None:
    """A cache holding only the target's verified GGUF (as the download leaves it), linked, not copied."""
    source = gguf_path(BUILTIN_MODELS[DEFAULT_TARGET])
    (root / "gguf").mkdir(parents=True)
    for path in (source, source.with_name(source.name + ".sha256")):
        try:
            os.link(path, root / "gguf" / path.name)
        except OSError:
            shutil.copy2(path, root / "gguf" / path.name)


def _fly(root: Path, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """`fly ARGS` with ``root`` as the cache, and the process's peak resident memory in bytes: its VmHWM, the
    high-water mark of its own address space (getrusage's maxrss of a child would count the forking test
    process's own peak)."""
    peak_file = root.parent / "peak.txt"
    code = ("import sys; from fly_runtime.cli import main; rc = main(sys.argv[1:]); "
            "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]; "
            f"open({str(peak_file)!r}, 'w').write(hwm); sys.exit(rc)")
    env = dict(os.environ, FLY_CACHE_DIR=str(root), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    return proc, int(peak_file.read_text()) * 1024


def test_the_first_answer_keeps_only_what_it_runs_and_fits_a_laptop(tmp_path):
    """The GGUF under llama.cpp and its int4 graph written from it are timed; the form chosen is all that stays
    beside the GGUF (the other graph is deleted), no float32 weights are written, and a drafter comes only where
    model drafts could pay."""
    from fly_runtime.tuning import drafter_share, drafts_can_pay

    root = tmp_path / "cache"
    _seed_cache(root)
    proc, peak = _fly(root, "generate", "--max-new-tokens", "16", "Say hello in five words.")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() and "fly:" not in proc.stdout  # the answer alone; progress went to stderr
    assert peak < PEAK_RSS_BYTES, f"peak RSS {peak / 1e9:.2f} GB"

    files = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
    assert not [f for f in files if f.suffix == ".safetensors"], "float32 weights were written"
    records = json.loads((root / "tuning.json").read_text())
    record = next(r for k, r in records.items() if len(k.split("|")) == 2)
    choice = record["precision"]
    assert sorted(record["candidates"]) == ["gguf", "int4"] and f"target {choice}" in proc.stderr
    drafter_files = [f for f in files if DEFAULT_DRAFT in str(f)]
    assert bool(drafter_files) == drafts_can_pay(record["ms"][choice], drafter_share(DEFAULT_TARGET, DEFAULT_DRAFT, choice))
    graphs = {f.parts[1] for f in files if f.parts[0] == "onnx" and DEFAULT_DRAFT not in str(f)}
    # the int4 graph where it serves: chosen, or held beside the GGUF for the requests it finishes sooner
    assert len(graphs) == (choice != "gguf" or "int4" in record["held"]) and all("-int4-" in g for g in graphs)
    target_bytes = sum((root / f).stat().st_size for f in files if DEFAULT_DRAFT not in str(f))
    assert target_bytes < 2.5 * BUILTIN_MODELS[DEFAULT_TARGET].size  # the GGUF and at most one graph of it

    listing, _ = _fly(root, "models", "list")
    assert listing.returncode == 0 and "read by nothing" not in listing.stdout  # all of it is in use
    assert "model file" in listing.stdout and "tokenizer" in listing.stdout


def test_prune_deletes_what_nothing_here_reads(tmp_path):
    root = tmp_path / "cache"
    _seed_cache(root)
    stale = root / "onnx" / f"{DEFAULT_TARGET}-{'0' * 16}-int8-g1"  # a graph of an older fly
    stale.mkdir(parents=True)
    (stale / "model.onnx").write_bytes(b"x" * 1000)
    weights = root / "hf" / "some-model" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"x" * 1000)
    (weights.parent / "config.json").write_text("{}")
    fixture = root / "test-fixtures" / "optimum-export-x" / "model.onnx"  # what the test suite made once
    fixture.parent.mkdir(parents=True)
    fixture.write_bytes(b"x" * 1000)
    listing, _ = _fly(root, "models", "list")
    assert "another version of fly" in listing.stdout and "float32 weights" in listing.stdout
    assert "test suite" in listing.stdout
    pruned, _ = _fly(root, "models", "prune")
    assert pruned.returncode == 0 and "deleting" in pruned.stderr
    assert not stale.exists() and not weights.exists() and not fixture.exists()
    assert (weights.parent / "config.json").is_file() and gguf_path(BUILTIN_MODELS[DEFAULT_TARGET]).name in \
        [p.name for p in (root / "gguf").iterdir()]
