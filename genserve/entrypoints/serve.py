"""`genserve serve`: start the runtimes, put the gateway in front, shut down cleanly.

SIGTERM / SIGINT drain: the listening socket closes, in-flight responses and queued diffusion
work (video jobs) get `--shutdown-timeout` seconds to finish, what is left is cancelled, the
runtimes' processes are stopped and the process exits 0. A second SIGINT forces the exit.
The runtime processes ignore both signals (Ctrl-C reaches the whole process group): stopping them
is this process's job, after the drain.

Every runtime starts at once, except on a host (no GPU) whose first LLM compiles its decode
step with a blocking warm-up (`--compile-warm-up blocking`): there the first LLM starts alone
and the other runtimes once its weights are in. Loading is CPU-bound, so starting everything
at once only slows the first LLM's load, and its warm-up, the longest single step of such a
start and one thread wide, then runs beside the others' loading instead of after it. With the
default background warm-up nothing waits on the compile, and starting everything at once
answers soonest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from genserve import envs
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.memory_planner import PlanAborted, ServerMemoryPlanner
from genserve.entrypoints.middleware import LOOPBACK_HOST_NAMES
from genserve.srt.client import LLMEngineClient
from genserve.thread_split import ThreadSplit, available_cores, split_threads

logger = logging.getLogger("genserve.serve")

_POLL_S = 0.2


def configure_logging(level: str | None) -> str:
    level = (level or envs.GENSERVE_LOG_LEVEL.get()).lower()
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return level


def engine_args_from(args: argparse.Namespace, model_path: str | None) -> Any:
    from genserve.srt.server_args import EngineArgs

    kwargs: dict[str, Any] = {
        "model_path": model_path, "device": args.device,
        "schedule_policy": args.schedule_policy,
        "max_running_requests": args.max_running_requests,
        "context_length": args.context_length, "max_total_tokens": args.max_total_tokens,
        "disable_radix_cache": args.disable_radix_cache,
        "attention_backend": args.attention_backend,
        "jump_forward": not getattr(args, "disable_jump_forward", False),
        "is_embedding": getattr(args, "is_embedding", False),
    }
    for name in ("dtype", "mem_fraction", "chunked_prefill_size", "page_size", "num_threads",
                 "grammar_backend", "max_images_per_request", "image_cache_bytes",
                 "quantization", "compile", "compile_warm_up", "tp_size", "speculative_algorithm",
                 "speculative_num_draft_tokens", "speculative_draft_model_path",
                 "speculative_num_steps", "speculative_ngram_min_match_window_size",
                 "speculative_ngram_max_match_window_size", "speculative_ngram_max_bfs_breadth",
                 "max_loaded_loras", "enable_cuda_graph", "cuda_graph_max_bs",
                 "enable_overlap_schedule"):
        value = getattr(args, name, None)
        if value is not None:  # else the runtime's default
            kwargs[name] = value
    if getattr(args, "lora_paths", None):
        kwargs["lora_paths"] = tuple(args.lora_paths)
    return EngineArgs(**kwargs)


def allowed_hosts_for(bind: str, named: list[str] | None) -> tuple[str, ...]:
    """The Host names the server answers to: those named by `--allowed-host`, else, for a
    loopback bind address, the loopback names and the address itself (closing DNS rebinding on
    the key-less local server), else any (a server on a public address is reached by names it
    cannot know)."""
    if named:
        return tuple(n.strip() for arg in named for n in arg.split(",") if n.strip())
    try:
        loopback = ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        loopback = bind.lower() in ("localhost", "localhost.")
    return (*LOOPBACK_HOST_NAMES, bind.strip("[]").lower()) if loopback else ()


def gateway_config_from(args: argparse.Namespace) -> GatewayConfig:
    # The waiting-queue limit is enforced at admission in the gateway, which counts every LLM
    # request it holds (running + waiting): past that a request gets 503 at once.
    limit = None
    if args.max_queued_requests is not None:
        limit = args.max_queued_requests + args.max_running_requests
    return GatewayConfig(
        api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_host),
        cors_origins=tuple(args.cors_origin or ()), max_queued_requests=limit,
        served_model_names=tuple(args.served_model_name or ()),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        max_realtime_sessions=args.max_realtime_sessions, host=args.host, port=args.port,
        allowed_image_domains=tuple(
            d.strip() for arg in args.allowed_image_domains or () for d in arg.split(",")
            if d.strip()),
        max_image_bytes=args.max_image_bytes)


def _wanted(args: argparse.Namespace) -> tuple[bool, bool]:
    """(serve an LLM, serve diffusion): both by default; naming models of only one kind
    serves only that kind."""
    named_llm, named_diff = bool(args.model_path), bool(args.diffusion_model_path)
    llm = not args.no_llm and (named_llm or not named_diff)
    diffusion = not args.no_diffusion and (named_diff or not named_llm)
    if not (llm or diffusion):
        raise ValueError("nothing to serve: --no-llm and --no-diffusion were both given")
    return llm, diffusion


def host_only(device: str) -> bool:
    """Whether the runtimes run on the host: --device cpu, or auto with no NVIDIA GPU visible
    (told without importing torch, which the gateway never does)."""
    if device != "auto":
        return device == "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return True
    return not os.path.exists("/proc/driver/nvidia/version")


def plan_threads(args: argparse.Namespace, want_llm: bool, want_diffusion: bool,
                 cores: int | None = None) -> ThreadSplit:
    """The thread split of this server (genserve/thread_split.py), written into `args` for the
    runtimes to start with: `num_threads` of each LLM process (of each rank under --tp: the
    ranks divide the LLMs' share), `diffusion_num_threads`. Several diffusion workers or
    context-parallel ranks keep their own division of the cores."""
    env_threads = envs.GENSERVE_NUM_THREADS.get() or None
    split = split_threads(
        available_cores() if cores is None else cores,
        len(llm_paths(args)) if want_llm else 0, want_diffusion,
        llm_override=getattr(args, "num_threads", None),
        diffusion_override=getattr(args, "diffusion_num_threads", None) or env_threads)
    tp = getattr(args, "tp_size", None) or 1
    if tp > 1 and split.llm_threads and getattr(args, "num_threads", None) is None:
        # A tensor-parallel LLM is tp processes that compute at once: they share its cores.
        split = dataclasses.replace(split, llm_threads=max(1, split.llm_threads // tp))
    if split.llm_threads:
        args.num_threads = split.llm_threads
    several = (getattr(args, "diffusion_workers", None) or 1) > 1 or (
        getattr(args, "diffusion_cp", None) or 1) > 1
    if split.diffusion_threads and not several:
        args.diffusion_num_threads = split.diffusion_threads
    return split


def import_async_engine() -> Any:
    """The runtime's `AsyncEngine` class (importing it does not import torch)."""
    from genserve.srt.engine import AsyncEngine

    return AsyncEngine


def default_llm_paths(tp_size: int = 1) -> list[str | None]:
    """The LLMs served when none is named: the default rows of the LLM named-model table (None
    is the embedded default); with --tp > 1 only those tensor parallelism splits."""
    from genserve.srt.named_models import default_model_paths

    return default_model_paths(tp_size)


def llm_engine_args(args: argparse.Namespace, path: str | None) -> Any:
    """`engine_args_from`, except that a default model whose row is not quantizable (a
    vision-language model served beside the text one) keeps its own weights under an explicit
    --quantization int8wo / int4wo, and a default vision-language model decodes plainly under
    --speculative-algorithm (both serve text models), instead of failing the whole server."""
    from genserve.srt.named_models import row_for_path

    engine_args = engine_args_from(args, path)
    if getattr(args, "compile_warm_up", None) is None:  # a server answers before it compiles
        engine_args = dataclasses.replace(engine_args, compile_warm_up="background")
    row = row_for_path(path)
    if (not args.model_path and row is not None and not row.quantizable
            and engine_args.quantization in ("int8wo", "int4wo", "fp8")):
        logger.info("%s (%s) runs unquantized: --quantization %s applies to text models",
                    row.name, row.summary, engine_args.quantization)
        engine_args = dataclasses.replace(engine_args, quantization="none")
    if (not args.model_path and row is not None and row.task == "vision chat"
            and engine_args.speculative_algorithm):
        logger.info("%s (%s) decodes without speculation: --speculative-algorithm applies to "
                    "text models", row.name, row.summary)
        engine_args = dataclasses.replace(engine_args, speculative_algorithm=None,
                                          speculative_draft_model_path=None,
                                          speculative_num_steps=None)
    if (not args.model_path and row is not None and row.task == "vision chat"
            and engine_args.lora_paths):
        logger.info("%s (%s) serves no LoRA adapters: --lora-paths applies to text models",
                    row.name, row.summary)
        engine_args = dataclasses.replace(engine_args, lora_paths=())
    return engine_args


def llm_paths(args: argparse.Namespace) -> list[str | None]:
    """The LLMs this server starts: those named, else the defaults."""
    return args.model_path or default_llm_paths(getattr(args, "tp_size", None) or 1)


async def _in_own_thread(fn: Any, *args: Any) -> Any:
    """`asyncio.to_thread` on a thread of its own: runtimes starting together wait for each
    other in the memory plan, which would deadlock the default pool's few threads."""
    pool = ThreadPoolExecutor(1)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)


