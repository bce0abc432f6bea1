"""Whether a request can ever run on this scheduler: checked once, when it arrives, so that a
request that cannot fit or names tokens outside the vocabulary ends at once with a 400 instead
of waiting for room that never comes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genserve.srt.scheduler.req import Req


@dataclass(frozen=True)
class AdmissionLimits:
    """What the scheduler's model and memory allow any one request."""

    context_length: int
    max_total_tokens: int  # KV pool size
    vocab_size: int
    constrained_decoding: bool  # a grammar backend is loaded
    images: bool  # the model takes image inputs
    pooled: bool = False  # an embedder: every request is a pooling (prefill-only) request


def admission_error(limits: AdmissionLimits, req: Req) -> str | None:
    """Why `req` can never run (a 400 message), or None."""
    n_in, max_new = len(req.origin_input_ids), req.params.max_new_tokens
    vocab = limits.vocab_size
    if n_in == 0:
        return "the prompt is empty: at least one input token is required"
    if n_in + max_new > limits.context_length:
        return (
            f"prompt ({n_in} tokens) + max_new_tokens ({max_new}) = {n_in + max_new} exceeds "
            f"the context length ({limits.context_length})"
        )
    if n_in + max_new > limits.max_total_tokens:
        return (
            f"prompt ({n_in} tokens) + max_new_tokens ({max_new}) can never fit in the KV "
            f"pool ({limits.max_total_tokens} tokens); lower max_new_tokens or raise "
            "--max-total-tokens"
        )
    if any(t < 0 or t >= vocab for t in req.origin_input_ids):
        return f"input token ids must be in [0, {vocab})"
    if any(t >= vocab for t, _ in req.params.logit_bias):
        return f"logit_bias token ids must be in [0, {vocab})"
    if req.params.grammar_key is not None and not limits.constrained_decoding:
        return "constrained decoding is disabled on this server (--grammar-backend none)"
    if req.token_ids_logprob and max(req.token_ids_logprob) >= vocab:
        return f"token_ids_logprob ids must be in [0, {vocab})"
    if req.mm_inputs is not None and not limits.images:
        return "this model does not take image inputs"
    if limits.pooled and req.pooling is None:
        return "this model is an embedding model: it serves embeddings, not generation"
    if req.pooling is not None and not limits.pooled:
        return "this model is not an embedding model: it cannot return embeddings"
    return None
