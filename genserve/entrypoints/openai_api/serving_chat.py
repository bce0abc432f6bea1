"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from genserve.entrypoints import sse
from genserve.entrypoints.errors import APIError, bad_request
from genserve.entrypoints.generation import (
    GenerationGroup,
    check_context,
    default_max_new_tokens,
    supports_grammar,
    tokenize,
)
from genserve.entrypoints.image_inputs import load_images, process_images, require_images
from genserve.entrypoints.openai_api import common, tools
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, ChatMessage
from genserve.entrypoints.openai_api.reasoning import ReasoningParser, ReasoningStreamer
from genserve.entrypoints.openai_api.tool_calls import ToolCallStreamer
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput, GenerateRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


def _template_messages(client: LLMEngineClient, messages: list[ChatMessage]
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages for the chat template, and the image URLs of their image parts in order
    (a vision model's template renders each {"type": "image"} part as its placeholder)."""
    rendered = []
    images: list[str] = []
    for k, msg in enumerate(messages):
        content: Any = msg.content
        if isinstance(content, list) and any(p.type == "image_url" for p in content):
            require_images(client, f"messages.{k}.content")
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.type == "image_url":
                    images.append(part.image_url.url)
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            content = parts
        elif isinstance(content, list):
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if msg.name:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = msg.tool_calls
        if msg.tool_call_id:
            entry["tool_call_id"] = msg.tool_call_id
        rendered.append(entry)
    return rendered, images


# Known request fields this server cannot honour: a value other than the default is a 400.
_UNHONOURED = {
    "functions": "use 'tools' instead of the deprecated 'functions'",
    "function_call": "use 'tool_choice' instead of the deprecated 'function_call'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


def _validate(body: ChatCompletionRequest) -> None:
    for name, why in _UNHONOURED.items():
        if getattr(body, name) is not None:
            raise bad_request(f"'{name}': {why}.", param=name)
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise bad_request("Only the 'text' output modality is supported.", param="modalities")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true.", param="top_logprobs")
    if body.max_tokens and body.max_completion_tokens and \
            body.max_tokens != body.max_completion_tokens:
        raise bad_request("Give only one of 'max_tokens' and 'max_completion_tokens'.",
                          param="max_completion_tokens")


def _message(out: GenerateOutput, plan: tools.ToolPlan | None,
             reasoning: ReasoningParser | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of one choice and its finish reason."""
    reason = common.finish_reason(out)
    text, thought = out.text, None
    if reasoning is not None:
        thought, text = reasoning.split(out.text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thought is not None:
        message["reasoning_content"] = thought
    if plan is None:
        return message, reason
    content, calls = plan.parser.parse(text)
    message["content"] = content
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        if reason == "stop":
            reason = "tool_calls"
    return message, reason


def _full_response(client: LLMEngineClient, body: ChatCompletionRequest, response_id: str,
                   outs: list[GenerateOutput], plan: tools.ToolPlan | None,
                   reasoning: ReasoningParser | None) -> dict[str, Any]:
    top_n = body.top_logprobs or 0
    choices = []
    for i, out in enumerate(outs):
        message, reason = _message(out, plan, reasoning)
        choices.append({
            "index": i, "message": message,
            "logprobs": common.chat_logprobs(client, out, 0, top_n) if body.logprobs else None,
            "finish_reason": reason})
    return {"id": response_id, "object": "chat.completion", "created": common.now(),
            "model": body.model, "choices": choices, "usage": common.usage(outs, body.n)}


async def _stream(client: LLMEngineClient, body: ChatCompletionRequest, response_id: str,
                  group: GenerationGroup, events: AsyncIterator[tuple[int, GenerateOutput]],
                  plan: tools.ToolPlan | None, reasoning: ReasoningParser | None
                  ) -> AsyncIterator[bytes]:
    created = common.now()
    opts = body.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = opts is not None and opts.continuous_usage_stats
    sent_chars = [0] * body.n
    sent_tokens = [0] * body.n
    started = [False] * body.n
    last: list[GenerateOutput | None] = [None] * body.n
    top_n = body.top_logprobs or 0
    streamers = [ToolCallStreamer(plan.parser) if plan else None for _ in range(body.n)]
    thinkers = [ReasoningStreamer(reasoning) if reasoning else None for _ in range(body.n)]
    called = [False] * body.n

    def chunk(choice: dict[str, Any], usage: dict[str, Any] | None) -> bytes:
        payload: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk",
                                   "created": created, "model": body.model, "choices": [choice]}
        if include_usage:
            payload["usage"] = usage
        return sse.event(payload)

    try:
        async for i, out in events:
            last[i] = out
            text, thought = out.text, ""
            thinker = thinkers[i]
            if thinker is not None:
                thought, text = thinker.update(out.text, out.finished)
            delta: dict[str, Any] = {"content": text[sent_chars[i]:]}
            sent_chars[i] = max(sent_chars[i], len(text))
            streamer = streamers[i]
            if streamer is not None:
                content, calls = streamer.update(text, out.finished)
                delta = {"content": content}
                if calls:
                    delta["tool_calls"] = calls
                    called[i] = True
            if thought:
                delta["reasoning_content"] = thought
            if not started[i]:
                delta = {"role": "assistant", **delta}
                started[i] = True
            new_tokens = out.completion_tokens > sent_tokens[i]
            if not (new_tokens or out.finished or delta.get("role")):
                continue
            logprobs = (common.chat_logprobs(client, out, sent_tokens[i], top_n)
                        if body.logprobs else None)
            sent_tokens[i] = out.completion_tokens
            reason = common.finish_reason(out)
            if reason == "stop" and called[i]:
                reason = "tool_calls"
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            yield chunk(choice, common.usage([out], 1) if continuous else None)
        if include_usage and all(o is not None for o in last):
            yield sse.event({"id": response_id, "object": "chat.completion.chunk",
                             "created": created, "model": body.model, "choices": [],
                             "usage": common.usage(last, body.n)})  # type: ignore[arg-type]
    except APIError as exc:
        yield sse.event(exc.body())
    finally:
        await group.close()
    yield sse.DONE


@dataclass
class PreparedChat:
    """A checked chat request, ready to run (see `ChatServing.prepare`)."""

    client: LLMEngineClient
    prompt_ids: list[int]
    reqs: list[GenerateRequest]
    plan: tools.ToolPlan | None
    reasoning: ReasoningParser | None


class ChatServing:
    """OpenAI /v1/chat/completions over the gateway's LLMs (one per app, `GatewayState.chat`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def prepare(self, body: ChatCompletionRequest) -> PreparedChat:
        """Everything short of running: checks, the rendered and tokenized prompt, images,
        tools and the engine requests. The Anthropic and Ollama families translate their
        requests into a ChatCompletionRequest and share this, so the tool-call machinery,
        grammar enforcement and image path are one."""
        state = self.state
        client, lora = state.resolve_llm_adapter(body.model)
        common.reject_unsupported(client, body)
        _validate(body)
        extra = common.grammar_params(client, body.response_format)
        plan = tools.plan_tools(client, body, state.config.tool_call_parser,
                                supports_grammar(client))
        if plan is not None and plan.grammar:
            if extra:
                raise bad_request("Give either response_format or a forced tool_choice, not both.",
                                  param="response_format")
            extra = plan.grammar
        messages, image_urls = _template_messages(client, body.messages)
        images = await load_images(state, client, image_urls, "messages")
        try:
            if plan is None:
                prompt = client.apply_chat_template(messages, body.add_generation_prompt)
            elif plan.own_rendering:
                prompt = client.apply_chat_template(tools.own_tool_messages(messages, plan.tools),
                                                    body.add_generation_prompt)
            else:
                prompt = client.apply_chat_template(messages, body.add_generation_prompt,
                                                    tools=plan.tools)
        except ValueError as exc:
            raise bad_request(f"Cannot apply the chat template: {exc}", param="messages") from exc
        ids = await tokenize(client, prompt)
        mm_inputs = None
        if images:
            ids, mm_inputs = await process_images(client, ids, images, "messages")
        max_new = body.max_completion_tokens or body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        check_context(client, len(ids), max_new, name)
        if max_new is None:
            max_new = default_max_new_tokens(client, len(ids))
        params = common.sampling_params(body, max_new, extra)
        reqs = common.fan_out(body, [ids], params, body.logprobs, body.top_logprobs or 0,
                              lora)
        for req in reqs:
            req.mm_inputs = mm_inputs
        name = state.config.reasoning_parser
        reasoning = ReasoningParser(name) if name else None
        return PreparedChat(client, ids, reqs, plan, reasoning)

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     request: Request) -> Response:
        prep = await self.prepare(body)
        client, plan, reasoning = prep.client, prep.plan, prep.reasoning
        response_id = common.completion_id("chatcmpl")
        return await common.respond(
            self.state, client, prep.reqs, request, bool(body.stream),
            lambda outs: _full_response(client, body, response_id, outs, plan, reasoning),
            lambda group, events: _stream(client, body, response_id, group, events, plan,
                                          reasoning),
        )