def _first_failure(failures: list[BaseException]) -> BaseException:
    """The failure to report: a runtime's own, not another's wait that it cut short."""
    return next((e for e in failures if not isinstance(e, PlanAborted)), failures[0])


async def _start_llms(args: argparse.Namespace, clients: list[LLMEngineClient],
                      planner: ServerMemoryPlanner | None = None) -> None:
    """Start every LLM runtime at once, appending those that run to `clients` in the order
    given: when one fails to start, the caller still shuts down the others (their processes
    otherwise kept the failed server from exiting), and the first failure is raised. Each
    loads in its own process; with `planner` each waits, weights loaded, for the server's
    memory plan to size its KV pool (so runtimes sharing a GPU no longer count the same free
    memory), and a runtime that fails stops the others' wait."""
    from genserve.srt.named_models import row_for_path

    AsyncEngine = import_async_engine()  # noqa: N806 (a class)

    def start(path: str | None, staggered: bool) -> LLMEngineClient:
        try:
            if staggered:
                planner.weights_in.wait()  # type: ignore[union-attr]
            engine_args = llm_engine_args(args, path)
            logger.info("loading LLM %s", path or f"(embedded {row_for_path(None).name})")
            if planner is None:
                return AsyncEngine(engine_args)
            # --mem-fraction is the whole server's share, applied by the plan.
            engine_args = dataclasses.replace(engine_args, mem_fraction=None)
            return AsyncEngine(engine_args, memory_planner=planner)
        except BaseException as exc:
            if planner is not None:
                planner.abort(f"{path or 'the default LLM'}: {exc}")
            raise

    stagger = _stagger(args, planner)
    started = await asyncio.gather(
        *(_in_own_thread(start, p, stagger and i > 0) for i, p in enumerate(llm_paths(args))),
        return_exceptions=True)
    clients.extend(e for e in started if not isinstance(e, BaseException))
    failures = [e for e in started if isinstance(e, BaseException)]
    if failures:
        raise _first_failure(failures)
    for engine in clients:
        info = await engine.server_info()
        logger.info("LLM %r ready: context length %d, KV pool %s tokens", engine.model_name,
                    engine.context_length, info.get("max_total_tokens", "?"))


