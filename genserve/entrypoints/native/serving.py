"""Logic of the native API: /generate (single, batch, n, stream) and runtime control."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from genserve import __version__
from genserve.entrypoints import sse
from genserve.entrypoints.admission import new_rid
from genserve.entrypoints.errors import APIError, bad_request, not_found, service_unavailable
from genserve.entrypoints.generation import (
    STREAM_FROM_ENGINE,
    GenerationGroup,
    check_adapter,
    check_context,
    primed,
    supports_grammar,
    tokenize,
)
from genserve.entrypoints.image_inputs import load_images, process_images, require_images
from genserve.entrypoints.native.protocol import (
    DetokenizeReq,
    GenerateReqInput,
    LoadLoRAAdapterReq,
    SamplingParams,
    TokenizeReq,
    UnloadLoRAAdapterReq,
)
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput, GenerateRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

logger = logging.getLogger(__name__)

_HEALTH_GENERATE_TIMEOUT_S = 30.0


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """Broadcast a scalar field, or check a per-prompt list has one entry per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries but there are {count} prompts.",
                              param=name)
        return value
    return [value] * count


async def _prompts(client: LLMEngineClient, body: GenerateReqInput) -> tuple[list[list[int]], bool]:
    """Token ids of every prompt, and whether the request was a batch (list form)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("Give exactly one of 'text' or 'input_ids'.", param="text")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        return [await tokenize(client, t) for t in texts], isinstance(body.text, list)
    ids = body.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(p) for p in ids], True  # type: ignore[arg-type]
    return [list(ids)], False  # type: ignore[arg-type]


def _image_sources(image_data: Any, count: int, is_batch: bool) -> list[list[Any]]:
    """SGLang's image_data: per prompt a source or a list of sources (a single prompt's list
    is its images; a batch's list has one entry per prompt)."""
    if image_data is None:
        return [[] for _ in range(count)]
    if not is_batch:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise bad_request(f"image_data needs one entry per prompt ({count}) in a batch.",
                          param="image_data")
    return [[] if d is None else d if isinstance(d, list) else [d] for d in image_data]


async def build_requests(state: GatewayState, client: LLMEngineClient, body: GenerateReqInput
                         ) -> tuple[list[GenerateRequest], bool]:
    if body.image_data is not None:
        require_images(client, "image_data")
    if body.return_hidden_states:
        raise bad_request("'return_hidden_states' is not supported.", param="return_hidden_states")
    prompts, is_batch = await _prompts(client, body)
    if not prompts:
        raise bad_request("The batch is empty.", param="text")
    count = len(prompts)
    params = _per_prompt(body.sampling_params or SamplingParams(), count, "sampling_params")
    rids = _per_prompt(body.rid, count, "rid")
    salts = _per_prompt(body.cache_salt, count, "cache_salt")
    loras = _per_prompt(body.lora_path, count, "lora_path")
    for lora in loras:
        check_adapter(client, lora, "lora_path")
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    ids_lp = body.token_ids_logprob
    if ids_lp and isinstance(ids_lp[0], list):
        ids_lps = _per_prompt(ids_lp, count, "token_ids_logprob")
    else:
        ids_lps = [ids_lp] * count
    sources = _image_sources(body.image_data, count, is_batch)
    reqs: list[GenerateRequest] = []
    for ids, sp, rid, salt, start, id_lp, srcs, lora in zip(
        prompts, params, rids, salts, starts, ids_lps, sources, loras, strict=True
    ):
        if sp.stop_regex:  # SGLang's frontend sends [] when unset
            raise bad_request("stop_regex is not supported; use stop strings or a regex "
                              "constraint.", param="sampling_params.stop_regex")
        mm_inputs = None
        images = await load_images(state, client, srcs, "image_data")
        if images:
            ids, mm_inputs = await process_images(client, ids, images, "image_data")
        if start >= 0 and not body.return_logprob:
            raise bad_request("logprob_start_len needs return_logprob: true.",
                              param="logprob_start_len")
        if start < -1 or start >= max(len(ids), 1):
            raise bad_request(f"logprob_start_len ({start}) must be -1 or a prompt position in "
                              f"[0, {len(ids)}).", param="logprob_start_len")
        engine_params = sp.to_engine()
        engine_params.pop("stop_regex", None)
        if (sp.json_schema or sp.regex or sp.ebnf) and not supports_grammar(client):
            raise bad_request("Constrained decoding (json_schema / regex / ebnf) is not "
                              "supported by this engine yet.", param="sampling_params")
        check_context(client, len(ids), sp.max_new_tokens)
        n = sp.n or 1
        base_rid = rid or new_rid()
        for i in range(n):
            p = dict(engine_params)
            if sp.seed is not None:
                p["seed"] = sp.seed + i
            reqs.append(GenerateRequest(
                rid=base_rid if n == 1 else f"{base_rid}-{i}", input_ids=ids,
                sampling_params=p, stream=STREAM_FROM_ENGINE, return_logprob=body.return_logprob,
                top_logprobs_num=body.top_logprobs_num, cache_salt=salt,
                logprob_start_len=start, token_ids_logprob=id_lp, mm_inputs=mm_inputs,
                lora_path=lora))
        is_batch = is_batch or n > 1  # SGLang answers n > 1 with a list
    return reqs, is_batch


