"""Front half of the runtime: turns user input into tokenized requests and scheduler deltas
into cumulative `GenerateOutput`s. No torch here: the gateway process runs it."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from genserve.srt.messages import (
    GenerateOutput,
    InputLogprobs,
    MultimodalInputs,
    PoolingParams,
    ReqOutput,
    TokenizedGenerateReq,
)
from genserve.srt.sampling.sampling_params import SamplingParams

# Each listed id adds one gathered logprob per scored position.
MAX_TOKEN_IDS_LOGPROB = 64


def load_tokenizer(folder: Any) -> Any | None:
    """The folder's HF tokenizer, or None for weight-only folders (input_ids requests only).

    The class named by tokenizer_config.json is loaded directly: AutoTokenizer reads the model
    config through transformers' configuration module, which imports torch, and the gateway
    process (which tokenizes) must not."""
    import json
    from pathlib import Path

    folder = Path(folder)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((folder / n).is_file() for n in names):
        return None
    import transformers

    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    name = config.get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None and (folder / "tokenizer.json").is_file():
        cls = transformers.PreTrainedTokenizerFast
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer  # a class only the auto mapping knows
    return cls.from_pretrained(str(folder))


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
    logprob_start_len: int = -1,
    token_ids_logprob: list[int] | None = None,
    mm_inputs: MultimodalInputs | None = None,
    lora_name: str | None = None,
) -> TokenizedGenerateReq:
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
        raise ValueError(f"top_logprobs_num must be an integer in [0, 20], got {top_logprobs_num}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ValueError("input_ids must be a list of integers")
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int):
        raise ValueError(f"logprob_start_len must be an integer, got {logprob_start_len!r}")
    if logprob_start_len < -1 or (input_ids and logprob_start_len >= len(input_ids)):
        raise ValueError(
            f"logprob_start_len ({logprob_start_len}) must be -1 (no input logprobs) or a prompt "
            f"position in [0, {len(input_ids)})"
        )
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ValueError(f"lora_path must be the name of a loaded LoRA adapter, got {lora_name!r}")
    if logprob_start_len >= 0 and not return_logprob:
        raise ValueError("logprob_start_len needs return_logprob: true")
    ids_logprob = None
    if token_ids_logprob is not None:
        if not isinstance(token_ids_logprob, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids_logprob
        ):
            raise ValueError("token_ids_logprob must be a list of token ids (integers >= 0)")
        if not 0 < len(token_ids_logprob) <= MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(
                f"token_ids_logprob must hold 1 to {MAX_TOKEN_IDS_LOGPROB} token ids, "
                f"got {len(token_ids_logprob)}"
            )
        ids_logprob = tuple(token_ids_logprob)
    return TokenizedGenerateReq(
        rid=rid or uuid.uuid4().hex,
        input_ids=list(input_ids),
        sampling_params=params,
        stream=stream,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        namespace=cache_salt or "",
        arrival_time=time.monotonic(),
        logprob_start_len=logprob_start_len,
        token_ids_logprob=ids_logprob,
        mm_inputs=mm_inputs,
        lora_name=lora_name,
    )


def tokenize_for_embedding(tokenizer: Any, text: str, prefix: str = "") -> list[int]:
    """Token ids of one embedding input as sentence-transformers makes them: the prompt text
    (an instruction) put before the input, the tokenizer's special tokens added."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids instead of text")
    return list(tokenizer(prefix + text)["input_ids"])


def tokenize_pair(tokenizer: Any, query: str, document: str) -> tuple[list[int], list[int] | None]:
    """(input_ids, token_type_ids or None) of a cross-encoder's (query, document) pair, as
    sentence-transformers' `CrossEncoder` tokenizes it."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    enc = tokenizer(query, document)
    types = enc.get("token_type_ids")
    return list(enc["input_ids"]), list(types) if types is not None else None


def make_pooling_req(input_ids: list[int], rid: str | None = None,
                     dimensions: int | None = None,
                     token_type_ids: list[int] | None = None) -> TokenizedGenerateReq:
    """A prefill-only request whose result is the pooled vector of `input_ids`."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ValueError("token ids must be integers")
    return TokenizedGenerateReq(
        rid=rid or uuid.uuid4().hex, input_ids=list(input_ids),
        sampling_params=SamplingParams(max_new_tokens=0), arrival_time=time.monotonic(),
        pooling=PoolingParams(dimensions=dimensions, token_type_ids=token_type_ids))


class RequestState:
    """Accumulates a request's deltas into the cumulative `GenerateOutput` callers see."""

    def __init__(self, req: TokenizedGenerateReq) -> None:
        self.req = req
        self.start = time.perf_counter()
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[tuple[float, int]] | None = [] if req.return_logprob else None
        self.top: list[list[tuple[float, int]]] | None = [] if req.top_logprobs_num else None
        self.ids_lp: list[list[tuple[float, int]]] | None = (
            [] if req.token_ids_logprob is not None else None
        )
        # Input logprobs come once, after the prompt's prefill; an empty list until then.
        self.input_lp: InputLogprobs | None = (
            InputLogprobs([]) if req.return_logprob else None
        )
        self.last: GenerateOutput | None = None

    def update(self, out: ReqOutput) -> GenerateOutput:
        self.text += out.text_delta
        self.output_ids.extend(out.new_ids)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(tuple(p) for p in out.new_logprobs)  # type: ignore[misc]
        if self.top is not None and out.new_top_logprobs:
            self.top.extend([tuple(p) for p in row] for row in out.new_top_logprobs)  # type: ignore[misc]
        if self.ids_lp is not None and out.new_token_ids_logprobs:
            self.ids_lp.extend(out.new_token_ids_logprobs)
        if out.input_logprobs is not None:
            self.input_lp = out.input_logprobs
        inp = self.input_lp
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
            input_token_logprobs=inp.token_logprobs if inp is not None else None,
            input_top_logprobs=(
                inp.top_logprobs if inp is not None and self.top is not None else None
            ),
            input_token_ids_logprobs=(
                inp.token_ids_logprobs if inp is not None and self.ids_lp is not None else None
            ),
            output_token_ids_logprobs=list(self.ids_lp) if self.ids_lp is not None else None,
            error=out.error,
            error_status=out.error_status,
        )
        return self.last