def _stagger(args: argparse.Namespace, planner: ServerMemoryPlanner | None) -> bool:
    """Whether the other runtimes wait for the first LLM's weights (the module's docstring)."""
    blocking = getattr(args, "compile_warm_up", None) == "blocking"
    return planner is not None and blocking and host_only(args.device)


async def _start_diffusion(args: argparse.Namespace, started: list[Any],
                           planner: ServerMemoryPlanner | None = None,
                           stagger: bool = False) -> None:
    """Start the diffusion runtime, appending its client to `started` (for the caller to shut
    down whatever happens next); then give the memory plan its report. stagger: start once
    the first LLM's weights are in (see the module's docstring)."""
    try:
        from genserve.multimodal_gen.launch import start_diffusion_client
    except ImportError as exc:
        logger.warning("diffusion runtime unavailable (%s); serving LLMs only", exc)
        if planner is not None:
            planner.diffusion_report([])
        return
    paths = args.diffusion_model_path or None
    if planner is not None and stagger:
        await _in_own_thread(planner.weights_in.wait)
    logger.info("loading diffusion models %s", paths or "(embedded defaults)")
    try:
        client = await _in_own_thread(start_diffusion_client, paths, args)
    except BaseException as exc:
        if planner is not None:
            planner.abort(f"diffusion: {exc}")
        raise
    started.append(client)
    logger.info("diffusion models ready: %s", ", ".join(m["id"] for m in client.list_models()))
    if planner is not None:
        planner.diffusion_report(client.memory_reports())


