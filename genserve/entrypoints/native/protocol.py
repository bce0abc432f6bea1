"""Request shapes of the native API (SGLang's `GenerateReqInput` and friends).

Unknown fields are accepted and ignored (logged once per name), as SGLang does: its own
bench client sends fields such as `return_routed_experts`. Fields genserve knows but cannot
honour (`return_hidden_states`...) are declared and answered with a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class SamplingParams(LenientModel):
    """Passed to the engine as the dict of the fields the client set; the engine checks values."""

    max_new_tokens: int | None = Field(default=None, ge=0)
    min_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's frontend sends this key ([] unless a program sets it); not supported yet.
    stop_regex: str | list[str] | None = None

    def to_engine(self) -> dict[str, Any]:
        params = self.model_dump(exclude_none=True)
        params.pop("n", None)  # the gateway fans n out into n engine requests
        return params


class GenerateReqInput(LenientModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    # Score the prompt from this token position on (input_token_logprobs); -1: outputs only.
    logprob_start_len: int | list[int] = -1
    # Also report these token ids' logprobs at every scored position, sampled or not.
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    image_data: Any = None
    # The LoRA adapter (its served name) of the request, or one per prompt of a batch.
    lora_path: str | list[str | None] | None = None
    return_hidden_states: bool = False  # known, not honoured: true is a 400
    # SGLang's bench clients send this; every native chunk carries meta_info token counts, so
    # usage is always included.
    stream_options: dict[str, Any] | None = None
    log_metrics: bool = True
    # Extension: which LLM serves the request when several are served (default: the first).
    model: str | None = None


class LoadLoRAAdapterReq(LenientModel):
    """SGLang's /load_lora_adapter: serve the PEFT adapter folder `lora_path` as `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None


class UnloadLoRAAdapterReq(LenientModel):
    lora_name: str = Field(min_length=1)
    model: str | None = None


class AbortReq(LenientModel):
    rid: str = Field(min_length=1)


class TokenizeReq(LenientModel):
    """SGLang's /tokenize: one prompt or a list of prompts."""

    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeReq(LenientModel):
    tokens: list[int] | list[list[int]]
    model: str | None = None
