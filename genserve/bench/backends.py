"""Streaming request functions for each server API, measuring what a client sees.

Backends: `genserve` / `sglang` (native `/generate`), `openai` (`/v1/completions`),
`openai-chat` (`/v1/chat/completions`); the OpenAI ones work against llama.cpp's server, vLLM,
SGLang or genserve alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

BACKENDS = ("genserve", "sglang", "openai", "openai-chat")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    prompt_tokens: int | None = None  # as counted by the server, when it says
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between content chunks


@dataclass
class Prompt:
    """What to send: `messages` for chat, `text` for the others."""

    text: str
    messages: list[dict[str, str]]
    output_len: int


def _payload(backend: str, model: str, prompt: Prompt, ignore_eos: bool,
             extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if backend in ("genserve", "sglang"):
        params = {"max_new_tokens": prompt.output_len, "temperature": 0.0,
                  "ignore_eos": ignore_eos}
        return "/generate", {"text": prompt.text, "sampling_params": params, "stream": True,
                             **extra}
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.output_len,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai-chat":
        return "/v1/chat/completions", {"messages": prompt.messages, **body}
    return "/v1/completions", {"prompt": prompt.text, **body}


def _chunk_text(backend: str, data: dict[str, Any], so_far: str) -> str:
    """New text in this chunk."""
    if backend in ("genserve", "sglang"):
        return data.get("text", "")[len(so_far):]  # native streams cumulative text
    choices = data.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _usage(backend: str, data: dict[str, Any], result: RequestResult) -> None:
    if backend in ("genserve", "sglang"):
        meta = data.get("meta_info") or {}
        if "completion_tokens" in meta:
            result.output_tokens = meta["completion_tokens"]
        result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
        result.cached_tokens = meta.get("cached_tokens", result.cached_tokens)
        return
    usage = data.get("usage")
    if usage:
        result.output_tokens = usage.get("completion_tokens", result.output_tokens)
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]


async def send_request(client: httpx.AsyncClient, backend: str, base_url: str, model: str,
                       prompt: Prompt, ignore_eos: bool = True,
                       extra: dict[str, Any] | None = None) -> RequestResult:
    path, body = _payload(backend, model, prompt, ignore_eos, extra or {})
    result = RequestResult()
    start = time.perf_counter()
    last = start
    chunks_with_text = 0
    try:
        async with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data_str = line[5:].strip()
                if data_str == "[DONE]":
                    break
                data = json.loads(data_str)
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                new_text = _chunk_text(backend, data, result.generated_text)
                _usage(backend, data, result)
                if new_text:
                    now = time.perf_counter()
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                    result.generated_text += new_text
        result.e2e = time.perf_counter() - start
        if result.output_tokens == 0:  # the server gave no count: one token per chunk
            result.output_tokens = chunks_with_text
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
