"""Front half of the runtime: turns user input into tokenized requests and scheduler deltas
into cumulative `GenerateOutput`s. No torch here: the gateway process runs it."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from genserve.srt.messages import (
    GenerateOutput,
    MultimodalInputs,
    ReqOutput,
    TokenizedGenerateReq,
)
from genserve.srt.sampling.sampling_params import SamplingParams


def load_tokenizer(folder: Any) -> Any | None:
    """The folder's HF tokenizer, or None for weight-only folders (input_ids requests only)."""
    from pathlib import Path

    folder = Path(folder)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((folder / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """n choices become n requests with n == 1 (seeds seed, seed + 1, ... when seeded)."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def tokenize_prompt(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send input_ids instead of text")
    return list(tokenizer.encode(text))


def make_tokenized_req(
    input_ids: list[int],
    params: SamplingParams,
    rid: str | None = None,
    stream: bool = False,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    cache_salt: str | None = None,
    mm_inputs: MultimodalInputs | None = None,
) -> TokenizedGenerateReq:
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
        raise ValueError(f"top_logprobs_num must be an integer in [0, 20], got {top_logprobs_num}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ValueError("input_ids must be a list of integers")
    return TokenizedGenerateReq(
        rid=rid or uuid.uuid4().hex,
        input_ids=list(input_ids),
        sampling_params=params,
        stream=stream,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        namespace=cache_salt or "",
        arrival_time=time.monotonic(),
        mm_inputs=mm_inputs,
    )


class RequestState:
    """Accumulates a request's deltas into the cumulative `GenerateOutput` callers see."""

    def __init__(self, req: TokenizedGenerateReq) -> None:
        self.req = req
        self.start = time.perf_counter()
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[tuple[float, int]] | None = [] if req.return_logprob else None
        self.top: list[list[tuple[float, int]]] | None = [] if req.top_logprobs_num else None
        self.last: GenerateOutput | None = None

    def update(self, out: ReqOutput) -> GenerateOutput:
        self.text += out.text_delta
        self.output_ids.extend(out.new_ids)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(tuple(p) for p in out.new_logprobs)  # type: ignore[misc]
        if self.top is not None and out.new_top_logprobs:
            self.top.extend([tuple(p) for p in row] for row in out.new_top_logprobs)  # type: ignore[misc]
        self.last = GenerateOutput(
            rid=out.rid,
            text=self.text,
            output_ids=list(self.output_ids),
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            e2e_latency=time.perf_counter() - self.start,
            output_token_logprobs=list(self.logprobs) if self.logprobs is not None else None,
            output_top_logprobs=list(self.top) if self.top is not None else None,
            error=out.error,
            error_status=out.error_status,
        )
        return self.last
