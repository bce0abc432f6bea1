"""Typed payloads between the gateway, the tokenizer manager and the scheduler process.

This module must not import torch: the gateway imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    """One generation request as the gateway hands it to an `LLMEngineClient`.

    Exactly one of `text` / `input_ids` is set. `sampling_params` is the raw dict of the
    SGLang `GenerateReqInput.sampling_params`; the engine validates it (ValueError on bad values).
    The client serves n == 1 only: callers that want n choices submit n requests (with seeds
    seed, seed + 1, ... when a seed is given); they share the prompt's KV through the cache.
    """

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    # The LoRA adapter (by name) the request runs under; None: the base model.
    lora_path: str | None = None
    # Input-token logprobs from this prompt position on (SGLang's `logprob_start_len`); -1: none.
    logprob_start_len: int = -1
    # Token ids whose logprobs are reported at every input (from logprob_start_len) and output
    # position, whatever was sampled (SGLang's `token_ids_logprob`).
    token_ids_logprob: list[int] | None = None
    # Vision models: the images of `input_ids` (from `LLMEngineClient.process_images`, which
    # also expanded their placeholders).
    mm_inputs: MultimodalInputs | None = None


@dataclass
class GenerateOutput:
    """Progress of one request. Text and ids are cumulative; the last one has finished=True.

    finish_reason: None while running, else {"type": "stop" | "length" | "abort",
    "matched": <stop token id or stop string or None>, "message": <for abort/errors>}.
    Logprobs are (logprob, token_id) pairs; top logprobs a list of such pairs per output token.
    Input-token logprobs (SGLang's shape) cover prompt positions [logprob_start_len, prompt_len):
    the first entry's logprob is None (nothing before it was scored), and the per-position lists
    (top, token_ids) are None there too.
    """

    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    # Set when the request failed inside the engine (HTTP layer maps it to 5xx / 400).
    error: str | None = None
    error_status: int = 500

    def meta_info(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": self.e2e_latency,
        }
        if self.output_token_logprobs is not None:
            meta["output_token_logprobs"] = [list(p) for p in self.output_token_logprobs]
        if self.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [
                [list(p) for p in row] for row in self.output_top_logprobs
            ]
        if self.input_token_logprobs is not None:
            meta["input_token_logprobs"] = [list(p) for p in self.input_token_logprobs]
        for key in ("input_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
            rows = getattr(self, key)
            if rows is not None:
                meta[key] = [None if r is None else [list(p) for p in r] for r in rows]
        return meta

    def to_dict(self) -> dict[str, Any]:
        """The SGLang `/generate` response shape."""
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(),
        }


@dataclass
class EmbedRequest:
    """One embedding (or rerank score) request as the gateway hands it to an `LLMEngineClient`:
    one tokenized input (`LLMEngineClient.tokenize_for_embedding` / `tokenize_pair` make them).
    `dimensions` keeps the first d values of a Matryoshka model's vector, then L2-normalises."""

    rid: str
    input_ids: list[int]
    token_type_ids: list[int] | None = None  # an encoder's segment ids (query / document)
    dimensions: int | None = None


@dataclass
class EmbedOutput:
    """The pooled result of one `EmbedRequest`: the embedding vector, or for a reranker its
    score(s) (one per label, after the model's activation)."""

    rid: str
    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500


# ---- Tokenizer manager <-> scheduler process -------------------------------------------------


@dataclass
class PoolingParams:
    """A prefill-only request: its prompt's pooled output comes back instead of tokens."""

    dimensions: int | None = None  # see EmbedRequest
    token_type_ids: list[int] | None = None


@dataclass
class ImageItem:
    """One image of a request: its encoded file, as the client sent it.

    Its `num_tokens` placeholder tokens are input_ids[offset : offset + num_tokens].
    `content_hash` (hex) identifies the file: equal hashes mean equal embeddings, so the
    scheduler preprocesses and encodes an image only when its embedding cache lacks the hash.
    """

    content_hash: str
    data: bytes  # the encoded image (PNG, JPEG, WebP...)
    grid_thw: tuple[int, int, int] | None  # Qwen2-VL patch grid (t, h, w); None for LLaVA
    offset: int
    num_tokens: int
    # Set in the scheduler process, on an embedding-cache miss: the pixel array the model's
    # Hugging Face image processor made (numpy, the processor's layout).
    pixel_values: Any = None


@dataclass
class MultimodalInputs:
    images: list[ImageItem]
    # M-RoPE models (Qwen2-VL): [3, len(input_ids)] int64 positions of the prompt, and the
    # shift of every later position (output token i sits at len(input_ids) + i + delta).
    mrope_positions: Any = None
    mrope_delta: int = 0


@dataclass
class TokenizedGenerateReq:
    """A validated, tokenized request (n == 1). `sampling_params` is a validated
    `genserve.srt.sampling.SamplingParams` (a plain frozen dataclass; pickles cheaply)."""

    rid: str
    input_ids: list[int]
    sampling_params: Any
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    namespace: str = ""  # cache_salt: identical tokens in other namespaces never share KV
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)
    arrival_time: float = 0.0
    logprob_start_len: int = -1  # see GenerateRequest
    token_ids_logprob: tuple[int, ...] | None = None
    mm_inputs: MultimodalInputs | None = None
    pooling: PoolingParams | None = None  # set: an embedding / score request (no decoding)


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """flush_cache | server_info | check_integrity | shutdown | load_lora_adapter
    {lora_name, lora_path} | unload_lora_adapter {lora_name}; answered by a ControlResp."""

    kind: str
    token: int = 0
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResp:
    kind: str
    token: int
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReqOutput:
    """What one scheduler step produced for one request: deltas since the last ReqOutput."""

    rid: str
    text_delta: str
    new_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[tuple[float, int]] | None = None
    new_top_logprobs: list[list[tuple[float, int]]] | None = None
    new_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    # Sent once, with the first output after the prompt's prefill (see GenerateOutput).
    input_logprobs: InputLogprobs | None = None
    error: str | None = None
    error_status: int = 500
    embedding: list[float] | None = None  # a pooling request's result (with finished=True)


@dataclass
class InputLogprobs:
    """Scores of prompt tokens [logprob_start_len, prompt_len); entry 0 is never scored."""

    token_logprobs: list[tuple[float | None, int]]
    top_logprobs: list[list[tuple[float, int]] | None] | None = None
    token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None


@dataclass
class BatchReqOutput:
    outputs: list[ReqOutput]


@dataclass
class ForwardInputs:
    """One forward pass, sent by tensor-parallel rank 0 (which schedules) to every other rank,
    which runs the same batch on its share of the heads. KV slot indices mean the same on
    every rank (their pools have the same size and only rank 0 allocates)."""

    mode: str  # ForwardMode value
    rows: list[int]  # req_to_token rows of the requests
    input_ids: list[int]  # new tokens, request after request
    prefix_lens: list[int]
    extend_lens: list[int]
    # Each request's req_to_token[row, :prefix_len + extend_len], request after request (its
    # cached prefix and its new tokens' slots).
    token_slots: list[int]
    logits_indices: list[int]  # rows of the hidden states whose logits are computed


@dataclass
class StopWorker:
    """Rank 0 is shutting down: the other tensor-parallel ranks exit."""
