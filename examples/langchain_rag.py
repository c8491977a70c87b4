"""Retrieval-augmented generation with LangChain (LCEL) and FlyChatModel, fully offline.

    python examples/langchain_rag.py "How long does the Zephyr-9 battery last?"
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import HuggingFaceEmbeddings

from examples.corpus import embedding_model_path, load_documents
from fly_integrations import FlyChatModel

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only the context below. Be brief.\n\nContext:\n{context}"),
    ("human", "{question}"),
])


def embeddings() -> HuggingFaceEmbeddings:
    """LangChain's Hugging Face integration (langchain-huggingface) over the bundled all-MiniLM-L6-v2."""
    return HuggingFaceEmbeddings(model_name=embedding_model_path(), model_kwargs={"device": "cpu"},
                                 encode_kwargs={"normalize_embeddings": True})


def build_chain(llm: BaseChatModel | None = None, k: int = 2) -> Runnable:
    docs = [Document(page_content=text, metadata={"source": name}) for name, text in load_documents().items()]
    retriever = InMemoryVectorStore.from_documents(docs, embeddings()).as_retriever(search_kwargs={"k": k})

    def join(found: list[Document]) -> str:
        return "\n\n".join(f"[{d.metadata['source']}]\n{d.page_content}" for d in found)

    llm = llm or FlyChatModel(max_tokens=128)
    return {"context": retriever | join, "question": RunnablePassthrough()} | PROMPT | llm | StrOutputParser()


def main() -> None:
    question = " ".join(sys.argv[1:]) or "How long does the Zephyr-9 rover's battery last on one charge?"
    print(f"Q: {question}\nA: ", end="", flush=True)
    for piece in build_chain().stream(question):
        print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
