"""Entry point of the scheduler process: owns the model, runs the scheduling loop and talks to
the tokenizer manager (`genserve.srt.async_engine.AsyncEngine`) over a multiprocessing pipe.

A failed integrity check is logged and reported in `server_info` (`integrity_error`); the process
keeps serving. An exception in a step is a bug: it is logged and ends the process, which the
gateway restarts."""

from __future__ import annotations

import logging
import os
import traceback
from multiprocessing.connection import Connection

from genserve.srt.messages import (
    AbortReq,
    BatchReqOutput,
    ControlReq,
    ControlResp,
    TokenizedGenerateReq,
)
from genserve.srt.server_args import EngineArgs
from genserve.supervision import ignore_termination_signals

logger = logging.getLogger("genserve.scheduler")


def run_scheduler_process(args: EngineArgs, conn: Connection, log_level: str = "info",
                          plan_memory: bool = False) -> None:
    """plan_memory: the KV pool's size comes from the server's memory plan: once the weights
    are in, the process sends a "memory_report" ControlResp and reads a "kv_pool" ControlReq
    ({max_total_tokens} or {error}): before it builds the pool, or on a host after its compile
    warm-up (`ModelRunner._first_pool`)."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s [scheduler] %(message)s"
    )
    ignore_termination_signals()
    # torch is imported here, in the child: the gateway imports this module to name the target.
    from genserve.srt.mem_cache import IntegrityError

    try:
        from genserve.srt.engine_core import build_runtime

        runtime = build_runtime(args, log_level, on_rank_death=_exit_on_rank_death,
                                plan_pool=_PlanLink(conn) if plan_memory else None)
    except Exception as exc:  # report load failures to the parent instead of dying silently
        conn.send(ControlResp("ready", 0, False, {"error": f"{type(exc).__name__}: {exc}"}))
        return
    # The resolved folder (a GGUF converted here): the gateway loads its tokenizer from it.
    conn.send(ControlResp("ready", 0, True, {**runtime.model_info(),
                                             "folder": str(runtime.folder)}))
    sched = runtime.scheduler
    integrity_error: str | None = None
    checked_idle = False
    while True:
        if not sched.has_work():
            if not checked_idle:
                try:
                    sched.check_integrity()
                except IntegrityError as exc:
                    integrity_error = str(exc)
                    logger.error("integrity check failed: %s", exc)
                checked_idle = True
            conn.poll(None)  # sleep until the next message
        try:
            while conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, TokenizedGenerateReq):
                    early = sched.add_request(msg)
                    if early is not None:
                        conn.send(BatchReqOutput([early]))
                elif isinstance(msg, AbortReq):
                    sched.abort(msg.rid)
                elif isinstance(msg, ControlReq):
                    if msg.kind == "shutdown":
                        runtime.shutdown()
                        conn.send(ControlResp("shutdown", msg.token, True))
                        return
                    conn.send(_control(sched, msg, integrity_error))
            if sched.has_work():
                checked_idle = False
                outputs = sched.step()
                if outputs:
                    conn.send(BatchReqOutput(outputs))
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the parent is gone
        except Exception:
            logger.error("scheduler crashed:\n%s", traceback.format_exc())
            raise


class _PlanLink:
    """The server's memory plan, asked over the parent's pipe (see run_scheduler_process):
    `send` the report, `receive` the pool; calling it does both (`ModelRunner._first_pool`)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, report: dict) -> None:
        self.conn.send(ControlResp("memory_report", 0, True, report))

    def receive(self) -> int:
        reply = self.conn.recv()
        if not isinstance(reply, ControlReq) or reply.kind != "kv_pool":
            raise RuntimeError(f"expected the memory plan's kv_pool answer, got {reply!r}")
        if "error" in reply.payload:
            raise RuntimeError(f"memory plan: {reply.payload['error']}")
        return int(reply.payload["max_total_tokens"])

    def __call__(self, report: dict) -> int:
        self.send(report)
        return self.receive()


def _lora_control(sched, msg: ControlReq) -> ControlResp:
    """Load or unload an adapter; the reply lists the adapters loaded after it."""
    from genserve.srt.lora.scheduling import load_adapter_into, unload_adapter

    p = msg.payload
    try:
        if msg.kind == "load_lora_adapter":
            load_adapter_into(sched, p.get("lora_name"), p.get("lora_path"))
        else:
            unload_adapter(sched.lora, sched.runner.lora_refusal, sched.reqs, p.get("lora_name"))
    except (ValueError, OSError) as exc:
        return ControlResp(msg.kind, msg.token, False, {"error": str(exc)})
    adapters = {n: a.path for n, a in sched.lora.adapters.items()}
    return ControlResp(msg.kind, msg.token, True, {"adapters": adapters})


def _exit_on_rank_death(reason: str) -> None:
    """A tensor-parallel rank died: this process ends too (a collective waiting for the dead
    rank may never return), so the gateway fails the in-flight requests with 503 and restarts
    the whole group."""
    logger.error("%s; the scheduler process exits", reason)
    logging.shutdown()
    os._exit(1)


def _control(sched, msg: ControlReq, integrity_error: str | None) -> ControlResp:
    if msg.kind == "flush_cache":
        return ControlResp(msg.kind, msg.token, sched.flush_cache())
    if msg.kind == "server_info":
        info = sched.info()
        info["integrity_error"] = integrity_error
        return ControlResp(msg.kind, msg.token, True, info)
    if msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
        return _lora_control(sched, msg)
    if msg.kind == "check_integrity":
        from genserve.srt.mem_cache import IntegrityError

        if sched.has_work():
            return ControlResp(msg.kind, msg.token, False, {"error": "requests are running"})
        try:
            sched.check_integrity()
        except IntegrityError as exc:
            return ControlResp(msg.kind, msg.token, False, {"error": str(exc)})
        return ControlResp(msg.kind, msg.token, True)
    return ControlResp(msg.kind, msg.token, False, {"error": f"unknown control {msg.kind!r}"})