async def _start_runtimes(args: argparse.Namespace, llm_clients: list[LLMEngineClient],
                          diffusion: list[Any], planner: ServerMemoryPlanner) -> None:
    """Every runtime at once, under one memory plan; the first failure is raised after all
    have ended (the started ones are in `llm_clients` and `diffusion`)."""
    want_llm, want_diffusion = _wanted(args)
    if want_llm and want_diffusion:
        _preload_diffusion_imports()
    starts = []
    if want_llm:
        starts.append(_start_llms(args, llm_clients, planner))
    if want_diffusion:
        stagger = want_llm and _stagger(args, planner)
        starts.append(_start_diffusion(args, diffusion, planner, stagger))
    results = await asyncio.gather(*starts, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise _first_failure(failures)


def _preload_diffusion_imports() -> None:
    """Have the runtimes' fork server, which the first LLM starts, import the diffusion
    worker's modules too: imported there once, the worker does not import them after the LLMs'
    start, nor a vision model's processor the transformers bases they share."""
    try:
        from genserve.multimodal_gen.engine_client import WORKER_PRELOAD
    except ImportError:  # no diffusion runtime here: _start_diffusion says so
        return
    from genserve.process_start import preload

    preload(*WORKER_PRELOAD)


def _make_server(app: Any, config: GatewayConfig, log_level: str,
                 shutdown_timeout: float) -> Any:
    import time

    import uvicorn

    class Server(uvicorn.Server):
        stop_requested_at: float | None = None  # time.monotonic() of the first signal

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the signal after serving, which would kill us before the
            # engines are shut down; here a signal only asks the server to exit.
            loop = asyncio.get_running_loop()

            def on_signal(sig: int) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                if self.stop_requested_at is None:
                    self.stop_requested_at = time.monotonic()
                    logger.info("draining: finishing in-flight work for up to %.0f s",
                                shutdown_timeout)
                self.should_exit = True

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server(uvicorn.Config(
        # lifespan on: routers (realtime) release their resources at shutdown through it.
        app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
        timeout_graceful_shutdown=shutdown_timeout))


async def serve(args: argparse.Namespace, log_level: str) -> None:
    from genserve.entrypoints.app import create_app

    config = gateway_config_from(args)
    want_llm, want_diffusion = _wanted(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    llm_clients: list[LLMEngineClient] = []
    diffusion: list[Any] = []  # the diffusion client, once started
    planner = ServerMemoryPlanner(len(llm_paths(args)) if want_llm else 0, want_diffusion,
                                  getattr(args, "mem_fraction", None))
    threads = plan_threads(args, want_llm, want_diffusion)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    logger.info("thread split on %d cores%s: %d per LLM process (%d), %d for diffusion (%s)",
                threads.cores, f" (OMP_NUM_THREADS={omp})" if omp else "",
                threads.llm_threads, threads.llm_processes, threads.diffusion_threads,
                threads.rule)
    try:
        await _start_runtimes(args, llm_clients, diffusion, planner)
        diffusion_client = diffusion[0] if diffusion else None
        app = create_app(config, llm_clients, diffusion_client, memory_plan=planner.report(),
                         thread_split=threads.as_dict())
        server = _make_server(app, config, log_level, args.shutdown_timeout)
        host = f"[{config.host}]" if ":" in config.host else config.host
        logger.info("genserve listening on http://%s:%d (models: %s)", host, config.port,
                    ", ".join(app.state.gateway.llm_names()) or "none")
        registration = None
        if getattr(args, "register_with", None):
            from genserve.entrypoints.data_parallel import register_with_router

            own_url = args.advertise_url or f"http://{host}:{config.port}"
            registration = asyncio.create_task(
                register_with_router(args.register_with, own_url, config.api_key))
        await server.serve()
        if diffusion_client is not None and server.stop_requested_at is not None:
            await _drain_diffusion(diffusion_client,
                                   server.stop_requested_at + args.shutdown_timeout)
        if registration is not None:
            registration.cancel()
    finally:
        logger.info("shutting down")
        for client in llm_clients:
            await _quietly(client.shutdown())
        for client in diffusion:
            await _quietly(client.shutdown())


async def _drain_diffusion(client: Any, deadline: float) -> None:
    """Wait (until `deadline`, monotonic) for the diffusion work no HTTP response waits on:
    queued and running video jobs. Shutting the worker down then cancels what is left."""
    import time

    while client.queue_depth() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    if client.queue_depth():
        logger.warning("cancelling %d diffusion request(s) still running at the shutdown "
                       "timeout", client.queue_depth())


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:  # shutting one runtime down must not skip the others
        logger.warning("shutdown error: %s", exc)


def run_serve(args: argparse.Namespace) -> int:
    log_level = configure_logging(args.log_level)
    asyncio.run(serve(args, log_level))
    return 0
