"""Owns the model weights, the KV memory and the attention backend; runs one forward pass."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import shutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from genserve.srt.decode_graphs import create_decode_graphs
from genserve.srt.device import resolve_device, resolve_dtype
from genserve.srt.distributed import TPGroup
from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.kv_pool_sizing import KVPoolSizing
from genserve.srt.layers.attention.base import AttentionBackend
from genserve.srt.layers.parallel import split_heads
from genserve.srt.layers.prequantized import checkpoint_quantization
from genserve.srt.layers.quantization import (
    QuantizationChoice,
    WeightOnlyLinear,
    choose_quantization,
)
from genserve.srt.lora import LoRAManager
from genserve.srt.mem_cache import (
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_kv_pool,
)
from genserve.srt.model_build import (  # noqa: F401 (load_model, init_dummy_weights: re-exported)
    check_tensor_parallel,
    choose_kernels,
    init_dummy_weights,
    load_model,
)
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM
from genserve.srt.models.registry import get_model_class
from genserve.srt.pooling_config import PoolingSpec
from genserve.srt.server_args import EngineArgs

if TYPE_CHECKING:
    from genserve.srt.compile_warm_up import BackgroundWarmUp
    from genserve.srt.tp_worker import TPWorkers

logger = logging.getLogger(__name__)



def create_attention_backend(name: str, runner: ModelRunner) -> AttentionBackend:
    """Registry of attention backends (torch: CPU default and reference; triton: CUDA default)."""
    if name == "torch":
        from genserve.srt.layers.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend()
    if name == "triton":
        from genserve.srt.layers.attention.triton_backend import TritonAttnBackend

        if runner.latent_kv is not None:  # latent attention: one shared row a token
            return TritonAttnBackend(runner.num_heads, 1, sum(runner.latent_kv), runner.device)
        return TritonAttnBackend(
            runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.device
        )
    raise ValueError(f"unknown attention backend {name!r}")


_COMPILED_MODELS = itertools.count()


def _decode_forward(model: torch.nn.Module, fb: ForwardBatch) -> torch.Tensor:
    """What `--compile` compiles: the model's forward, without its `inference_mode` decorator
    (the runner's forward already runs in inference mode). A graph that enters inference mode
    itself is one AOTAutograd's cache refuses to store, so every start would redo that stage."""
    return inspect.unwrap(type(model).forward)(model, fb)


def _own_decode_forward() -> types.FunctionType:
    """`_decode_forward` under a code object of its own (dynamo's cache lives on it)."""
    code = _decode_forward.__code__
    code = code.replace(co_name=f"{code.co_name}_{next(_COMPILED_MODELS)}")
    return types.FunctionType(code, _decode_forward.__globals__, code.co_name)


def has_cpp_compiler() -> bool:
    """Whether torch.compile can build its CPU kernels here (g++, c++ or clang++ on PATH)."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


class ModelRunner(KVPoolSizing):
    def __init__(
        self,
        args: EngineArgs,
        config: ModelConfig,
        folder: Path,
        context_length: int,
        source_precision: str | None = None,
        tp: TPGroup | None = None,
        pooling: PoolingSpec | None = None,
        plan_pool: Any = None,
        shared_kv_bytes_per_token: int = 0,
    ):
        """source_precision: "int8" / "int4" when the weights came from a GGUF or a pre-quantized
        checkpoint stored in that precision class (what `--quantization auto` keeps), None for
        full precision.
        tp: this rank's tensor-parallel group (None: one rank); the runner then holds the
        rank's share of the heads and of the KV pool.
        pooling: a decoder embedder's spec; its forward then returns pooled hidden states
        [batch, hidden] where a generative model returns logits.
        plan_pool: the server's memory plan (genserve/memory_plan.py): given `memory_report()`
        once the weights are in, it answers the KV pool's size in tokens (None: the runner
        sizes its pool itself); one with `send` and `receive` may be answered later
        (`_first_pool`).
        shared_kv_bytes_per_token: KV bytes per token of another pool sized like this one
        (a draft model's): an automatically sized pool leaves them room in the budget."""
        self.pooling = pooling
        self.shared_kv_bytes_per_token = shared_kv_bytes_per_token
        check_tensor_parallel(config, args.tp_size)
        self.args = args
        self.config = config
        self.folder = folder
        self.tp = tp or TPGroup.single()
        # Set on rank 0 of a tensor-parallel group: every forward is sent to the other ranks.
        self.tp_workers: TPWorkers | None = None
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        heads = split_heads(config.num_attention_heads, config.num_key_value_heads, self.tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.head_dim = config.head_dim
        self.context_length = context_length
        torch.manual_seed(args.random_seed)

        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attention_backend_name = backend
        # Norm and rotary kernels follow the device, not the attention backend.
        self.kernels = choose_kernels(args, self.device, get_model_class(config.architecture))
        # A pre-quantized checkpoint's format (refused here, before any weight is allocated,
        # when unsupported); its weights are dequantized into `dtype` while loading.
        fmt = checkpoint_quantization(config.hf)
        self.checkpoint_quantization = None if fmt is None else fmt.describe()
        choice: list[QuantizationChoice | None] = []
        self.model = load_model(config, folder, self.device, self.dtype, self.kernels, self.tp,
                                pooled=pooling is not None, load_format=args.load_format,
                                quantization=lambda model: self._quantization_mode(
                                    model, args.quantization, source_precision, choice))
        # Multi-LoRA: the adapter pool (None, and why, where adapters are not served). It
        # reads the geometry of full-precision and quantized linear layers alike.
        self.lora_refusal = self._lora_refusal(args, pooling)
        self.lora = None if self.lora_refusal else LoRAManager(
            self.model, args.lora_slots(), self.device, self.dtype)
        self.quantization = self._log_quantization(args.quantization, choice[0])
        # (kv_lora_rank, qk_rope_head_dim) of a latent-attention model (DeepSeek-V2/V3): its
        # pool stores one compressed row per token instead of per-head K and V.
        self.latent_kv = self.model.latent_kv_dims()
        if backend == "triton":
            unsupported = [
                i.layer_id
                for i in self.model.attention_layers()
                if i.sliding_window is not None or i.logit_softcap is not None or i.sinks
            ]
            if unsupported:
                raise ValueError(
                    f"{config.architecture} uses sliding-window, soft-capped or sink "
                    f"attention in layers {unsupported}, which the triton backend does not "
                    "implement; use --attention-backend torch"
                )
            if getattr(self.model, "bidirectional_images", False):
                raise ValueError(
                    f"{config.architecture} attends both ways within an image, which the "
                    "triton backend does not implement; use --attention-backend torch"
                )

        # Whether batch-1 decode steps run through torch.compile (`--compile`, resolved).
        self.compiled = self._want_compile(args.compile)
        # The memory plan's answer when it comes after start-up work (`settle_planned_pool`).
        self._plan_answer: Callable[[], int] | None = None
        # Every rank takes the smallest pool so that rank 0's slot indices are valid on all.
        pool = self.tp.min_int(self._first_pool(plan_pool), self.device)
        self._backend_name = backend
        self._build_pools(pool)
        self._compiled_decode = self._compile_decode() if self.compiled else None
        if self.compiled:
            self.lora, self.lora_refusal = None, "the decode step is compiled (--compile)"
        if args.enable_cuda_graph and self.lora is not None:  # (before any capture)
            self.lora, self.lora_refusal = None, "decode steps replay graphs (--enable-cuda-graph)"
        # Decode steps replayed from per-batch-size graphs (--enable-cuda-graph), else None.
        self.decode_graphs = create_decode_graphs(self)
        for entry in args.lora_paths if self.lora is not None else ():
            name, _, path = entry.partition("=")
            self.lora.add(name, path)  # type: ignore[union-attr]
        # The warm-up compile's outcome: {cache_hit, cache_loaded, seconds}, or {error} when a
        # background warm-up failed (compile_warm_up.py); and where the compile stands: off,
        # compiling, ready or failed. `warming`: the background warm-up while it runs.
        self.compile_report: dict | None = None
        self.compile_state = "compiling" if self.compiled else "off"
        self.warming: BackgroundWarmUp | None = None
        # EAGLE speculation: given every forward's batch with the target's features in
        # `hidden_out` (None: no forward captures them).
        self.on_hidden: Callable[[ForwardBatch], None] | None = None

    def _lora_refusal(self, args: EngineArgs, pooling: PoolingSpec | None) -> str | None:
        """Why this model serves no LoRA adapters, or None when it does."""
        why = None
        if self.tp.size > 1:
            why = "tensor parallelism (--tp > 1) does not support them yet"
        elif pooling is not None:
            why = "an embedding model takes no adapters"
        elif self.config.multimodal:
            why = f"the vision-language model {self.config.architecture} takes no adapters yet"
        elif self.model.latent_kv_dims() is not None:
            why = f"{self.config.architecture}'s latent attention takes no adapters yet"
        if why is not None and args.lora_paths:
            raise ValueError(f"--lora-paths: {why}")
        return why

    def _quantization_mode(self, model: CausalLM, requested: str,
                           source_precision: str | None,
                           out: list[QuantizationChoice | None]) -> str:
        """The weight-only mode `model` runs in (its layers are quantized while it loads);
        the choice and its reason are appended to `out` (None: not quantized)."""
        choice = None
        if requested != "none" and self.tp.size == 1:
            # (with --tp > 1 the parallel layers run full-precision weights only; EngineArgs
            # refuses the explicit modes there)
            if model.supports_quantization:
                choice = choose_quantization(requested, source_precision, model, self.device)
            elif requested != "auto":
                raise ValueError(
                    f"--quantization {requested} is not supported for "
                    f"{self.config.architecture}; use --quantization none"
                )
        out.append(choice)
        return "none" if choice is None else choice.mode

    def _log_quantization(self, requested: str, choice: QuantizationChoice | None) -> str:
        """Log the mode the loaded model runs in and how many weights it quantized."""
        if choice is None or choice.mode == "none":
            return "none"
        n = sum(m.in_features * m.out_features for m in self.model.modules()
                if isinstance(m, WeightOnlyLinear))
        logger.info("quantization %s (%s): %s%d M weights", choice.mode, choice.reason,
                    f"requested {requested}, " if requested != choice.mode else "", n // 10**6)
        return choice.mode

    def _want_compile(self, requested: bool | None) -> bool:
        """`--compile` as asked, or for auto (None): on where it was measured to pay, a
        weight-only quantized model on a CPU with a C++ compiler and one rank (the laptop
        chat); off elsewhere (GPUs, full precision, tensor parallel)."""
        if self.pooling is not None:
            return False  # an embedder never decodes: there is no decode step to compile
        if requested is not None:
            return requested
        if self.args.lora_paths:
            return False  # the compiled step has no LoRA path
        if self.args.enable_overlap_schedule:
            return False  # not combined with overlapped decode steps yet
        if self.device.type != "cpu" or self.tp.size > 1:
            return False
        if self.quantization not in ("int8wo", "int4wo"):
            return False
        if not has_cpp_compiler():
            logger.info(
                "compile: off (no C++ compiler found; with g++ or clang++ installed, "
                "torch.compile makes a single chat faster: docs/benchmarks.md)"
            )
            return False
        logger.info(
            "compile: on for this CPU's %s weights (it adds minutes to start-up; --no-compile "
            "skips it)",
            self.quantization,
        )
        return True

    def _compile_decode(self):
        """torch.compile of the model's forward, used for decode steps at batch 1.

        Batch 1 is the step a single chat waits on, and its shape varies only in the sequence
        length (compiled dynamic), so one graph serves every step; larger batches take other
        attention plans (padding masks, cascade groups), each of which would stall the server
        on a recompile, so they stay eager."""
        if self.device.type == "cpu" and not has_cpp_compiler():
            raise ValueError(
                "--compile on CPU needs a C++ compiler (g++ or clang++) for torch.compile's "
                "generated kernels; install one or drop --compile"
            )
        logger.info("compile: the batch-1 decode step is compiled by a warm-up request")
        if hasattr(self.attn_backend, "dynamic_decode_len"):
            self.attn_backend.dynamic_decode_len = True
            dynamic = None  # only the marked sequence length varies
        else:
            dynamic = True
        # Guards on the model's modules are skipped (checking every parameter's metadata,
        # 4-bit weights in Python, was a large share of a decode step; docs/benchmarks.md):
        # the graph is traced after loading and quantizing, and nothing replaces a module
        # afterwards. Dynamo keeps its compiled graphs per code object, so each runner
        # compiles its own copy of the function: another model in the same process (a second
        # Engine) can never match this model's graph on the guards that are left.
        compiled = torch.compile(
            _own_decode_forward(),
            dynamic=dynamic,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        return functools.partial(compiled, self.model)

    def poll_compile(self) -> str:
        """Where the compile stands; in the scheduler's thread, a background warm-up that has
        finished is adopted here (its compiled step used from the next forward on)."""
        if self.warming is not None and self.warming.adopt():
            self.warming = None
        return self.compile_state

    def _build_pools(self, tokens: int) -> None:
        """The KV pool of `tokens` slots, its allocator and the attention backend over it."""
        self.max_total_tokens = tokens
        self.req_to_token_pool = ReqToTokenPool(
            max(2 * self.args.max_running_requests, 16), self.context_length + 8, self.device
        )
        self.token_to_kv_pool = create_kv_pool(
            tokens,
            self.dtype,
            self.config.num_hidden_layers,
            self.num_kv_heads,
            self.head_dim,
            self.latent_kv,
            self.device,
        )
        self.allocator = TokenToKVPoolAllocator(tokens, self.device)
        self.attn_backend = create_attention_backend(self._backend_name, self)

    def build_forward_batch(
        self,
        mode: ForwardMode,
        rows: list[int],
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        image_embeds: list[tuple[int, torch.Tensor]] | None = None,
        mrope_positions: torch.Tensor | None = None,
        image_blocks: list[list[tuple[int, int]]] | None = None,
        lora_slots: list[int] | None = None,
    ) -> ForwardBatch:
        """input_ids: the new tokens of every request, concatenated request after request.
        image_embeds / mrope_positions / image_blocks: see `ForwardBatch` (vision models only).
        lora_slots: each request's adapter slot (-1: the base model)."""
        dev = self.device
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts, acc = [], 0
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            starts.append(acc)
            acc += e
            positions.extend(range(p, p + e))
        ext = torch.tensor(extend_lens, dtype=torch.int64, device=dev)
        start_loc = torch.tensor(starts, dtype=torch.int64, device=dev)
        return ForwardBatch(
            mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=ext,
            extend_start_loc=start_loc,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=start_loc + ext - 1,
            image_embeds=image_embeds,
            mrope_positions=mrope_positions,
            image_blocks=image_blocks,
            lora=self.lora.make_batch(lora_slots, extend_lens)
            if self.lora is not None and lora_slots is not None else None,
            capture_hidden=self.on_hidden is not None,
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, verify_rows: bool = False) -> torch.Tensor:
        """Float32 logits [batch, vocab] of each request's last new token.

        verify_rows: `fb` is one request's speculative verify laid out as decode rows (see
        `speculative/verify_rows.py`); under --compile it runs the compiled decode step too."""
        if self.warming is not None:
            self.poll_compile()
        if self.tp_workers is not None:
            from genserve.srt.tp_worker import forward_inputs

            self.tp_workers.send(forward_inputs(fb))
        if self.decode_graphs is not None and self.decode_graphs.can_run(fb):
            return self.decode_graphs.run(fb)  # plans its attention inside the graph
        self.attn_backend.init_forward_metadata(fb)
        if self.lora is not None:
            self.lora.batch = fb.lora  # what the adapted layers' hooks read in this forward
        if (
            self._compiled_decode is not None
            and fb.mode is ForwardMode.DECODE
            and (fb.batch_size == 1 or verify_rows)
            and not fb.capture_hidden
        ):
            return self._compiled_decode(fb)
        logits = self.model(fb)
        if fb.capture_hidden and self.on_hidden is not None:
            self.on_hidden(fb)
        return logits
