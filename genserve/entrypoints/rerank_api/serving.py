"""/v1/rerank: each (query, document) pair is one pooled request of the cross-encoder (they
batch in its scheduler); results are sorted by score, best first, each with its document's
index."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from genserve.entrypoints.admission import new_rid
from genserve.entrypoints.errors import bad_request

from .protocol import RerankRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


class RerankServing:
    """The rerank endpoint of one app (`GatewayState.rerank`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        pooled = self.state.embeddings
        client = pooled.resolve(body.model, "rerank")
        if not body.query:
            raise bad_request("'query' is empty", "query")
        if not body.documents:
            raise bad_request("'documents' is empty: send at least one document", "documents")
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        try:
            pairs = [client.rerank_input(body.query, text) for text in texts]
        except ValueError as exc:
            raise bad_request(str(exc), "documents") from exc
        outs = await pooled.run(client, pairs)
        ranked = sorted(range(len(texts)), key=lambda i: outs[i].embedding[0], reverse=True)
        results = []
        for i in ranked[: body.top_n]:
            row: dict[str, Any] = {"index": i, "relevance_score": outs[i].embedding[0]}
            if body.return_documents:
                row["document"] = {"text": texts[i]}
            results.append(row)
        tokens = sum(out.prompt_tokens for out in outs)
        return {"id": new_rid("rerank-"), "model": body.model or client.model_name,
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
