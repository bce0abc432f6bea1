"""Request shape of /v1/rerank: SGLang's / Cohere's (`query`, `documents`, `top_n`,
`return_documents`). Documents may be strings or Cohere's `{"text": ...}` objects. Unknown
fields are tolerated."""

from __future__ import annotations

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class RerankDocument(LenientModel):
    text: str


class RerankRequest(LenientModel):
    model: str | None = None  # None: the first reranker served
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
