"""The scheduler's checks and reports: the KV accounting check, the info dict and the per-step
debug line."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from genserve.srt.lora.scheduling import pins_by_adapter
from genserve.srt.mem_cache import IntegrityError

if TYPE_CHECKING:
    from genserve.srt.scheduler.batch import ExtendBatch
    from genserve.srt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def log_step(batch: ExtendBatch, n_running: int, seconds: float, waiting: int) -> None:
    """One debug line per scheduler step (mixed-in decodes are 1-token extends in `batch`)."""
    if batch:
        mixed = batch.num_decoding
        what = f"prefill {len(batch) - mixed} reqs {batch.num_tokens - mixed} tokens"
        what += f" + decode {mixed}" if mixed else ""
    else:
        what = f"decode {n_running}"
    logger.debug("step %s: %.1f ms, %d waiting", what, seconds * 1e3, waiting)


def check_scheduler_integrity(s: Scheduler) -> None:
    """free + cached + held by requests == pool size; every structure checks itself."""
    s.allocator.check_integrity()
    s.runner.token_to_kv_pool.check_integrity()  # its buffers match its layout's byte count
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
    if s.lora is not None:
        s.lora.check_integrity(pins_by_adapter(live))
    if s.spec is not None:
        s.spec.check_integrity(live, s.waiting + compiling)
    if any(r.lora_slot >= 0 for r in s.waiting + compiling):
        raise IntegrityError("a waiting request still pins a LoRA adapter slot")


def scheduler_info(s: Scheduler) -> dict[str, Any]:
    free = s.allocator.available_size()
    used = s.max_total_tokens - free
    st = s.stats
    compiling = len(s.compiling) if s.compiling is not None else 0
    return {
        "max_total_tokens": s.max_total_tokens,
        "quantization": s.runner.quantization,
        "checkpoint_quantization": s.runner.checkpoint_quantization,
        "compile": s.runner.compiled,
        "compile_state": s.runner.poll_compile(),  # off, compiling, ready or failed
        "compile_report": s.runner.compile_report,
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
        **({"lora": s.lora.info()} if s.lora is not None else {}),
    }
