"""A LlamaIndex RAG query engine (and a chat engine) on FlyLLM, fully offline.

    python examples/llamaindex_query_engine.py "What time does the Kelpmouth Harbor Library open?"
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding

from examples.corpus import load_documents, sentence_model
from fly_integrations import FlyLLM


class MiniLMEmbedding(BaseEmbedding):
    """LlamaIndex embeddings backed by the bundled all-MiniLM-L6-v2 sentence-transformers model."""

    model_name: str = "all-MiniLM-L6-v2"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        return sentence_model().encode(texts, normalize_embeddings=True).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


def build_index() -> VectorStoreIndex:
    docs = [Document(text=text, metadata={"source": name}) for name, text in load_documents().items()]
    return VectorStoreIndex.from_documents(docs, embed_model=MiniLMEmbedding())


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What time does the Kelpmouth Harbor Library open?"
    engine = build_index().as_query_engine(llm=FlyLLM(max_tokens=128), similarity_top_k=2, streaming=True)
    print(f"Q: {question}\nA: ", end="", flush=True)
    engine.query(question).print_response_stream()
    print()


if __name__ == "__main__":
    main()
