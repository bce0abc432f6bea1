"""A deterministic fake LLM engine behind the real gateway (no torch, no model).

Tokens are characters (id = ord(c)). The output of a request is the alphabet starting at
`seed % 26` ("abcdef..." for seed 0 / no seed), so n choices with seeds seed+i differ. Stop
strings, max_new_tokens, logprobs and prefix caching (longest common prefix with any earlier
prompt) behave like a real engine so the HTTP layer can be checked exactly.
"""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import AsyncIterator
from typing import Any

from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput, GenerateRequest

ALPHABET = string.ascii_lowercase


def expected_text(n_tokens: int, seed: int | None = None) -> str:
    start = (seed or 0) % 26
    return "".join(ALPHABET[(start + k) % 26] for k in range(n_tokens))


class FakeEngine(LLMEngineClient):
    def __init__(self, model_name: str = "fake-llm", context_length: int = 256,
                 token_delay: float = 0.0, default_max_new_tokens: int = 16) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.token_delay = token_delay
        self.default_max_new_tokens = default_max_new_tokens
        self.max_total_tokens = 4096  # KV pool size reported in model_info / server_info
        self.healthy = True
        self.running: set[str] = set()
        self.aborted: set[str] = set()  # rids aborted through abort()
        self.closed_early: set[str] = set()  # rids whose iterator ended before finishing
        self.completed: set[str] = set()
        self.requests: list[GenerateRequest] = []
        self._seen_prompts: list[list[int]] = []
        self.flushes = 0
        self.die_after_tokens: int | None = None  # simulate the scheduler process crashing

    # --- LLMEngineClient -------------------------------------------------------------------
    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        return self._generate(req)

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        params = req.sampling_params
        if params.get("top_k") == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        ids = req.input_ids if req.input_ids is not None else self.tokenize(req.text or "")
        self.requests.append(req)
        cached = max((_common_prefix(ids, p) for p in self._seen_prompts), default=0)
        cached = min(cached, len(ids) - 1)
        self._seen_prompts.append(list(ids))
        max_new = params.get("max_new_tokens", self.default_max_new_tokens)
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        start = time.perf_counter()
        self.running.add(req.rid)
        finished = False
        try:
            out_ids: list[int] = []
            reason: dict[str, Any] = {"type": "length", "matched": None}
            text = ""
            for k in range(max_new):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                if self.die_after_tokens is not None and k >= self.die_after_tokens:
                    self.healthy = False
                    raise RuntimeError("the LLM scheduler process died (exit code -9)")
                if req.rid in self.aborted:
                    reason = {"type": "abort", "matched": None, "message": "aborted"}
                    break
                out_ids.append(ord(expected_text(k + 1, params.get("seed"))[-1]))
                text = "".join(map(chr, out_ids))
                hit = next((s for s in stops if s in text), None)
                if hit is not None:
                    text = text[: text.index(hit)]
                    reason = {"type": "stop", "matched": hit}
                    break
                if req.stream and k + 1 < max_new:
                    yield self._output(req, ids, out_ids, text, None, cached, start)
            finished = True
            if reason["type"] != "abort":
                self.completed.add(req.rid)
            yield self._output(req, ids, out_ids, text, reason, cached, start)
        finally:
            self.running.discard(req.rid)
            if not finished:
                self.closed_early.add(req.rid)

    def _output(self, req: GenerateRequest, ids: list[int], out_ids: list[int], text: str,
                reason: dict[str, Any] | None, cached: int, start: float) -> GenerateOutput:
        out = GenerateOutput(
            rid=req.rid, text=text, output_ids=list(out_ids), finished=reason is not None,
            finish_reason=reason, prompt_tokens=len(ids), completion_tokens=len(out_ids),
            cached_tokens=cached, e2e_latency=time.perf_counter() - start)
        if req.return_logprob:
            out.output_token_logprobs = [(-0.5 * (k + 1), t) for k, t in enumerate(out_ids)]
            out.output_top_logprobs = [
                [(-0.5 * (k + 1) - j, t + j) for j in range(req.top_logprobs_num)]
                for k, t in enumerate(out_ids)]
        return out

    async def abort(self, rid: str) -> bool:
        if rid not in self.running:
            return False
        self.aborted.add(rid)
        return True

    async def flush_cache(self) -> bool:
        if self.running:
            return False
        self._seen_prompts.clear()
        self.flushes += 1
        return True

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake", "architecture": "Fake", "dtype": "none",
                "context_length": self.context_length, "vocab_size": 0x110000,
                "max_total_tokens": self.max_total_tokens}

    async def server_info(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": 0,
                "kv_usage": 0.25, "max_total_tokens": self.max_total_tokens,
                "cache": {"cached_prompts": len(self._seen_prompts)}}

    def is_healthy(self) -> bool:
        return self.healthy

    async def shutdown(self) -> None:
        self.healthy = False


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
