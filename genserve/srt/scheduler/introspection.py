"""The scheduler's checks and reports: why a request cannot run at all, the KV accounting
check, the info dict and the per-step debug line."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from genserve.srt.mem_cache import IntegrityError

if TYPE_CHECKING:
    from genserve.srt.scheduler.req import Req
    from genserve.srt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def admission_error(s: Scheduler, req: Req) -> str | None:
    """Why `req` can never run on this scheduler (a 400 message), or None."""
    n_in, max_new = len(req.origin_input_ids), req.params.max_new_tokens
    vocab = s.vocab_size
    if n_in == 0:
        return "the prompt is empty: at least one input token is required"
    if n_in + max_new > s.context_length:
        return (
            f"prompt ({n_in} tokens) + max_new_tokens ({max_new}) = {n_in + max_new} exceeds "
            f"the context length ({s.context_length})"
        )
    if n_in + max_new > s.max_total_tokens:
        return (
            f"prompt ({n_in} tokens) + max_new_tokens ({max_new}) can never fit in the KV "
            f"pool ({s.max_total_tokens} tokens); lower max_new_tokens or raise "
            "--max-total-tokens"
        )
    if any(t < 0 or t >= vocab for t in req.origin_input_ids):
        return f"input token ids must be in [0, {vocab})"
    if any(t >= vocab for t, _ in req.params.logit_bias):
        return f"logit_bias token ids must be in [0, {vocab})"
    if req.params.grammar_key is not None and s.grammar is None:
        return "constrained decoding is disabled on this server (--grammar-backend none)"
    if req.token_ids_logprob and max(req.token_ids_logprob) >= vocab:
        return f"token_ids_logprob ids must be in [0, {vocab})"
    if req.mm_inputs is not None and s.mm is None:
        return "this model does not take image inputs"
    return None


def log_step(batch: list[tuple[Req, int, int]], mixed: set[int], n_running: int,
             seconds: float, waiting: int) -> None:
    """One debug line per scheduler step (mixed-in decodes are 1-token extends in `batch`)."""
    if batch:
        what = (
            f"prefill {len(batch) - len(mixed)} reqs "
            f"{sum(e for _, _, e in batch) - len(mixed)} tokens"
        )
        what += f" + decode {len(mixed)}" if mixed else ""
    else:
        what = f"decode {n_running}"
    logger.debug("step %s: %.1f ms, %d waiting", what, seconds * 1e3, waiting)


def check_scheduler_integrity(s: Scheduler) -> None:
    """free + cached + held by requests == pool size; every structure checks itself."""
    s.allocator.check_integrity()
    s.cache.check_integrity()
    s.req_to_token_pool.check_integrity()
    live = s.live_reqs()
    held = sum(r.owned_kv() for r in live)
    free, cached = s.allocator.available_size(), s.cache.total_size()
    if free + cached + held != s.max_total_tokens:
        raise IntegrityError(
            f"KV slots leaked: free {free} + cached {cached} + held by requests {held} "
            f"!= pool size {s.max_total_tokens}"
        )
    rows_used = s.req_to_token_pool.size - s.req_to_token_pool.available_size()
    if rows_used != len(live):
        raise IntegrityError(
            f"req_to_token rows leaked: {rows_used} in use for {len(live)} requests"
        )
    compiling = s.compiling.reqs if s.compiling is not None else []
    if any(r.row is not None for r in s.waiting + compiling):
        raise IntegrityError("a waiting request still holds a req_to_token row")
    if s.mm is not None:
        s.mm.check_integrity(live + s.waiting)


def scheduler_info(s: Scheduler) -> dict[str, Any]:
    free = s.allocator.available_size()
    used = s.max_total_tokens - free
    st = s.stats
    compiling = len(s.compiling) if s.compiling is not None else 0
    return {
        "max_total_tokens": s.max_total_tokens,
        "quantization": s.runner.quantization,
        "compile": s.runner.compiled,
        "available_tokens": free,
        "kv_used_tokens": used,
        "kv_usage": used / s.max_total_tokens,
        "num_running_reqs": len(s.live_reqs()),
        "num_waiting_reqs": len(s.waiting) + compiling,
        "num_compiling_reqs": compiling,
        "cache": {
            "type": type(s.cache).__name__,
            "total_tokens": s.cache.total_size(),
            "evictable_tokens": s.cache.evictable_size(),
            "protected_tokens": s.cache.protected_size(),
            "hit_rate": st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0,
        },
        "stats": dict(st),
        "grammar": s.grammar.info() if s.grammar is not None else None,
        "time": time.time(),
        **({"multimodal": s.mm.info()} if s.mm is not None else {}),
    }
