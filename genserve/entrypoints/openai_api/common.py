"""Pieces shared by chat and completions: sampling params, usage, logprobs, finish reasons."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints import sse
from genserve.entrypoints.admission import new_rid
from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.generation import (
    STREAM_FROM_ENGINE,
    GenerationGroup,
    primed,
    supports_grammar,
)
from genserve.entrypoints.openai_api.protocol import ResponseFormat, SamplingFields
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput, GenerateRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

# Extension fields copied as-is into the engine's sampling params.
_PASSTHROUGH = ("temperature", "top_p", "stop", "frequency_penalty", "presence_penalty", "top_k",
                "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                "skip_special_tokens", "regex", "ebnf")


def completion_id(prefix: str) -> str:
    return new_rid(f"{prefix}-")


def now() -> int:
    return int(time.time())


def reject_unsupported(client: LLMEngineClient, body: SamplingFields) -> None:
    """400 for features this server does not implement, instead of silently ignoring them."""
    if (body.regex or body.ebnf) and not supports_grammar(client):
        raise bad_request("Constrained decoding (regex / ebnf) is not supported by this engine "
                          "yet.", param="regex" if body.regex else "ebnf")
    if body.stream_options is not None and not body.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                          param="stream_options")


def sampling_params(body: SamplingFields, max_new_tokens: int,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name in _PASSTHROUGH:
        value = getattr(body, name)
        if value is not None:
            params[name] = value
    if body.min_tokens is not None:
        params["min_new_tokens"] = body.min_tokens
    if body.logit_bias:
        params["logit_bias"] = dict(body.logit_bias)
    params.update(extra or {})
    return params


def fan_out(body: SamplingFields, prompts: list[list[int]], params: dict[str, Any],
            logprobs: bool, top_logprobs: int, lora: str | None = None) -> list[GenerateRequest]:
    """One engine request per (prompt, choice); choice i gets seed + i. `lora`: the LoRA
    adapter the request's `model` named."""
    base = body.rid or new_rid()
    multiple = len(prompts) * body.n > 1
    reqs = []
    for p, ids in enumerate(prompts):
        for i in range(body.n):
            sp = dict(params)
            if body.seed is not None:
                sp["seed"] = body.seed + i
            index = p * body.n + i
            reqs.append(GenerateRequest(
                rid=f"{base}-{index}" if multiple else base, input_ids=ids, sampling_params=sp,
                stream=STREAM_FROM_ENGINE, return_logprob=logprobs, top_logprobs_num=top_logprobs,
                cache_salt=body.cache_salt, lora_path=lora))
    return reqs


def finish_reason(out: GenerateOutput) -> str | None:
    if not out.finished:
        return None
    kind = (out.finish_reason or {}).get("type")
    return {"stop": "stop", "length": "length"}.get(kind or "", kind or "stop")


def usage(outs: list[GenerateOutput], n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens count once per prompt, completions once per choice."""
    prompt = sum(o.prompt_tokens for o in outs[::n])
    cached = sum(o.cached_tokens for o in outs[::n])
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def token_text(client: LLMEngineClient, token_id: int) -> str:
    decode = getattr(client, "decode", None)
    if decode is None:
        return f"token_id:{token_id}"
    return decode([token_id])


def chat_logprobs(client: LLMEngineClient, out: GenerateOutput, start: int,
                  top_n: int) -> dict[str, Any] | None:
    """OpenAI chat `logprobs` for output tokens [start, completion_tokens)."""
    if out.output_token_logprobs is None:
        return None
    tops = out.output_top_logprobs or []
    content = []
    for k in range(start, len(out.output_token_logprobs)):
        logprob, tid = out.output_token_logprobs[k]
        text = token_text(client, tid)
        top = [{"token": (t := token_text(client, i)), "logprob": lp, "bytes": list(t.encode())}
               for lp, i in (tops[k] if k < len(tops) else [])][:top_n]
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(client: LLMEngineClient, out: GenerateOutput, start: int,
                        text_offset: int) -> dict[str, Any] | None:
    """Legacy completions `logprobs` for output tokens [start, ...)."""
    if out.output_token_logprobs is None:
        return None
    tops = out.output_top_logprobs or []
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for k in range(start, len(out.output_token_logprobs)):
        logprob, tid = out.output_token_logprobs[k]
        text = token_text(client, tid)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append({token_text(client, i): lp for lp, i in tops[k]}
                            if k < len(tops) else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def check_grammar(client: LLMEngineClient, what: str) -> None:
    if not supports_grammar(client):
        raise bad_request(f"response_format {what} is not supported yet by this engine "
                          "(no constrained decoding backend).", param="response_format")


def grammar_params(client: LLMEngineClient, fmt: ResponseFormat | None) -> dict[str, Any]:
    """Engine sampling params for OpenAI's response_format (json_object / json_schema)."""
    if fmt is None or fmt.type == "text":
        return {}
    check_grammar(client, fmt.type)
    if fmt.type == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                          param="response_format")
    return {"json_schema": json.dumps(schema)}


async def respond(
    state: GatewayState,
    client: LLMEngineClient,
    reqs: list[GenerateRequest],
    request: Request,
    stream: bool,
    full: Callable[[list[GenerateOutput]], dict[str, Any]],
    streamer: Callable[[GenerationGroup, Any], AsyncIterator[str]],
) -> Response:
    """Run the requests as one group: a JSON body from `full(outputs)`, or an SSE stream from
    `streamer(group, first_events)`; the group is closed (engine requests aborted) on any exit."""
    group = GenerationGroup(state, client, reqs, request)
    await group.__aenter__()
    try:
        if not stream:
            outs = await group.finals()
            await group.close()
            return JSONResponse(full(outs))
        events = await primed(group.merged())
    except BaseException:
        await group.close()
        raise
    return sse.response(streamer(group, events), on_close=group.close)