def _render(client: LLMEngineClient, out: GenerateOutput, with_text: bool) -> dict[str, Any]:
    """The response dict; with_text makes every logprob entry [logprob, token_id, text]."""
    result = out.to_dict()
    decode = getattr(client, "decode", None)
    if with_text and decode is not None:
        meta = result["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [[lp, tid, decode([tid])] for lp, tid in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                    "output_token_ids_logprobs"):
            if key in meta:
                meta[key] = [None if row is None else [[lp, tid, decode([tid])]
                                                       for lp, tid in row]
                             for row in meta[key]]
    return result


async def _stream(client: LLMEngineClient, group: GenerationGroup,
                  events: AsyncIterator[tuple[int, GenerateOutput]], is_batch: bool,
                  with_text: bool) -> AsyncIterator[bytes]:
    try:
        async for index, out in events:
            chunk = _render(client, out, with_text)
            if is_batch:
                chunk["index"] = index
            yield sse.event(chunk)
    except APIError as exc:  # headers are sent: report in-band, as SGLang does
        yield sse.event(exc.body())
    finally:
        await group.__aexit__(None, None, None)
    yield sse.DONE


async def _run_to_end(client: LLMEngineClient, req: GenerateRequest) -> str | None:
    """Error message of the request, or None when it produced its output."""
    try:
        async for out in client.generate(req):
            if out.error is not None:
                return out.error
    except ValueError as exc:
        return str(exc)
    return None


def _add_router_fields(info: dict[str, Any], name: str) -> None:
    """The fields of SGLang's replies that sglang-router reads when it registers a worker: the
    model's id (served name) and the replica's parallel sizes (dp 1; tp from the runtime)."""
    info.setdefault("served_model_name", name)
    info.setdefault("model_path", name)
    info.setdefault("tokenizer_path", info["model_path"])
    if "architecture" in info:
        info.setdefault("architectures", [info["architecture"]])
    info.setdefault("max_context_length", info.get("context_length"))
    info.setdefault("tp_size", 1)
    info.setdefault("dp_size", 1)


class NativeServing:
    """The native (SGLang-compatible) API over the gateway's LLMs: /generate and runtime control.
    One per app, on `GatewayState.native`; it reads the LLM registry, admission, metrics and
    config of that state."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def generate(self, body: GenerateReqInput, request: Request) -> Response:
        state = self.state
        client = state.resolve_llm(body.model)
        reqs, is_batch = await build_requests(state, client, body)
        group = GenerationGroup(state, client, reqs, request)
        await group.__aenter__()
        try:
            if not body.stream:
                outs = await group.finals()
                await group.__aexit__(None, None, None)
                rendered = [_render(client, o, body.return_text_in_logprobs) for o in outs]
                return JSONResponse(rendered if is_batch else rendered[0])
            events = await primed(group.merged())
        except BaseException:
            await group.__aexit__(None, None, None)
            raise
        return sse.response(_stream(client, group, events, is_batch, body.return_text_in_logprobs),
                            on_close=group.close)

    async def health_generate(self) -> Response:
        """200 once every LLM produced one token; 503 otherwise."""
        state = self.state
        for client in state.llm_clients:
            if not client.is_healthy():
                raise service_unavailable(f"The engine serving {client.model_name!r} is down.")
            rid = f"health-{new_rid()}"
            req = GenerateRequest(rid=rid, input_ids=client.tokenize("Hello"),
                                  sampling_params={"max_new_tokens": 1, "temperature": 0.0})
            try:
                error = await asyncio.wait_for(_run_to_end(client, req), _HEALTH_GENERATE_TIMEOUT_S)
            except (TimeoutError, asyncio.TimeoutError):
                await client.abort(rid)
                raise service_unavailable(
                    f"{client.model_name!r} did not generate a token within "
                    f"{_HEALTH_GENERATE_TIMEOUT_S:.0f} s.") from None
            if error is not None:
                raise service_unavailable(f"Health generation failed: {error}")
        return JSONResponse({"status": "ok"})

    def model_info(self, model: str | None) -> dict[str, Any]:
        state = self.state
        client = state.resolve_llm(model)
        info = {"model_name": client.model_name, "context_length": client.context_length,
                "is_generation": True}
        info.update(client.model_info())
        _add_router_fields(info, client.model_name)
        return info

    async def server_info(self, model: str | None) -> dict[str, Any]:
        state = self.state
        client = state.resolve_llm(model)
        info: dict[str, Any] = {
            "version": __version__, "model_name": client.model_name,
            "gateway_in_flight_reqs": state.in_flight.get(client.model_name, 0),
            "max_queued_requests": state.config.max_queued_requests,
        }
        info.update(await client.server_info())
        for key in ("model_path", "tokenizer_path", "architecture", "tp_size", "num_threads"):
            if key in client.model_info():
                info.setdefault(key, client.model_info()[key])
        _add_router_fields(info, client.model_name)
        state.metrics.update_server_info(client.model_name, info)
        if state.diffusion_client is not None:  # its worker's state and self-check result
            info["diffusion"] = state.diffusion_client.runtime_report()
        if state.memory_plan is not None:
            info["memory_plan"] = state.memory_plan
        if state.thread_split is not None:
            info["thread_split"] = state.thread_split
        info["time"] = time.time()
        return info

    async def flush_cache(self, model: str | None) -> dict[str, Any]:
        state = self.state
        client = state.resolve_llm(model)
        if not await client.flush_cache():
            raise bad_request("Cannot flush the cache while requests are running; retry when idle.",
                              code="requests_running")
        return {"success": True, "message": "Cache flushed."}

    async def load_lora_adapter(self, body: LoadLoRAAdapterReq) -> dict[str, Any]:
        """SGLang's reply: {success, error_message, loaded_adapters: {name: path}}; a 400
        names what does not fit."""
        client = self.state.resolve_llm(body.model)
        try:
            loaded = await client.load_lora_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_path") from exc
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterReq) -> dict[str, Any]:
        client = self.state.resolve_llm(body.model)
        try:
            loaded = await client.unload_lora_adapter(body.lora_name)
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_name") from exc
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    async def abort_request(self, rid: str, model: str | None) -> dict[str, Any]:
        state = self.state
        clients = [state.resolve_llm(model)] if model else state.llm_clients
        for client in clients:
            if await client.abort(rid):
                return {"success": True, "rid": rid}
        raise not_found(f"No running or queued request has rid {rid!r}.", param="rid")

    def tokenize_prompts(self, body: TokenizeReq) -> dict[str, Any]:
        """SGLang's /tokenize: {tokens, count, max_model_len}; lists for a list of prompts."""
        state = self.state
        client = state.resolve_llm(body.model)
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        try:
            tokens = [client.encode(p, body.add_special_tokens) for p in prompts]
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from exc
        if isinstance(body.prompt, list):
            return {"tokens": tokens, "count": [len(t) for t in tokens],
                    "max_model_len": client.context_length}
        return {"tokens": tokens[0], "count": len(tokens[0]),
                "max_model_len": client.context_length}

    def detokenize_tokens(self, body: DetokenizeReq) -> dict[str, Any]:
        """SGLang's /detokenize: {text}, a list of texts for a list of token lists."""
        state = self.state
        client = state.resolve_llm(body.model)
        batch = bool(body.tokens) and isinstance(body.tokens[0], list)
        lists = body.tokens if batch else [body.tokens]
        vocab = client.model_info().get("vocab_size")
        for ids in lists:
            bad = [t for t in ids if t < 0 or (isinstance(vocab, int) and t >= vocab)]  # type: ignore[operator]
            if bad:
                raise bad_request(f"Token id {bad[0]} is outside the vocabulary [0, {vocab}).",
                                  param="tokens")
        texts = [client.decode(list(ids)) for ids in lists]  # type: ignore[arg-type]
        return {"text": texts if batch else texts[0]}
