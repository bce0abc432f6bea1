"""Loading the draft model of `--speculative-algorithm draft`: a smaller causal LM with the
target's tokenizer, in a model runner (and KV pool) of its own.

Its checkpoint is resolved and checked before the target's KV pool is sized, so that an
automatically sized target pool leaves room for the draft pool (one draft slot per target
slot, plus the draft tokens of every running request)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from genserve.srt.device import resolve_device, resolve_dtype
from genserve.srt.layers.prequantized import precision_class
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import gguf_path_of, gguf_precision_class, resolve_model_folder
from genserve.srt.model_runner import ModelRunner
from genserve.srt.server_args import EngineArgs
from genserve.srt.speculative import refuse_vision_target
from genserve.srt.tokenizer_manager import load_tokenizer

logger = logging.getLogger(__name__)

FLAG = "--speculative-draft-model-path"


@dataclass(frozen=True)
class DraftCheckpoint:
    path: str  # as given
    folder: Path
    config: ModelConfig
    source_precision: str | None  # as for the target (`ModelRunner`)
    kv_bytes_per_token: int


def resolve_draft_model(args: EngineArgs, target: ModelConfig, tokenizer: Any,
                        context_length: int, pooled: bool) -> DraftCheckpoint:
    """The draft checkpoint of `args`, checked against the target: ValueError naming the flag
    when it is missing, not a text model, or does not share the target's vocabulary."""
    path = str(args.speculative_draft_model_path)
    refuse_vision_target(target.multimodal)
    if pooled:
        raise ValueError("--speculative-algorithm draft: an embedding model does not decode")
    try:
        folder, _ = resolve_model_folder(path, args.dtype, args.device)
        config = ModelConfig.from_folder(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{FLAG} {path!r}: {exc}") from exc
    if config.multimodal:
        raise ValueError(f"{FLAG} {path!r} is a vision-language model; the draft must be a "
                         "text model")
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FLAG} {path!r} has a vocabulary of {config.vocab_size} tokens, the target "
            f"model {target.vocab_size}; the draft must use the target's tokenizer")
    check_same_tokenizer(tokenizer, load_tokenizer(folder), path)
    if config.max_position_embeddings < context_length:
        raise ValueError(
            f"{FLAG} {path!r} handles {config.max_position_embeddings} positions, fewer than "
            f"the served context of {context_length}; pass --context-length "
            f"{config.max_position_embeddings} or less")
    source_precision = None
    if args.quantization in ("auto", "fp8"):
        gguf = gguf_path_of(path)
        source_precision = (gguf_precision_class(gguf) if gguf is not None
                            else precision_class(folder))
    elt = torch.tensor([], dtype=resolve_dtype(args.dtype, resolve_device(args.device)))
    kv_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                * elt.element_size())
    return DraftCheckpoint(path, folder, config, source_precision, kv_bytes)


def check_same_tokenizer(target: Any, draft: Any, path: str) -> None:
    """ValueError when both folders have tokenizers and a token id means different text in
    them; a folder without one (weights only) is checked by vocabulary size alone."""
    if target is None or draft is None:
        logger.info("%s %s: no tokenizer on %s side; only the vocabulary sizes were compared",
                    FLAG, path, "the draft's" if draft is None else "the target's")
        return
    mine, theirs = target.get_vocab(), draft.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
    sample = ", ".join(f"{t!r}={i}" for t, i in differ[:3])
    raise ValueError(
        f"{FLAG} {path!r} has another tokenizer than the target model ({len(differ)} "
        f"entries differ, e.g. {sample}); the draft must use the target's tokenizer")


def build_draft_runner(args: EngineArgs, ckpt: DraftCheckpoint, target: ModelRunner,
                       context_length: int) -> ModelRunner:
    """The draft model's runner: the target's device, dtype and kernels; a pool of the target
    pool's size plus room for every running request's draft tokens; no adapters, no
    compiled step."""
    headroom = args.max_running_requests * (args.speculative_draft_steps() + 1)
    draft_args = replace(
        args, model_path=ckpt.path, max_total_tokens=target.max_total_tokens + headroom,
        lora_paths=(), max_loaded_loras=None, compile=False, speculative_algorithm=None,
        speculative_draft_model_path=None, speculative_num_steps=None)
    runner = ModelRunner(draft_args, ckpt.config, ckpt.folder, context_length,
                         ckpt.source_precision)
    logger.info("draft model %s (%s, quantization %s): KV pool %d tokens", ckpt.path,
                ckpt.config.architecture, runner.quantization, runner.max_total_tokens)
    return runner
