"""Encoder embedders and cross-encoder rerankers (BERT, RoBERTa / XLM-R, ModernBERT).

Encoders attend both ways over the whole input and keep no KV cache, so the paged decoder
runtime (KV pool, prefix cache, decode steps) has nothing to offer them: they run here, in the
scheduler process, through transformers' own modules (`AutoModel` /
`AutoModelForSequenceClassification`), batched with right padding and an attention mask.
`EncoderScheduler` takes the scheduler's place in the process loop (`scheduler/process.py`):
the same messages in and out, each `step()` one padded forward over the queued requests.
Pooling follows the folder's sentence-transformers config (`pooling_config.PoolingSpec`).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from genserve.srt.device import resolve_device, resolve_dtype
from genserve.srt.messages import ReqOutput, TokenizedGenerateReq
from genserve.srt.pooling_config import PoolingSpec
from genserve.srt.server_args import EngineArgs
from genserve.srt.tokenizer_manager import load_tokenizer

logger = logging.getLogger(__name__)

# A step picks its batch among the oldest _WINDOW_BATCHES * max_running_requests requests.
_WINDOW_BATCHES = 4


def encoder_context_length(hf: dict[str, Any], spec: PoolingSpec, tokenizer: Any,
                           requested: int | None) -> int:
    """The longest input (in tokens, special tokens included) the encoder takes."""
    limit = int(hf.get("max_position_embeddings", 512))
    if hf.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(hf.get("pad_token_id", 1)) + 1  # positions start after the padding id
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < limit:
        limit = tok_max
    if spec.max_seq_length:
        limit = min(limit, int(spec.max_seq_length))
    if requested is not None:
        if requested > limit:
            raise ValueError(f"context_length {requested} exceeds the model's limit {limit}")
        limit = requested
    return limit


class EncoderModel:
    """A transformers encoder with its pooling: `run` maps padded token batches to vectors."""

    def __init__(self, folder: Path, spec: PoolingSpec, device: torch.device,
                 dtype: torch.dtype) -> None:
        import transformers

        self.spec = spec
        self.device = device
        cls = (transformers.AutoModelForSequenceClassification if spec.task == "rerank"
               else transformers.AutoModel)
        self.model = cls.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        self.hidden_size = int(self.model.config.hidden_size)
        # BERT-style segment ids (query / document); ModernBERT has none.
        params = inspect.signature(self.model.forward).parameters
        self.takes_token_types = "token_type_ids" in params

    @torch.inference_mode()
    def run(self, ids: list[list[int]], types: list[list[int] | None]) -> torch.Tensor:
        """Float32 [batch, hidden] pooled embeddings (before normalisation), or for a reranker
        [batch, labels] scores after the activation."""
        width = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.int64)
        mask = torch.zeros(len(ids), width, dtype=torch.int64)
        token_types = torch.zeros(len(ids), width, dtype=torch.int64)
        for i, (row, tt) in enumerate(zip(ids, types, strict=True)):
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            if tt is not None:
                token_types[i, : len(tt)] = torch.tensor(tt)
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(self.device),
                                  "attention_mask": mask.to(self.device)}
        if self.takes_token_types and any(t is not None for t in types):
            kwargs["token_type_ids"] = token_types.to(self.device)
        out = self.model(**kwargs)
        if self.spec.task == "rerank":
            logits = out.logits.float()
            return torch.sigmoid(logits) if self.spec.activation == "sigmoid" else logits
        hidden = out.last_hidden_state  # [batch, width, hidden]
        mask = kwargs["attention_mask"]
        if self.spec.pooling == "cls":
            return hidden[:, 0].float()
        if self.spec.pooling == "lasttoken":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
        weights = mask.unsqueeze(-1).to(torch.float32)  # mean over the real tokens
        summed = (hidden.float() * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1e-9)


@dataclass
class _Pending:
    msg: TokenizedGenerateReq
    aborted: bool = False


class EncoderScheduler:
    """Queues pooling requests and runs them in padded batches: each `step()` takes queued
    requests (`_take_batch`) up to `max_running_requests` and a padded-token budget of
    `chunked_prefill_size` (always at least one), runs one forward and finishes them all."""

    def __init__(self, args: EngineArgs, model: EncoderModel, context_length: int,
                 vocab_size: int) -> None:
        self.args = args
        self.model = model
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.waiting: list[_Pending] = []
        self.stats = {"prompt_tokens": 0, "forward_batches": 0, "padded_tokens": 0}

    def _reject(self, msg: TokenizedGenerateReq) -> str | None:
        n = len(msg.input_ids)
        if msg.pooling is None:
            return "this model is an embedding / rerank model: it serves no generation"
        if n == 0:
            return "the input is empty: at least one token is required"
        if n > self.context_length:
            return (f"the input ({n} tokens) exceeds the model's context length "
                    f"({self.context_length} tokens)")
        if any(t < 0 or t >= self.vocab_size for t in msg.input_ids):
            return f"input token ids must be in [0, {self.vocab_size})"
        types = msg.pooling.token_type_ids
        if types is not None and len(types) != n:
            return "token_type_ids must be as long as input_ids"
        return None

    def add_request(self, msg: TokenizedGenerateReq) -> ReqOutput | None:
        error = self._reject(msg)
        if error is not None:
            return _output(msg, None, error)
        self.waiting.append(_Pending(msg))
        return None

    def abort(self, rid: str) -> bool:
        for item in self.waiting:
            if item.msg.rid == rid:
                item.aborted = True
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting)

    def _take_batch(self) -> list[_Pending]:
        """The next batch: of the oldest requests (a window of a few batches, so that none
        waits long), those of similar length together, to pad as little as possible."""
        window = sorted(self.waiting[: _WINDOW_BATCHES * self.args.max_running_requests],
                        key=lambda p: len(p.msg.input_ids))
        batch: list[_Pending] = []
        width = 0
        for item in window:
            w = max(width, len(item.msg.input_ids))
            if batch and (len(batch) >= self.args.max_running_requests
                          or w * (len(batch) + 1) > self.args.chunked_prefill_size):
                break
            batch.append(item)
            width = w
        taken = {id(p) for p in batch}
        self.waiting = [p for p in self.waiting if id(p) not in taken]
        return batch

    def step(self) -> list[ReqOutput]:
        outputs = [_output(p.msg, None, None, aborted=True) for p in self.waiting if p.aborted]
        self.waiting = [p for p in self.waiting if not p.aborted]
        if not self.waiting:
            return outputs
        batch = self._take_batch()
        ids = [p.msg.input_ids for p in batch]
        types = [p.msg.pooling.token_type_ids for p in batch]  # type: ignore[union-attr]
        start = time.perf_counter()
        vectors = self.model.run(ids, types)
        self.stats["forward_batches"] += 1
        self.stats["prompt_tokens"] += sum(len(x) for x in ids)
        self.stats["padded_tokens"] += len(ids) * max(len(x) for x in ids)
        for p, row in zip(batch, vectors, strict=True):
            pooling = p.msg.pooling
            assert pooling is not None  # checked at admission
            vec = row
            if self.model.spec.task == "embed":
                if pooling.dimensions is not None:
                    vec = F.normalize(vec[: pooling.dimensions], dim=-1)
                elif self.model.spec.normalize:
                    vec = F.normalize(vec, dim=-1)
            outputs.append(_output(p.msg, vec.tolist(), None))
        logger.debug("encoder batch of %d in %.1f ms", len(batch),
                     (time.perf_counter() - start) * 1e3)
        return outputs

    def check_integrity(self) -> None:
        """An encoder holds no memory between steps: nothing can leak."""

    def flush_cache(self) -> bool:
        return not self.has_work()

    def info(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "running": 0, **self.stats}


def _output(msg: TokenizedGenerateReq, vector: list[float] | None, error: str | None,
            aborted: bool = False) -> ReqOutput:
    if error is not None or aborted:
        reason = {"type": "abort", "message": error or "aborted by client"}
    else:
        reason = {"type": "stop", "matched": None}
    return ReqOutput(rid=msg.rid, text_delta="", new_ids=[], finished=True, finish_reason=reason,
                     prompt_tokens=len(msg.input_ids), completion_tokens=0, cached_tokens=0,
                     error=error, error_status=400 if error is not None else 500,
                     embedding=vector)


@dataclass
class EncoderRuntime:
    """The encoder counterpart of `engine_core.Runtime` (what the scheduler process holds)."""

    args: EngineArgs
    folder: Path
    model_name: str
    spec: PoolingSpec
    tokenizer: Any
    scheduler: EncoderScheduler
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def build(cls, args: EngineArgs, folder: Path, name: str, spec: PoolingSpec
              ) -> EncoderRuntime:
        import json

        if args.tp_size > 1:
            raise ValueError("--tp is not supported for encoder models")
        if args.quantization in ("int8wo", "int4wo", "fp8"):
            raise ValueError(f"--quantization {args.quantization} is not supported for encoder "
                             "models; use --quantization none")
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        hf = json.loads((folder / "config.json").read_text())
        tokenizer = load_tokenizer(folder)
        context = encoder_context_length(hf, spec, tokenizer, args.context_length)
        model = EncoderModel(folder, spec, device, dtype)
        sched = EncoderScheduler(args, model, context, int(hf["vocab_size"]))
        logger.info("loaded %s (%s %s, %s pooling, %s): context %d", name, spec.architecture,
                    spec.task, spec.pooling, dtype, context)
        return cls(args, folder, name, spec, tokenizer, sched, dtype, device)

    def memory_report(self) -> dict:
        """The memory plan's view of this runtime: its weights and no KV pool."""
        from genserve.device_memory import device_memory

        module = self.scheduler.model.model
        weights = sum(t.numel() * t.element_size()
                      for t in (*module.parameters(), *module.buffers()))
        return {**device_memory(self.device), "weights_bytes": weights,
                "kv_bytes_per_token": 0, "context_length": self.scheduler.context_length,
                "activation_bytes": 0, "fixed_tokens": None, "default_tokens": None}

    def shutdown(self) -> None:
        """Nothing runs outside this process."""

    def model_info(self) -> dict[str, Any]:
        hf = self.scheduler.model.model.config
        return {
            "model_path": str(self.args.model_path or self.folder),
            "tokenizer_path": str(self.folder),
            "model_name": self.model_name,
            "architecture": self.spec.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "quantization": "none",
            "checkpoint_quantization": None,
            "compile": False,
            "attention_backend": "transformers",
            "context_length": self.scheduler.context_length,
            "vocab_size": int(hf.vocab_size),
            "num_layers": int(hf.num_hidden_layers),
            "hidden_size": self.scheduler.model.hidden_size,
            "tp_size": 1,
            "max_total_tokens": 0,
            "eos_token_ids": [],
            "generation_defaults": {},
            "has_tokenizer": self.tokenizer is not None,
            "grammar_backend": None,
            "chat_roles": None,
            "modalities": ["text"],
            "pooling": self.spec.to_dict(),
        }
