"""A LlamaIndex RAG query engine (and a chat engine) on FlyLLM, fully offline.

    python examples/llamaindex_query_engine.py "What time does the Kelpmouth Harbor Library open?"
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core import Document, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from examples.corpus import embedding_model_path, load_documents
from fly_integrations import FlyLLM


def embedding() -> HuggingFaceEmbedding:
    """LlamaIndex's Hugging Face integration (llama-index-embeddings-huggingface) over the bundled all-MiniLM-L6-v2."""
    return HuggingFaceEmbedding(model_name=embedding_model_path(), device="cpu", normalize=True)


def build_index() -> VectorStoreIndex:
    docs = [Document(text=text, metadata={"source": name}) for name, text in load_documents().items()]
    return VectorStoreIndex.from_documents(docs, embed_model=embedding())


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What time does the Kelpmouth Harbor Library open?"
    engine = build_index().as_query_engine(llm=FlyLLM(max_tokens=128), similarity_top_k=2, streaming=True)
    print(f"Q: {question}\nA: ", end="", flush=True)
    engine.query(question).print_response_stream()
    print()


if __name__ == "__main__":
    main()
