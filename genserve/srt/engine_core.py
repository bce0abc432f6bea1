"""Builds the in-process runtime (model runner + scheduler) from EngineArgs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from genserve.srt.chat_roles import chat_role_markers
from genserve.srt.compile_warm_up import BackgroundWarmUp, warm_up_blocking
from genserve.srt.device import resolve_device
from genserve.srt.encoder_runtime import EncoderRuntime
from genserve.srt.layers.prequantized import precision_class
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import gguf_path_of, gguf_precision_class, resolve_model_folder
from genserve.srt.model_runner import ModelRunner, check_tensor_parallel
from genserve.srt.pooling_config import read_pooling_spec
from genserve.srt.scheduler.scheduler import Scheduler
from genserve.srt.server_args import EngineArgs
from genserve.srt.speculative import refuse_vision_target
from genserve.srt.speculative.draft_model import build_draft_runner, resolve_draft_model
from genserve.srt.speculative.eagle_model import (
    EagleCheckpoint,
    EagleRunner,
    resolve_eagle_checkpoint,
)
from genserve.srt.tokenizer_manager import load_tokenizer

if TYPE_CHECKING:
    from genserve.srt.tp_worker import TPWorkers

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    args: EngineArgs
    folder: Path
    model_name: str
    config: ModelConfig
    tokenizer: Any
    runner: ModelRunner
    scheduler: Scheduler
    tp_workers: TPWorkers | None = None  # tensor-parallel ranks 1..N-1

    def shutdown(self) -> None:
        if self.tp_workers is not None:
            self.tp_workers.stop()
            self.tp_workers = None

    def model_info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "model_path": str(self.args.model_path or self.folder),
            "tokenizer_path": str(self.folder),  # the local folder with the tokenizer files
            "model_name": self.model_name,
            "architecture": cfg.architecture,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "quantization": self.runner.quantization,
            "checkpoint_quantization": self.runner.checkpoint_quantization,
            "compile": self.runner.compiled,
            "attention_backend": self.runner.attention_backend_name,
            "overlap_schedule": self.args.enable_overlap_schedule,
            "cuda_graph_buckets": (self.runner.decode_graphs.buckets
                                   if self.runner.decode_graphs is not None else None),
            "context_length": self.runner.context_length,
            "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_hidden_layers,
            "tp_size": self.args.tp_size,
            "max_total_tokens": self.runner.max_total_tokens,
            "num_threads": torch.get_num_threads(),  # this process's, as it runs
            "eos_token_ids": list(cfg.eos_token_ids),
            "generation_defaults": dict(cfg.generation_defaults),
            "has_tokenizer": self.tokenizer is not None,
            "grammar_backend": "xgrammar" if self.scheduler.grammar is not None else None,
            "chat_roles": chat_role_markers(self.tokenizer),
            "modalities": ["text", "image"] if cfg.multimodal else ["text"],
            "hidden_size": cfg.hidden_size,
            "pooling": self.runner.pooling.to_dict() if self.runner.pooling else None,
            "lora_adapters": ({n: a.path for n, a in self.runner.lora.adapters.items()}
                              if self.runner.lora is not None else {}),
        }


def context_length_for(args: EngineArgs, config: ModelConfig) -> int:
    limit = config.max_position_embeddings
    if args.context_length is None:
        return limit
    if args.context_length > limit:
        raise ValueError(f"context_length {args.context_length} exceeds the model's limit {limit}")
    return args.context_length


def build_runtime(
    args: EngineArgs,
    log_level: str = "info",
    on_rank_death: Callable[[str], None] | None = None,
    plan_pool: Any = None,
) -> Runtime | EncoderRuntime:
    """on_rank_death: called (from a thread) when a tensor-parallel worker dies. An encoder
    embedder or reranker gets an `EncoderRuntime` (transformers' modules, no KV pool); every
    other model, decoder embedders included, the paged runtime.
    plan_pool: the server's memory plan, asked once the weights are in (`ModelRunner`; the
    scheduler process's link: call it, or send a report and receive the pool later); it is
    told the model's name, and an encoder's weights (it has no pool)."""
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    source_precision = None
    if args.quantization in ("auto", "fp8"):
        gguf = gguf_path_of(args.model_path)
        source_precision = gguf_precision_class(gguf) if gguf is not None else None
    args = _quantized_cpu_dtype(args, source_precision)
    folder, name = resolve_model_folder(args.model_path, args.dtype, args.device)
    if args.quantization in ("auto", "fp8") and source_precision is None:
        # A pre-quantized folder (its dtype only matters from here on: no conversion).
        source_precision = precision_class(folder)
        args = _quantized_cpu_dtype(args, source_precision)
    pooling = read_pooling_spec(folder, args.is_embedding)
    named_plan = None if plan_pool is None else _NamedPlan(plan_pool, name)
    if pooling is not None and pooling.runtime == "encoder":
        encoder = EncoderRuntime.build(args, folder, name, pooling)
        if named_plan is not None:
            named_plan(encoder.memory_report())
        return encoder
    if pooling is not None and args.tp_size > 1:
        raise ValueError("--tp is not supported for embedding models yet")
    config = ModelConfig.from_folder(folder)
    if args.speculative_algorithm:  # refused before any weight is read
        refuse_vision_target(config.multimodal)
    tokenizer = load_tokenizer(folder)
    context_length = context_length_for(args, config)
    draft = None if args.speculative_algorithm != "draft" else resolve_draft_model(
        args, config, tokenizer, context_length, pooled=pooling is not None)
    if args.speculative_algorithm == "eagle":
        draft = resolve_eagle_checkpoint(args, config, pooled=pooling is not None)
    if args.tp_size == 1:
        runner = ModelRunner(args, config, folder, context_length, source_precision,
                             pooling=pooling, plan_pool=named_plan,
                             shared_kv_bytes_per_token=draft.kv_bytes_per_token if draft else 0)
        workers = None
    else:
        runner, workers = _start_tensor_parallel(
            args, config, folder, context_length, source_precision, log_level, on_rank_death,
            named_plan,
        )
    draft_runner = None if draft is None else (
        EagleRunner(draft, runner) if isinstance(draft, EagleCheckpoint)
        else build_draft_runner(args, draft, runner, context_length))
    scheduler = Scheduler(args, runner, tokenizer, draft_runner)
    # A blocking warm-up runs before the memory plan's answer (beside the other runtimes'
    # loading); a background one after it, over the pool the runtime keeps.
    blocking = runner.compiled and args.compile_warm_up == "blocking"
    if blocking:
        warm_up_blocking(scheduler)
    if runner.settle_planned_pool():  # the plan gave less than the runner started with
        scheduler = Scheduler(args, runner, tokenizer, draft_runner)
        if blocking:
            warm_up_blocking(scheduler)
    if runner.compiled and not blocking:
        runner.warming = BackgroundWarmUp(runner).start()
    kv_gib = runner.max_total_tokens * runner.kv_bytes_per_token() / 2**30
    checkpoint_fmt = runner.checkpoint_quantization
    logger.info(
        "loaded %s (%s, %s, quantization %s, %s backend): KV pool %d tokens (%.2f GiB), context %d",
        name,
        config.architecture,
        runner.dtype,
        runner.quantization if checkpoint_fmt is None else
        f"{runner.quantization}, checkpoint {checkpoint_fmt} dequantized on load",
        runner.attention_backend_name,
        runner.max_total_tokens,
        kv_gib,
        context_length,
    )
    return Runtime(args, folder, name, config, tokenizer, runner, scheduler, workers)


@dataclass
class _NamedPlan:
    """The memory plan's link with this model's name added to every report it sends."""

    link: Any  # the scheduler process's `_PlanLink`: send(report), receive() -> tokens
    name: str

    def send(self, report: dict) -> None:
        self.link.send({**report, "name": self.name})

    def receive(self) -> int:
        return self.link.receive()

    def __call__(self, report: dict) -> int:
        self.send(report)
        return self.receive()


def _quantized_cpu_dtype(args: EngineArgs, source_precision: str | None) -> EngineArgs:
    """dtype "auto" for weight-only quantized weights on a CPU is float32: the quantized
    matmuls take bfloat16 activations inside them whatever the model's dtype, and the rest of
    the model in float32 kept SmolLM2's teacher-forced agreement with its unquantized weights
    above 95% (in bfloat16 it fell under it) at the same decode speed (docs/benchmarks.md)."""
    quantized = args.quantization in ("int8wo", "int4wo", "fp8") or (
        args.quantization == "auto" and source_precision is not None
    )
    if args.dtype != "auto" or not quantized or resolve_device(args.device).type != "cpu":
        return args
    return replace(args, dtype="float32")


def _start_tensor_parallel(
    args: EngineArgs,
    config: ModelConfig,
    folder: Path,
    context_length: int,
    source_precision: str | None,
    log_level: str,
    on_rank_death: Callable[[str], None] | None,
    plan_pool: Callable[[dict], int] | None = None,
) -> tuple[ModelRunner, TPWorkers]:
    """Start ranks 1..N-1 and load rank 0's share here; a rank that cannot load stops all.
    The memory plan (`plan_pool`) sizes rank 0's pool; every rank then takes the smallest."""
    from genserve.srt.tp_worker import TPWorkers

    check_tensor_parallel(config, args.tp_size)  # before any process starts
    workers = TPWorkers(
        args, config, folder, context_length, source_precision, log_level, on_rank_death
    )
    try:
        runner = ModelRunner(
            args, config, folder, context_length, source_precision, tp=workers.group,
            plan_pool=plan_pool,
        )
        workers.wait_ready()
    except Exception as exc:
        error = workers.startup_error()
        workers.stop()
        if error is not None:
            raise RuntimeError(error) from exc
        raise
    runner.tp_workers = workers
    return runner, workers
