"""`AsyncEngine`: the LLM runtime as the gateway sees it. Tokenizes in a thread pool, runs the
scheduler + model in a child process, and streams cumulative outputs back per request."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from genserve.process_start import preload, process_context, run_in_process
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import (
    AbortReq,
    BatchReqOutput,
    ControlReq,
    ControlResp,
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    MultimodalInputs,
    ReqOutput,
)
from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.server_args import EngineArgs
from genserve.srt.tokenizer_manager import (
    RequestState,
    make_pooling_req,
    make_tokenized_req,
    tokenize_for_embedding,
    tokenize_pair,
)
from genserve.supervision import ProcessSupervisor, RestartPolicy

logger = logging.getLogger(__name__)
# Engines started together (`genserve serve` with several LLMs) load their tokenizers one at a
# time: transformers resolves its lazy module attributes unsafely from two threads at once
# ("module 'transformers' has no attribute 'PreTrainedTokenizerFast'").
_FOLDER_LOAD_LOCK = threading.Lock()


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _SchedulerLink:
    """One scheduler process, its end of the pipe, and the queue its sender thread drains."""

    proc: Any  # multiprocessing.Process
    conn: Connection
    outbox: queue.Queue = field(default_factory=queue.Queue)


class AsyncEngine(LLMEngineClient):
    """Model folder resolution (GGUF conversion included) and the model itself live in the
    scheduler process, which reports the resolved folder; this process loads only the tokenizer
    (and a vision model's placeholder rules) from it, so it never imports torch. A scheduler
    process that dies is restarted by `self.supervisor` with backoff; meanwhile requests get
    EngineDeadError (503)."""

    def __init__(self, args: EngineArgs | None = None, log_level: str = "info",
                 restart_policy: RestartPolicy | None = None,
                 memory_planner: Any = None) -> None:
        """memory_planner: the server's plan (`entrypoints/memory_planner.py`); its
        `llm_report(report)` answers this runtime's KV pool in tokens once the weights are in,
        or raises when the plan does not fit. Restarts keep the planned pool."""
        args = args or EngineArgs()
        self._log_level = log_level
        self._loop: asyncio.AbstractEventLoop | None = None
        self._states: dict[str, tuple[RequestState, asyncio.Queue]] = {}
        self._control: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._closing = False
        self.supervisor = ProcessSupervisor(
            "the LLM scheduler process", lambda: self._spawn(self.args)[0], restart_policy)
        self.args = args
        pid, ready = self._spawn(args, memory_planner)
        try:
            self._load_from_folder(Path(ready.pop("folder")), args)
        except BaseException:
            # The scheduler process ignores SIGTERM, so left running it would keep this
            # process from exiting (multiprocessing joins its children at exit).
            self.close()
            raise
        name = ready["model_name"]
        self.model_name = name
        self.task = self.pooling.task if self.pooling is not None else "generate"
        self.embedding_size = int(ready.get("hidden_size") or 0)
        self.modalities = ("text", "image") if self.vision is not None else ("text",)
        self._info: dict[str, Any] = ready
        self._info["model_path"] = args.model_path or name
        self._info["modalities"] = list(self.modalities)
        self.context_length = int(ready["context_length"])
        self.generation_defaults = dict(ready.get("generation_defaults") or {})
        self._lora: dict[str, str] = dict(ready.get("lora_adapters") or {})
        if memory_planner is not None and ready.get("max_total_tokens"):
            self.args = replace(self.args, max_total_tokens=int(ready["max_total_tokens"]))
        self.supervisor.started(pid)

    def _load_from_folder(self, folder: Path, args: EngineArgs) -> None:
        """The gateway's side of the model: tokenizer, vision input rules and pooling, from the
        folder the scheduler resolved. One engine at a time (`_FOLDER_LOAD_LOCK`)."""
        from genserve.srt.multimodal.processor import VisionInputProcessor
        from genserve.srt.pooling_config import read_pooling_spec
        from genserve.srt.tokenizer_manager import load_tokenizer

        # Restarts load the resolved folder: a GGUF is converted once.
        self.args = replace(args, model_path=str(folder))
        with _FOLDER_LOAD_LOCK:
            self.tokenizer = load_tokenizer(folder)
            self.vision = VisionInputProcessor.from_folder(folder, args.max_images_per_request)
        # Embedders and rerankers: their pooling (prompts, Matryoshka); None for a chat model.
        self.pooling = read_pooling_spec(folder, args.is_embedding)

    def _spawn(self, args: EngineArgs, planner: Any = None) -> tuple[int, dict[str, Any]]:
        """Start a scheduler process and wait until its model is loaded: (pid, its model info
        plus the resolved `folder`). Raises RuntimeError when it cannot start."""
        from genserve.srt.scheduler.process import run_scheduler_process

        if args.compile is not False:
            preload("torch._dynamo")
        ctx = process_context()
        conn, child_conn = ctx.Pipe()
        proc = run_in_process(ctx, run_scheduler_process,
                              (args, child_conn, self._log_level, planner is not None),
                              name="genserve-scheduler")
        child_conn.close()
        try:
            ready = self._wait_ready(proc, conn, planner)
        except BaseException:
            proc.kill()
            proc.join(5)
            conn.close()
            raise
        link = _SchedulerLink(proc, conn)
        self._link = link
        threading.Thread(target=self._send_loop, args=(link,), name="genserve-send",
                         daemon=True).start()
        threading.Thread(target=self._recv_loop, args=(link,), name="genserve-recv",
                         daemon=True).start()
        return proc.pid, dict(ready.payload)

    @staticmethod
    def _wait_ready(proc: Any, conn: Connection, planner: Any = None) -> ControlResp:
        while True:
            if conn.poll(1.0):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg.kind == "memory_report" and planner is not None:
                    try:
                        tokens = planner.llm_report(msg.payload)
                    except BaseException as exc:
                        conn.send(ControlReq("kv_pool", 0, {"error": str(exc)}))
                        proc.join(5)
                        raise
                    conn.send(ControlReq("kv_pool", 0, {"max_total_tokens": tokens}))
                    continue
                if msg is None or not msg.ok:
                    proc.join(5)
                    error = msg.payload.get("error") if msg is not None else "no answer"
                    raise RuntimeError(f"LLM runtime failed to start: {error}")
                return msg
            if not proc.is_alive():
                raise RuntimeError(
                    f"LLM scheduler process exited during startup (code {proc.exitcode})"
                )

    @property
    def _dead(self) -> str | None:
        if self.supervisor.ready:
            return None
        return f"the LLM scheduler process is {self.supervisor.state}"

    # ---- pipe I/O (threads) -----------------------------------------------------------------

    def _send_loop(self, link: _SchedulerLink) -> None:
        while True:
            msg = link.outbox.get()
            if msg is None:
                return
            try:
                link.conn.send(msg)
            except (OSError, BrokenPipeError):
                return

    def _recv_loop(self, link: _SchedulerLink) -> None:
        while True:
            try:
                msg = link.conn.recv()
            except (EOFError, OSError):
                break
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
        link.outbox.put(None)
        link.proc.join(5)
        reason = f"the LLM scheduler process died (exit code {link.proc.exitcode})"
        if not self._closing:
            self.supervisor.process_died(reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchReqOutput):
            for out in msg.outputs:
                entry = self._states.get(out.rid)
                if entry is not None:
                    entry[1].put_nowait(out)
        elif isinstance(msg, ControlResp):
            fut = self._control.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _fail_all(self, reason: str) -> None:
        # Every request sent to the dead process ends now (the new one never saw them).
        for _state, q in self._states.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._control.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._control.clear()

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    # ---- LLMEngineClient --------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:  # type: ignore[override]
        self._bind_loop()
        if self._dead:
            raise EngineDeadError(self._dead)
        self._check_generates()
        params = SamplingParams.from_dict(req.sampling_params, self.generation_defaults)
        if params.n != 1:
            raise ValueError("this client serves n == 1; submit one request per choice")
        if req.input_ids is not None:
            ids = list(req.input_ids)
        elif req.text is not None:
            ids = await asyncio.get_running_loop().run_in_executor(None, self.tokenize, req.text)
        else:
            raise ValueError("a request needs text or input_ids")
        mm_inputs = req.mm_inputs
        if mm_inputs is not None and self.vision is None:
            raise ValueError(f"model {self.model_name!r} does not take image inputs")
        if mm_inputs is None and self.vision is not None:
            self.vision.check_text_only(ids)
        total = len(ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the context length ({self.context_length})"
            )
        if req.lora_path is not None and req.lora_path not in self._lora:
            loaded = ", ".join(sorted(self._lora)) or "none"
            raise ValueError(f"unknown LoRA adapter {req.lora_path!r} (loaded: {loaded})")
        tok_req = make_tokenized_req(
            ids,
            params,
            req.rid,
            req.stream,
            req.return_logprob,
            req.top_logprobs_num,
            req.cache_salt,
            logprob_start_len=req.logprob_start_len,
            token_ids_logprob=req.token_ids_logprob,
            mm_inputs=mm_inputs,
            lora_name=req.lora_path,
        )
        if tok_req.rid in self._states:
            raise ValueError(f"request id {tok_req.rid!r} is already running")
        if self._dead:  # it died while this request was being tokenized
            raise EngineDeadError(self._dead)
        state, q = RequestState(tok_req), asyncio.Queue()
        self._states[tok_req.rid] = (state, q)
        link = self._link
        link.outbox.put(tok_req)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                out: ReqOutput = item
                gen = state.update(out)
                finished = out.finished
                if finished or req.stream:
                    yield gen
                if finished:
                    return
        finally:
            self._states.pop(tok_req.rid, None)
            if not finished and link is self._link and not self._dead:
                link.outbox.put(AbortReq(tok_req.rid))

    def _check_generates(self) -> None:
        """ValueError (a 400) naming what an embedder or reranker serves instead."""
        if self.task != "generate":
            kind = "an embedding" if self.task == "embed" else "a reranker"
            route = "/v1/embeddings" if self.task == "embed" else "/v1/rerank"
            raise ValueError(f"model {self.model_name!r} is {kind} model: it serves {route}, "
                             "not chat or text generation")

    async def embed(self, req: EmbedRequest) -> EmbedOutput:
        self._bind_loop()
        if self._dead:
            raise EngineDeadError(self._dead)
        if self.pooling is None:
            return await super().embed(req)
        self.pooling.check_dimensions(req.dimensions, self.embedding_size)
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("the input is empty: at least one token is required")
        if n > self.context_length:
            raise ValueError(f"the input ({n} tokens) exceeds the model's context length "
                             f"({self.context_length} tokens)")
        tok_req = make_pooling_req(req.input_ids, req.rid, req.dimensions, req.token_type_ids)
        if tok_req.rid in self._states:
            raise ValueError(f"request id {tok_req.rid!r} is already running")
        q: asyncio.Queue = asyncio.Queue()
        self._states[tok_req.rid] = (RequestState(tok_req), q)
        link = self._link
        link.outbox.put(tok_req)
        finished = False
        try:
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            out: ReqOutput = item
            finished = out.finished
            return EmbedOutput(rid=out.rid, embedding=out.embedding or [],
                               prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                               error=out.error, error_status=out.error_status)
        finally:
            self._states.pop(tok_req.rid, None)
            if not finished and link is self._link and not self._dead:
                link.outbox.put(AbortReq(tok_req.rid))

    def embedding_input(self, text: str, prompt_name: str | None = None,
                        prompt: str | None = None) -> list[int]:
        if self.pooling is None or self.pooling.task != "embed":
            return super().embedding_input(text, prompt_name, prompt)
        prefix = self.pooling.prompt_text(prompt_name, prompt)
        return tokenize_for_embedding(self.tokenizer, text, prefix)

    def rerank_input(self, query: str, document: str) -> tuple[list[int], list[int] | None]:
        if self.pooling is None or self.pooling.task != "rerank":
            return super().rerank_input(query, document)
        return tokenize_pair(self.tokenizer, query, document)

    async def process_images(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        if self.vision is None:
            return await super().process_images(input_ids, images)
        return await asyncio.get_running_loop().run_in_executor(
            None, self.vision.process, list(input_ids), list(images)
        )

    async def abort(self, rid: str) -> bool:
        if rid not in self._states:
            return False
        self._link.outbox.put(AbortReq(rid))
        return True

    def lora_adapters(self) -> dict[str, str]:
        return dict(self._lora)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        return await self._lora_call("load_lora_adapter",
                                     {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        return await self._lora_call("unload_lora_adapter", {"lora_name": lora_name})

    async def _lora_call(self, kind: str, payload: dict[str, Any]) -> dict[str, str]:
        resp = await self._call(kind, 120.0, payload)
        if not resp.ok:
            raise ValueError(resp.payload.get("error", f"{kind} failed"))
        self._lora = dict(resp.payload["adapters"])
        # A restarted scheduler process loads the adapters served now.
        self.args = replace(self.args, lora_paths=tuple(f"{n}={p}" for n, p in self._lora.items()))
        return dict(self._lora)

    async def _call(self, kind: str, timeout: float = 30.0,
                    payload: dict[str, Any] | None = None) -> ControlResp:
        self._bind_loop()
        if self._dead:
            raise EngineDeadError(self._dead)
        token = next(self._tokens)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._control[token] = fut
        self._link.outbox.put(ControlReq(kind, token, payload or {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._control.pop(token, None)

    async def flush_cache(self) -> bool:
        return (await self._call("flush_cache")).ok

    async def check_integrity(self) -> tuple[bool, str | None]:
        resp = await self._call("check_integrity")
        return resp.ok, resp.payload.get("error")

    async def server_info(self) -> dict[str, Any]:
        """The scheduler's live facts and `runtime` (the process's state, pid and restarts);
        only `runtime` while the process is restarting."""
        info: dict[str, Any] = {}
        if not self._dead:
            info.update((await self._call("server_info")).payload)
        info["num_inflight_reqs"] = len(self._states)
        info["runtime"] = self.supervisor.report()
        return info

    def tokenize(self, text: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer: send input_ids instead of text")
        if self.vision is not None:
            text = self.vision.rules.expand_text(text, tok)
        # Chat templates that write the BOS token themselves must not get a second one.
        bos = getattr(tok, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        return list(tok.encode(text, add_special_tokens=add_special))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer")
            if self.vision is not None:
                text = self.vision.rules.expand_text(text, self.tokenizer)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self.tokenize(text)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return super().decode(ids)
        return self.tokenizer.decode(ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        self._check_generates()
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja errors: a message shape this template cannot render
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc

    def model_info(self) -> dict[str, Any]:
        return dict(self._info)

    def is_healthy(self) -> bool:
        return self._dead is None and self._link.proc.is_alive()

    def runtime_report(self) -> dict[str, Any]:
        return self.supervisor.report()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._closing = True
        self.supervisor.stop()
        link = self._link
        if link.proc.is_alive():
            link.outbox.put(ControlReq("shutdown", 0))
            link.proc.join(10)
            if link.proc.is_alive():
                link.proc.kill()  # it ignores SIGTERM (see supervision.py)
                link.proc.join(5)
        link.outbox.put(None)
