"""Decode steps replayed from captured graphs, one per batch-size bucket (`--enable-cuda-graph`).

A decode forward of a small batch on a GPU is short enough that launching its few hundred
kernels from Python is a large part of it. Here each bucket's decode forward is captured once,
at start-up, into a `torch.cuda.CUDAGraph` over static input buffers; a batch is padded to the
smallest bucket that holds it, its inputs are copied into the buffers, the graph is replayed and
the first rows of its logits are kept. Batches larger than the largest bucket decode eagerly.

Padding rows decode token 0 at position 0 over one KV token of req_to_token row 0, and write
their K/V to the pool's padding slot 0, which no request owns: they read memory that exists and
change nothing a request sees.

Only the capture is CUDA's: `EagerCapture` runs the same buckets, buffers, padding and slicing
by calling the forward on the buffers at each replay (`cuda_graph_capture="eager"`), which is
how the CPU tests exercise this module.
"""

from __future__ import annotations

import bisect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from genserve.srt.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from genserve.srt.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Largest bucket when --cuda-graph-max-bs is not given (further capped by
# --max-running-requests): each bucket costs capture time at start-up and graph memory.
DEFAULT_MAX_BS = 32


def cuda_graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8, up to and including
    max_bs (SGLang's spacing: padding wastes at most 7 rows past 8)."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


class GraphCapture(ABC):
    """How a bucket's forward becomes something to replay."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `fn` (a forward over static buffers); the result reruns it on whatever the
        buffers hold and returns its output (on CUDA the same tensor at every replay, valid
        until the next one)."""


class EagerCapture(GraphCapture):
    """No graph: a replay calls the forward (the CPU path, for tests)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return fn


class CudaGraphCapture(GraphCapture):
    """torch.cuda.CUDAGraph capture; every bucket's graph shares one memory pool (the largest
    bucket is captured first, so the smaller ones fit in what it reserved)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm-up runs on the capture stream: Triton compiles its kernels and torch's
        # allocator settles before anything is recorded.
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphRunner:
    """Static buffers, one captured forward per bucket, and the padding between them."""

    def __init__(self, runner: ModelRunner, max_bs: int, capture: GraphCapture) -> None:
        self.runner = runner
        self.buckets = cuda_graph_buckets(max_bs)
        self.max_bs = max_bs
        self.replays = 0  # decode steps served from a bucket (tests and server_info read it)
        dev = runner.device

        def zeros() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=dev)

        # [max_bs] int64 each; a batch of b rows uses [:bucket], rows [b:bucket] are padding.
        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.req_pool_indices, self.prefix_lens = zeros(), zeros()
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.ones = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.arange = torch.arange(max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[ForwardBatch, Callable[[], torch.Tensor]]] = {}
        for bs in reversed(self.buckets):  # largest first: the shared pool fits the rest
            fb = self._static_batch(bs)
            self.graphs[bs] = (fb, capture.capture(lambda fb=fb: self._forward(fb)))

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.ones[:bs],
            extend_start_loc=self.arange[:bs],
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            logits_indices=self.arange[:bs],
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        """What a graph holds: the attention plan (from device tensors alone where the backend
        can) and the model's forward."""
        backend = self.runner.attn_backend
        if backend.graph_capturable:
            backend.init_graph_decode_metadata(fb)
        else:
            backend.init_forward_metadata(fb)  # eager capture only (create_decode_graphs)
        return self.runner.model(fb)

    def can_run(self, fb: ForwardBatch) -> bool:
        """A plain decode batch that fits a bucket (no adapters, images or M-RoPE positions,
        which the static buffers do not hold, and no EAGLE features to capture)."""
        return (
            fb.mode is ForwardMode.DECODE
            and fb.batch_size <= self.max_bs
            and fb.lora is None
            and fb.image_embeds is None
            and fb.mrope_positions is None
            and not fb.capture_hidden
        )

    def bucket_for(self, batch_size: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [fb.batch_size, vocab] of a batch `can_run` accepted."""
        n = fb.batch_size
        bs = self.bucket_for(n)
        static, replay = self.graphs[bs]
        for buf, src, pad in (
            (self.input_ids, fb.input_ids, 0),
            (self.positions, fb.positions, 0),
            (self.out_cache_loc, fb.out_cache_loc, 0),  # the padding slot
            (self.req_pool_indices, fb.req_pool_indices, 0),
            (self.seq_lens, fb.seq_lens, 1),
            (self.prefix_lens, fb.extend_prefix_lens, 0),
        ):
            buf[:n].copy_(src, non_blocking=True)
            if n < bs:
                buf[n:bs].fill_(pad)
        # Host mirrors: read by an eager capture's attention plan, never by a CUDA graph.
        static.seq_lens_cpu = [*fb.seq_lens_cpu, *[1] * (bs - n)]
        static.extend_prefix_lens_cpu = [*fb.extend_prefix_lens_cpu, *[0] * (bs - n)]
        self.replays += 1
        return replay()[:n]


def create_decode_graphs(runner: ModelRunner) -> DecodeGraphRunner | None:
    """The runner's decode graphs for `--enable-cuda-graph`, or None when off; ValueError, at
    start-up, when they cannot run here."""
    args = runner.args
    if not args.enable_cuda_graph or runner.pooling is not None:
        return None  # (an embedder never decodes)
    eager = args.cuda_graph_capture == "eager"
    if runner.device.type != "cuda" and not eager:
        raise ValueError(
            f"--enable-cuda-graph needs a CUDA device, this runtime runs on {runner.device}; "
            "drop --enable-cuda-graph"
        )
    if not eager and not runner.attn_backend.graph_capturable:
        raise ValueError(
            f"--enable-cuda-graph needs an attention backend whose decode plan is built on the "
            f"GPU; {runner.attention_backend_name!r} plans on the host: use "
            "--attention-backend triton"
        )
    max_bs = args.cuda_graph_max_bs or min(DEFAULT_MAX_BS, args.max_running_requests)
    if max_bs > runner.max_total_tokens:
        raise ValueError(
            f"--cuda-graph-max-bs {max_bs} exceeds the KV pool's {runner.max_total_tokens} "
            "tokens (every request of a batch holds at least one): use --cuda-graph-max-bs "
            f"<= {runner.max_total_tokens} or a larger pool (--max-total-tokens)"
        )
    max_bs = min(max_bs, args.max_running_requests)  # no batch is larger
    capture = EagerCapture() if eager else CudaGraphCapture(runner.device)
    try:
        graphs = DecodeGraphRunner(runner, max_bs, capture)
    except RuntimeError as exc:  # e.g. a layer that reads a tensor on the host mid-forward
        if eager:
            raise
        raise ValueError(
            f"--enable-cuda-graph: capturing {runner.config.architecture}'s decode step failed "
            f"({exc}); a layer waits on the host (the torch MoE kernel does): drop "
            "--enable-cuda-graph"
        ) from exc
    logger.info(
        "decode graphs (%s capture) for batch sizes %s", args.cuda_graph_capture, graphs.buckets
    )
    return graphs
