"""Running requests through an `LLMEngineClient` on behalf of one HTTP request.

Shared by the native and OpenAI families: admission (503 when full), context-length checks
(400 with the numbers), error mapping, metrics timing, and abort on client disconnect.

Disconnects are caught two ways: a watcher task that sees `http.disconnect` and aborts the
engine requests (works while the engine is silent, and for non-streaming requests), and a
shielded `finally` that closes the engine iterators when Starlette cancels a streaming body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request

from genserve.entrypoints.errors import APIError, bad_request, service_unavailable
from genserve.entrypoints.metrics import RequestTimer
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput, GenerateRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

logger = logging.getLogger(__name__)

# Engine requests always stream, even for non-streaming HTTP requests: the gateway then times
# every token (TTFT / inter-token metrics) and the engine already produces per-step outputs.
STREAM_FROM_ENGINE = True

# Texts longer than this are tokenized in a worker thread so the event loop stays responsive.
_INLINE_TOKENIZE_CHARS = 4096


async def tokenize(client: LLMEngineClient, text: str) -> list[int]:
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return client.tokenize(text)
    return await asyncio.to_thread(client.tokenize, text)


def check_adapter(client: LLMEngineClient, lora: str | None, param: str) -> None:
    """400 naming a LoRA adapter the model does not serve (None: the base model)."""
    if lora is None:
        return
    loaded = client.lora_adapters()
    if lora not in loaded:
        raise bad_request(f"Unknown LoRA adapter {lora!r}; loaded adapters of "
                          f"{client.model_name!r}: {', '.join(sorted(loaded)) or 'none'}.",
                          param=param, code="lora_adapter_not_found")


def check_context(client: LLMEngineClient, prompt_len: int, max_new_tokens: int | None,
                  max_tokens_name: str = "max_new_tokens") -> None:
    """400 when the prompt, or prompt + output budget, does not fit the context."""
    limit = client.context_length
    if prompt_len == 0:
        raise bad_request("The prompt is empty.", param="prompt")
    if prompt_len >= limit:
        raise bad_request(
            f"The prompt has {prompt_len} tokens but the model's context length is {limit} "
            f"tokens (at least one must be left to generate).", param="prompt",
            code="context_length_exceeded")
    if max_new_tokens is not None and prompt_len + max_new_tokens > limit:
        raise bad_request(
            f"The prompt has {prompt_len} tokens and {max_tokens_name} is {max_new_tokens}: "
            f"{prompt_len + max_new_tokens} tokens exceed the model's context length of "
            f"{limit}. Lower {max_tokens_name} to at most {limit - prompt_len}.",
            param=max_tokens_name, code="context_length_exceeded")


def default_max_new_tokens(client: LLMEngineClient, prompt_len: int) -> int:
    """Output budget when the client gives none: the rest of the context, and never more than
    the KV pool could hold next to the prompt (a request that can never fit is refused)."""
    limit = client.context_length
    pool = client.model_info().get("max_total_tokens")
    if isinstance(pool, int) and pool > 0:
        limit = min(limit, pool)
    return max(1, limit - prompt_len)


def output_error(out: GenerateOutput) -> APIError | None:
    """The HTTP error an engine output carries, if any."""
    if out.error is None:
        return None
    status = out.error_status if 400 <= out.error_status <= 599 else 500
    return APIError(status, out.error)


async def wait_disconnect(request: Request) -> None:
    """Returns once the client has gone (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class GenerationGroup:
    """The engine requests serving one HTTP request (n choices, batch prompts), as one unit.

    Use as `async with`: entering admits the requests (503 when the queue is full) and starts
    the disconnect watcher; leaving aborts whatever has not finished.
    """

    def __init__(self, state: GatewayState, client: LLMEngineClient,
                 reqs: Sequence[GenerateRequest], request: Request | None) -> None:
        self.state = state
        self.client = client
        self.reqs = list(reqs)
        self.request = request
        self.timers = [RequestTimer(state.metrics, client.model_name) for _ in self.reqs]
        self.finished: set[str] = set()
        self.disconnected = False
        self._iters: list[AsyncIterator[GenerateOutput]] = []
        self._stack = ExitStack()
        self._watcher: asyncio.Task[None] | None = None
        self._pumps: list[asyncio.Task[None]] = []  # merged(): one task per request
        self._closed = False

    async def __aenter__(self) -> GenerationGroup:
        self._stack.enter_context(self.state.admit(self.client, len(self.reqs)))
        if self.request is not None:
            self._watcher = asyncio.create_task(self._watch(self.request))
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort what has not finished and release the queue slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        # Shielded: when Starlette cancels a streaming body, cleanup must still run to the end.
        with anyio.CancelScope(shield=True):
            if self._watcher is not None:
                self._watcher.cancel()
            # Stop the pumps first: each is inside its engine iterator, and cancelling it
            # runs that iterator's cleanup (an iterator cannot be closed while it runs).
            for task in self._pumps:
                task.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)
            for it in self._iters:
                try:
                    await it.aclose()  # type: ignore[attr-defined]
                except Exception as exc:  # cleanup must reach every request
                    logger.warning("closing a generation stream failed: %s", exc)
            for req, timer in zip(self.reqs, self.timers, strict=True):
                if req.rid not in self.finished:
                    await self._abort(req.rid)
                    timer.finish(None, "abort")
            self._stack.close()

    async def _abort(self, rid: str) -> None:
        try:
            await self.client.abort(rid)
        except Exception as exc:
            logger.warning("abort of %s failed: %s", rid, exc)

    async def _watch(self, request: Request) -> None:
        await wait_disconnect(request)
        self.disconnected = True
        logger.info("client disconnected; aborting %d request(s)", len(self.reqs))
        for req in self.reqs:
            if req.rid not in self.finished:
                await self._abort(req.rid)

    def _start(self, index: int) -> AsyncIterator[GenerateOutput]:
        try:
            it = self.client.generate(self.reqs[index])
        except Exception as exc:
            raise self._engine_error(exc) from exc
        self._iters.append(it)
        return it

    def _engine_error(self, exc: Exception) -> APIError:
        """ValueError = bad input (400); a dead engine = 503; anything else is a bug (500)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ValueError):
            return bad_request(str(exc))
        name = self.client.model_name
        if not self.client.is_healthy():
            return service_unavailable(f"The engine serving {name!r} stopped: {exc}",
                                       "engine_dead")
        logger.error("engine error for %s: %r", name, exc, exc_info=exc)
        return APIError(500, f"The engine serving {name!r} failed: {exc}")

    async def stream(self, index: int) -> AsyncIterator[GenerateOutput]:
        """Outputs of request `index`; raises APIError for engine-reported errors."""
        req, timer = self.reqs[index], self.timers[index]
        it = self._start(index)
        while True:
            try:
                out = await it.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:  # invalid input found by the engine, or a dead engine
                raise self._engine_error(exc) from exc
            error = output_error(out)
            if error is not None:
                self.finished.add(req.rid)
                timer.finish(out, "error")
                raise error
            timer.on_output(out)
            if out.finished:
                self.finished.add(req.rid)
                timer.finish(out)
            yield out
            if out.finished:
                return

    async def final(self, index: int) -> GenerateOutput:
        last: GenerateOutput | None = None
        async for out in self.stream(index):
            last = out
        if last is None:
            raise APIError(500, "The engine ended the request without a result.")
        return last

    async def finals(self) -> list[GenerateOutput]:
        """Final outputs of every request, run concurrently."""
        if len(self.reqs) == 1:
            return [await self.final(0)]
        return list(await asyncio.gather(*(self.final(i) for i in range(len(self.reqs)))))

    async def merged(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """(index, output) from every request as they arrive."""
        if len(self.reqs) == 1:
            async for out in self.stream(0):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException | None]] = (
            asyncio.Queue())

        async def pump(i: int) -> None:
            try:
                async for out in self.stream(i):
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # forwarded to the consumer
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.reqs))]
        self._pumps.extend(tasks)
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()


async def primed(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Fetch the first item now (so errors become a proper HTTP status before any byte is
    sent), then return an iterator that yields it and the rest."""
    try:
        first = await items.__anext__()
    except StopAsyncIteration:
        first = _EMPTY

    async def rest() -> AsyncIterator[Any]:
        if first is _EMPTY:
            return
        yield first
        async for item in items:
            yield item

    return rest()


_EMPTY = object()


def supports_grammar(client: LLMEngineClient) -> bool:
    """Whether the engine does constrained decoding (json_schema / regex / ebnf)."""
    return bool(client.model_info().get("grammar_backend"))
