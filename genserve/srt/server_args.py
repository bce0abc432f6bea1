"""Configuration of the LLM runtime (one frozen dataclass, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
ATTENTION_BACKENDS = ("torch", "triton")
KERNELS = ("torch", "triton")
DTYPES = ("auto", "bfloat16", "float16", "float32")
GRAMMAR_BACKENDS = ("xgrammar", "none")
QUANTIZATIONS = ("none", "int8wo", "int4wo", "fp8", "auto")
SPECULATIVE_ALGORITHMS = ("ngram", "draft", "eagle")
LOAD_FORMATS = ("auto", "dummy")
# How decode graphs are captured: "cuda" (torch.cuda.CUDAGraph); "eager" runs the same static
# buffers, buckets and padding by calling the forward, the CPU path for tests only.
CUDA_GRAPH_CAPTURES = ("cuda", "eager")


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    # "auto": bfloat16 on GPUs and on CPUs with native bf16 math (AVX512-BF16 / AMX), else
    # float32: without native bf16 the GEMMs convert in software, run slower than fp32 and
    # gain nothing from batching (figures: docs/benchmarks.md).
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    attention_backend: str | None = None  # None = triton on CUDA, torch on CPU
    # RMSNorm / rotary kernels, chosen apart from the attention backend; None = by device.
    norm_kernel: str | None = None
    rotary_kernel: str | None = None
    moe_kernel: str | None = None  # experts of MoE models
    max_total_tokens: int | None = None  # KV pool size in tokens; None = from mem_fraction
    # CPU: share of available host memory given to the KV pool (None = 0.1). CUDA: share of
    # total GPU memory that weights + activations + KV pool may take (None = 0.85); the pool
    # gets what remains after the weights.
    mem_fraction: float | None = None
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = 2048  # prefill token budget per forward; longer prompts chunk
    max_running_requests: int = 64
    context_length: int | None = None  # None = the model's max_position_embeddings
    disable_radix_cache: bool = False
    page_size: int = 1
    random_seed: int = 0
    num_threads: int = 0  # torch threads in the scheduler process; 0 = torch default
    grammar_backend: str = "xgrammar"  # json_schema / regex / ebnf; "none" refuses them
    grammar_compile_timeout_s: float = 30.0  # a grammar still compiling after this is a 400
    # Append the text a grammar forces without decode steps (one extend computes its KV).
    jump_forward: bool = True
    # Weight-only quantization of the linear layers (torchao): none | int8wo | int4wo | auto,
    # or fp8: an FP8 checkpoint's float8 weights kept as stored (torch._scaled_mm)
    # (auto keeps a GGUF's precision class, picks fp8 for an FP8 checkpoint on CUDA, and
    # leaves full-precision checkpoints as they are;
    # `genserve serve` defaults to auto, the Engine to none: exact Hugging Face outputs).
    quantization: str = "none"
    # torch.compile the batch-1 decode forward (needs a C++ compiler on CPU); compiled at
    # start-up by a warm-up request. None (auto): on for weight-only quantized models on a CPU
    # with a C++ compiler and one rank (the laptop chat, where it pays: docs/benchmarks.md),
    # else off.
    compile: bool | None = None
    # How that warm-up runs (genserve/srt/compile_warm_up.py): blocking (the start waits for
    # it) or background (the runtime serves at once, decoding eagerly until it is compiled;
    # `genserve serve`'s default).
    compile_warm_up: str = "blocking"
    # Vision-language models: byte budget of the image-embedding LRU, images per request.
    image_cache_bytes: int = 512 * 1024 * 1024
    max_images_per_request: int = 16
    # Tensor parallelism: ranks that split every layer's heads and columns (gloo on CPU, NCCL
    # over one GPU per rank on CUDA).
    tp_size: int = 1
    # Speculative decoding (SGLang's flag names): None = off; "ngram" drafts from the request's
    # own prompt and output and verifies up to num_draft_tokens per decode step, matching its
    # last 1..max tokens (longest first, at least min); "draft" has a smaller model with the
    # same tokenizer (speculative_draft_model_path) propose num_steps tokens greedily (None:
    # num_draft_tokens), its KV in a pool of its own; "eagle" has an EAGLE head
    # (speculative_draft_model_path) draft num_steps tokens from the target's features.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 6
    # ngram: most distinct continuations (earlier matches) merged into one draft tree of
    # num_draft_tokens nodes, verified in one forward with a tree attention mask (SGLang's
    # name); 1 = one chain, the most recent longest match.
    speculative_ngram_max_bfs_breadth: int = 1
    # Serve a registry decoder (Qwen3, Llama...) as a last-token-pooling embedder even when its
    # folder has no sentence-transformers pooling config (SGLang's --is-embedding).
    is_embedding: bool = False
    # Multi-LoRA: PEFT adapters served at start-up, "NAME=PATH" each (requests select one by
    # name), and how many adapters sit in the model's slot buffers at once (None: 4, or more
    # when more are given); least recently used unpinned ones leave their slot.
    lora_paths: tuple[str, ...] = ()
    max_loaded_loras: int | None = None
    # "dummy" (SGLang's --load-format dummy): random weights at the model's real shapes, no
    # checkpoint read; the folder needs only config.json. For speed and memory checks
    # (scripts/device_check.sh); the outputs mean nothing.
    load_format: str = "auto"
    # CUDA graphs for decode steps (`--enable-cuda-graph`; SGLang has them on and names the
    # switch --disable-cuda-graph, here they stay off until the device check shows they win):
    # one graph per batch-size bucket up to cuda_graph_max_bs (None: min(32,
    # max_running_requests)); larger batches decode eagerly (genserve/srt/decode_graphs.py).
    enable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_capture: str = "cuda"  # internal: "eager" on a CPU, for tests
    # Overlap scheduling (`--enable-overlap-schedule`, genserve/srt/scheduler/overlap.py): each
    # decode step is launched before the previous one's tokens reach the host, whose work on
    # them runs meanwhile. Off until the device check shows it wins.
    enable_overlap_schedule: bool = False

    def __post_init__(self) -> None:
        self._check_lora()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        for name in ("norm_kernel", "rotary_kernel", "moe_kernel"):
            if getattr(self, name) not in (None, *KERNELS):
                raise ValueError(f"{name} must be one of {KERNELS}, got {getattr(self, name)!r}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 0.95:
            raise ValueError(f"mem_fraction must be in (0, 0.95], got {self.mem_fraction}")
        if self.chunked_prefill_size < 16:
            raise ValueError(f"chunked_prefill_size must be >= 16, got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.context_length is not None and self.context_length < 8:
            raise ValueError(f"context_length must be >= 8, got {self.context_length}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}"
            )
        if self.compile_warm_up not in ("background", "blocking"):
            raise ValueError("compile_warm_up must be 'background' or 'blocking', got "
                             f"{self.compile_warm_up!r}")
        if self.image_cache_bytes < 0:
            raise ValueError(f"image_cache_bytes must be >= 0, got {self.image_cache_bytes}")
        if self.max_images_per_request < 1:
            raise ValueError(
                f"max_images_per_request must be >= 1, got {self.max_images_per_request}"
            )
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                             f"got {self.speculative_algorithm!r}")
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError("speculative_num_draft_tokens must be in [1, 64], got "
                             f"{self.speculative_num_draft_tokens}")
        self._check_draft_model()
        if not 1 <= self.speculative_ngram_max_bfs_breadth <= 64:
            raise ValueError("speculative_ngram_max_bfs_breadth must be in [1, 64], got "
                             f"{self.speculative_ngram_max_bfs_breadth}")
        if self.speculative_ngram_max_bfs_breadth > 1 and self.tp_size > 1:
            raise ValueError("--speculative-ngram-max-bfs-breadth above 1 (draft trees) is not "
                             "supported with --tp > 1 yet; drop one of them")
        if not (1 <= self.speculative_ngram_min_match_window_size
                <= self.speculative_ngram_max_match_window_size):
            raise ValueError(
                "speculative n-gram match windows need 1 <= min <= max, got "
                f"{self.speculative_ngram_min_match_window_size} and "
                f"{self.speculative_ngram_max_match_window_size}")
        if self.tp_size > 1 and self.quantization in ("int8wo", "int4wo", "fp8"):
            raise ValueError(
                f"--quantization {self.quantization} is not supported with --tp > 1; "
                "use --quantization none"
            )
        if self.tp_size > 1 and self.compile:
            raise ValueError("--compile is not supported with --tp > 1 yet; drop one of them")
        self._check_cuda_graph()
        self._check_overlap_schedule()
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    def _check_lora(self) -> None:
        paths = self.lora_paths
        if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"lora_paths must be a list of NAME=PATH strings, got {paths!r}")
        object.__setattr__(self, "lora_paths", tuple(paths))
        names = []
        for entry in self.lora_paths:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-paths takes NAME=PATH, got {entry!r}")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-paths names must differ, got {names}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError(f"max_loaded_loras must be >= 1, got {self.max_loaded_loras}")
        if self.lora_paths and self.tp_size > 1:
            raise ValueError("LoRA adapters (--lora-paths) are not supported with --tp > 1 yet")
        if self.lora_paths and self.compile:
            raise ValueError("LoRA adapters (--lora-paths) are not supported with --compile "
                             "(the compiled decode step has no LoRA path); drop one of them")

    def _check_cuda_graph(self) -> None:
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURES:
            raise ValueError(f"cuda_graph_capture must be one of {CUDA_GRAPH_CAPTURES}, "
                             f"got {self.cuda_graph_capture!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not self.enable_cuda_graph:
            return
        for clash, what in ((self.tp_size > 1, "--tp > 1"), (self.compile, "--compile"),
                            (bool(self.lora_paths), "LoRA adapters (--lora-paths)")):
            if clash:
                raise ValueError(f"--enable-cuda-graph is not supported with {what} yet; "
                                 "drop one of them")

    def _check_overlap_schedule(self) -> None:
        if not self.enable_overlap_schedule:
            return
        for clash, what in (
            (self.speculative_algorithm is not None, "speculative decoding"),
            (self.tp_size > 1, "--tp > 1"),
            (self.compile, "--compile"),
        ):
            if clash:
                raise ValueError(
                    f"--enable-overlap-schedule is not supported with {what} yet; drop one of them"
                )

    def _check_draft_model(self) -> None:
        alg = self.speculative_algorithm
        draft = alg in ("draft", "eagle")
        what = "an EAGLE head folder" if alg == "eagle" else (
            "a smaller model with the same tokenizer")
        if draft and not self.speculative_draft_model_path:
            raise ValueError(f"--speculative-algorithm {alg} needs --speculative-draft-model-path "
                             f"({what})")
        if self.speculative_draft_model_path and not draft:
            raise ValueError("--speculative-draft-model-path applies to --speculative-algorithm "
                             f"draft or eagle, got {alg!r}")
        if self.speculative_num_steps is not None:
            if not draft:
                raise ValueError("--speculative-num-steps applies to --speculative-algorithm "
                                 f"draft or eagle, got {alg!r}")
            if not 1 <= self.speculative_num_steps <= 64:
                raise ValueError("speculative_num_steps must be in [1, 64], got "
                                 f"{self.speculative_num_steps}")
        if draft and self.tp_size > 1:
            raise ValueError(f"--speculative-algorithm {alg} is not supported with --tp > 1 yet; "
                             "drop one of them")
        if draft and self.lora_paths:
            raise ValueError(f"--speculative-algorithm {alg} is not supported with LoRA adapters "
                             "(--lora-paths): the draft model has no adapters; use ngram")
        if alg == "eagle" and self.compile:
            raise ValueError("--speculative-algorithm eagle is not supported with --compile "
                             "(the compiled decode step returns no features); drop one of them")

    def speculative_draft_steps(self) -> int:
        """Tokens the draft model or EAGLE head proposes per decode step."""
        return self.speculative_num_steps or self.speculative_num_draft_tokens

    def lora_slots(self) -> int:
        """How many adapters the slot buffers hold (--max-loaded-loras, resolved)."""
        if self.max_loaded_loras is not None:
            return self.max_loaded_loras
        return max(4, len(self.lora_paths))
