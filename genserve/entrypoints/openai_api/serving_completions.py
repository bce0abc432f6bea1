"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from genserve.entrypoints import sse
from genserve.entrypoints.errors import APIError, bad_request
from genserve.entrypoints.generation import GenerationGroup, check_context, tokenize
from genserve.entrypoints.openai_api import common
from genserve.entrypoints.openai_api.protocol import CompletionRequest
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


async def _prompt_ids(client: LLMEngineClient, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await tokenize(client, prompt)]
    if not prompt:
        raise bad_request("'prompt' is empty.", param="prompt")
    if isinstance(prompt[0], str):
        return [await tokenize(client, p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _validate(body: CompletionRequest) -> None:
    if body.echo:
        raise bad_request("'echo' is not supported.", param="echo")
    if body.suffix:
        raise bad_request("'suffix' is not supported.", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("'best_of' different from 'n' is not supported.", param="best_of")


def _full_response(client: LLMEngineClient, body: CompletionRequest, response_id: str,
                   outs: list[GenerateOutput]) -> dict[str, Any]:
    want = body.logprobs is not None
    choices = [{
        "index": i, "text": out.text,
        "logprobs": common.completion_logprobs(client, out, 0, 0) if want else None,
        "finish_reason": common.finish_reason(out),
    } for i, out in enumerate(outs)]
    return {"id": response_id, "object": "text_completion", "created": common.now(),
            "model": body.model, "choices": choices, "usage": common.usage(outs, body.n)}


async def _stream(client: LLMEngineClient, body: CompletionRequest, response_id: str,
                  count: int, group: GenerationGroup,
                  events: AsyncIterator[tuple[int, GenerateOutput]]) -> AsyncIterator[bytes]:
    created = common.now()
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    sent_chars = [0] * count
    sent_tokens = [0] * count
    last: list[GenerateOutput | None] = [None] * count

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": response_id, "object": "text_completion",
                                   "created": created, "model": body.model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse.event(payload)

    try:
        async for i, out in events:
            last[i] = out
            if out.completion_tokens <= sent_tokens[i] and not out.finished:
                continue
            logprobs = (common.completion_logprobs(client, out, sent_tokens[i], sent_chars[i])
                        if body.logprobs is not None else None)
            text = out.text[sent_chars[i]:]
            sent_chars[i], sent_tokens[i] = len(out.text), out.completion_tokens
            yield event([{"index": i, "text": text, "logprobs": logprobs,
                          "finish_reason": common.finish_reason(out)}])
        if include_usage and all(o is not None for o in last):
            yield event([], common.usage(last, body.n))  # type: ignore[arg-type]
    except APIError as exc:
        yield sse.event(exc.body())
    finally:
        await group.close()
    yield sse.DONE


class CompletionServing:
    """OpenAI /v1/completions over the gateway's LLMs (one per app, `GatewayState.completions`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def create_completion(self, body: CompletionRequest,
                                request: Request) -> Response:
        state = self.state
        client, lora = state.resolve_llm_adapter(body.model)
        common.reject_unsupported(client, body)
        _validate(body)
        prompts = await _prompt_ids(client, body.prompt)
        max_new = body.max_tokens or 16
        for ids in prompts:
            check_context(client, len(ids), max_new, "max_tokens")
        params = common.sampling_params(body, max_new,
                                        common.grammar_params(client, body.response_format))
        want_logprobs = body.logprobs is not None
        reqs = common.fan_out(body, prompts, params, want_logprobs, body.logprobs or 0, lora)
        response_id = common.completion_id("cmpl")
        return await common.respond(
            state, client, reqs, request, bool(body.stream),
            lambda outs: _full_response(client, body, response_id, outs),
            lambda group, events: _stream(client, body, response_id, len(reqs), group, events),
        )
