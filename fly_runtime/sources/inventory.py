"""What the fly cache holds, what each entry is for, and which entries nothing here reads.

The cache grows by what users ask for (a graph at a precision, float32 weights for the torch backend, a
benchmark's data) and by what older versions of fly built. ``fly models list`` shows each entry with its size
and use; ``fly models prune`` deletes those that the forms this machine runs do not read (``in_use``: the graph
folders tuning chose here, with the reason), all of which fly rebuilds if they are asked for again.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fly_runtime.sources.cache import cache_dir
from fly_runtime.sources.convert import GRAPH_VERSIONS

# convert.graph_folder_name read back
_GRAPH = re.compile(r"^(?P<model>.+)-(?P<key>[0-9a-f]{16})-(?P<precision>fp32|int8|int4)-g(?P<version>\d+)$")


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    use: str  # what reads it, or why nothing does
    needed: bool  # read by what runs here (kept by prune)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def inventory(in_use: dict[str, str], root: Path | None = None) -> list[Entry]:
    """Every entry of the cache (GGUF files, tokenizer folders and their float32 weights, graphs, downloads,
    references, benchmark data), sized, with its use. ``in_use``: graph folder name -> why it is read here."""
    root = root or cache_dir()
    entries: list[Entry] = []
    for path in sorted(root.glob("gguf/*.gguf")):
        entries.append(Entry(path, _size(path), "model file (llama.cpp runs it; graphs and tokenizers come from it)",
                             True))
    for folder in sorted(p for p in root.glob("hf/*") if p.is_dir()):
        weights = sorted(folder.glob("*.safetensors*"))
        entries.append(Entry(folder, _size(folder) - sum(_size(w) for w in weights), "tokenizer, config, chat template",
                             True))
        if weights:
            entries.append(Entry(folder / "*.safetensors*", sum(_size(w) for w in weights),
                                 "float32 weights: read by backend='torch' and graph builds only; converted again "
                                 "from the GGUF when asked for", False))
    for folder in sorted(p for p in root.glob("onnx/*") if p.is_dir() and p.suffix != ".partial"):
        match = _GRAPH.match(folder.name)
        if folder.name in in_use:
            entries.append(Entry(folder, _size(folder), in_use[folder.name], True))
        elif match is None or int(match["version"]) != GRAPH_VERSIONS[match["precision"]]:
            entries.append(Entry(folder, _size(folder), "graph built by another version of fly: never read", False))
        else:
            entries.append(Entry(folder, _size(folder), f"{match['precision']} graph: read only where it is asked for "
                                                        f"(precision={match['precision']!r}, or as a drafter)", False))
    for folder in sorted(p for p in root.glob("downloads/*")):
        entries.append(Entry(folder, _size(folder), "unfinished download: fetched anew when needed", False))
    for name, use in (("references", "full-precision choices a graph is checked against"),
                      ("bench", "benchmark data (fly bench)")):
        if (root / name).is_dir():
            entries.append(Entry(root / name, _size(root / name), use, True))
    for path in sorted(root.glob("reader/*.safetensors")):
        entries.append(Entry(path, _size(path), "weights of the prompt reader (FLY_PROMPT_READER), kept "
                                                "so that it opens in seconds: converted again from the GGUF when needed",
                             False))
    if (root / "kernels").is_dir():
        entries.append(Entry(root / "kernels", _size(root / "kernels"),
                             "the prompt reader's widening, compiled for this CPU (built again in a second)", True))
    if (root / "test-fixtures").is_dir():
        entries.append(Entry(root / "test-fixtures", _size(root / "test-fixtures"),
                             "inputs fly's own test suite made once (an optimum export): made again when it runs", False))
    for path in sorted(root.glob("*/*.partial")):
        entries.append(Entry(path, _size(path), "left by an interrupted conversion", False))
    return entries


def prune(entries: list[Entry]) -> int:
    """Delete the entries nothing here reads; the bytes freed."""
    freed = 0
    for entry in entries:
        if entry.needed:
            continue
        for path in entry.path.parent.glob(entry.path.name):  # a folder's weights are one entry of many files
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        freed += entry.size
    return freed
