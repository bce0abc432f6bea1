"""Steps of benchmarks/device_check.py on the card and the LLM path: the device, the CUDA-only
tests, Triton attention vs SDPA, and a Llama-3-8B-shaped model through the offline engine. Each
`step_*` returns its table rows; a dry run takes toy sizes on the CPU through the same code."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

# Llama-3-8B's config.json (no weights: the engine's load_format "dummy" makes random ones).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
LLAMA_TOY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 512}
# bench_offline's shared-prefix workload: groups x per_group requests, a system prompt per group.
SHARED_PREFIX = dict(groups=8, per_group=8, system_len=512, question_len=32, output_len=32)
SHARED_PREFIX_TOY = dict(groups=2, per_group=2, system_len=24, question_len=4, output_len=4)
# EngineArgs fields that would switch CUDA graphs (True = on), when the runtime has one.
CUDA_GRAPH_FLAGS = ("cuda_graph", "enable_cuda_graph", "disable_cuda_graph")


@dataclass(frozen=True)
class Context:
    dry_run: bool
    workdir: Path  # scratch folder of this run (model configs)
    budget_s: float = 0.0  # this step's process limit

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    @property
    def dtype(self):
        """What the models run in: bf16, on the CPU of a dry run too (the same casts)."""
        import torch

        return torch.bfloat16

    def require_device(self) -> None:
        import torch

        if not self.dry_run and not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU visible to torch (use --dry-run on a CPU)")

    def sync(self) -> None:
        import torch

        if not self.dry_run:
            torch.cuda.synchronize()

    def seconds(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def release_memory(self) -> None:
        import gc

        gc.collect()
        if not self.dry_run and "torch" in sys.modules:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def row(measured: str, figure: str, note: str = "") -> dict:
    return {"measured": measured, "figure": figure, "note": note}


def error_line(exc: BaseException) -> str:
    """The error's last line, as the table shows it (the traceback goes to the log)."""
    import traceback

    traceback.print_exception(exc)
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (they are scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def default_dtype(dtype):
    """Build modules with parameters in `dtype` (no float32 copy of a 12B model first)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def write_llm_config(ctx: Context) -> Path:
    folder = ctx.workdir / ("llama-toy" if ctx.dry_run else "llama3-8b-shaped")
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_TOY if ctx.dry_run else LLAMA3_8B))
    return folder


def llama_8b_parameters(ctx: Context) -> int:
    """Llama-3-8B's parameter count from genserve's own model class, built on the meta device."""
    import torch

    from genserve.srt.model_config import ModelConfig
    from genserve.srt.models.base import ModelKernels
    from genserve.srt.models.registry import get_model_class

    folder = ctx.workdir / "llama3-8b-config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(
            config, ModelKernels(norm="torch", rotary="torch", moe="torch"))
    return sum(p.numel() for p in model.parameters())


# ---- steps ----

def step_device(ctx: Context) -> list[dict]:
    import torch

    ctx.require_device()
    versions = f"torch {torch.__version__}"
    for name in ("triton", "diffusers", "transformers"):
        try:
            versions += f", {name} {__import__(name).__version__}"
        except ImportError:
            versions += f", no {name}"
    if ctx.dry_run:
        return [row("device", "cpu (dry run)", versions)]
    bench = load_benchmark("bench_kernels")
    name = torch.cuda.get_device_name()
    free, total = torch.cuda.mem_get_info()
    peak_bw, peak_tf = bench.device_peaks(name)
    peaks = (f"peak {peak_bw:.0f} GB/s, {peak_tf:.0f} bf16 TFLOP/s" if peak_bw
             else "not in the table of known cards: GB/s only")
    return [row("device", name, f"{gib(total)} ({gib(free)} free); {peaks}; {versions}")]


def gpu_test_files() -> list[str]:
    """Test files that hold CUDA-only tests (the `gpu` marker; conftest skips them on a CPU)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def step_cuda_tests(ctx: Context) -> list[dict]:
    files = gpu_test_files()
    if not files:
        raise RuntimeError("no test file has the gpu marker")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *files]
    if ctx.dry_run:
        cmd += ["--collect-only", "-q"]
    else:
        cmd += ["-v"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["--timeout=60"]  # one hung kernel test must not take the whole budget
    limit = max(10.0, (ctx.budget_s or 600) - 15)  # leave time to report a partial run
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=limit)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        text = "".join(b.decode() if isinstance(b, bytes) else (b or "")
                       for b in (exc.stdout, exc.stderr))
        code = None
    if ctx.dry_run:
        match = re.search(r"(\d+)(?:/\d+)? tests? collected", text)
        if code != 0 or match is None:
            raise RuntimeError(f"collection failed: {text.strip().splitlines()[-1]}")
        return [row(f"pytest -m gpu ({len(files)} files)", f"{match.group(1)} collected",
                    "not run: no GPU in a dry run")]
    counts: dict[str, int] = {}
    for outcome in re.findall(r" (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", text):
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    figure = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none ran"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    note = "; ".join(f.split("::")[-1] for f in failed[:4]) + (" ..." if len(failed) > 4 else "")
    if code is None:
        note = f"stopped after {limit:.0f} s (partial counts); " + note
    return [row(f"pytest -m gpu ({len(files)} files)", figure, note or "all passed")]


def step_attention(ctx: Context) -> list[dict]:
    import torch

    ctx.require_device()
    bench = load_benchmark("bench_kernels")
    on_gpu = not ctx.dry_run
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak_bw, peak_tf = bench.device_peaks(name) if on_gpu else (None, None)
    # Decode at the benchmark's default shape and at a long context with the same KV bytes.
    cases = [["--smoke"]] if ctx.dry_run else [[], ["--batch", "8", "--context", "32768"]]
    rows, failed = [], []
    for extra in cases:
        args = bench.parse_args(extra)
        dtype = getattr(torch, args.dtype)
        torch.manual_seed(0)
        dec = bench.bench_decode(args, ctx.device, dtype, on_gpu)
        s = dec["shape"]
        gbs = dec["gb_per_s"]["triton"]
        share = f" = {100 * gbs / peak_bw:.0f}% of peak" if peak_bw else ""
        rows.append(row(
            f"decode attention, batch {s['batch']} x {s['context']} tokens, "
            f"{s['num_heads']}/{s['num_kv_heads']} heads x {s['head_dim']}",
            f"{dec['ms']['triton']:.3f} ms, {gbs:.0f} GB/s{share}",
            f"SDPA dense {dec['ms']['sdpa_dense']:.3f} ms, with the pool gather "
            f"{dec['ms']['sdpa_with_gather']:.3f} ms; max err {dec['max_abs_error_vs_sdpa']:.1e}"))
        exts = [] if extra != cases[0] else [bench.bench_extend(args, ctx.device, dtype, on_gpu, p)
                                             for p in (0, args.prompt * 3 // 4)]
        for ext in exts:
            e, tf = ext["shape"], ext["tflop_per_s"]["triton"]
            share = f" = {100 * tf / peak_tf:.0f}% of peak" if peak_tf else ""
            rows.append(row(
                f"extend attention, {e['new_tokens']} new tokens after {e['prefix']} cached",
                f"{ext['ms']['triton']:.3f} ms, {tf:.1f} TFLOP/s{share}",
                f"SDPA with the gather {ext['ms']['sdpa_with_gather']:.3f} ms "
                f"({ext['ms']['sdpa_with_gather'] / ext['ms']['triton']:.2f}x); "
                f"max err {ext['max_abs_error_vs_sdpa']:.1e}"))
        failed += bench.failed_cases({"dtype": args.dtype, "decode": dec, "extend": exts})
    if failed:
        rows.append(row("Triton output vs SDPA", "FAILED", "; ".join(failed)))
    return rows


def cuda_graph_flag() -> str | None:
    from genserve.srt.server_args import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return next((f for f in CUDA_GRAPH_FLAGS if f in names), None)


def _engine_figures(ctx: Context, folder: Path, backend: str, extra: dict,
                    workload: bool = True) -> dict:
    """Shared-prefix throughput (unless not `workload`) and batch-1 decode speed and greedy
    tokens of one engine."""
    offline = load_benchmark("bench_offline")
    from genserve import Engine

    engine = Engine(str(folder), load_format="dummy", dtype=str(ctx.dtype).removeprefix("torch."),
                    device=ctx.device.type, attention_backend=backend,
                    max_total_tokens=2048 if ctx.dry_run else 65536, **extra)
    try:
        vocab = engine.runtime.config.vocab_size
        offline.run_engine(engine, [offline.rand_ids(random.Random(9), 64, vocab)] * 2, 4)
        engine.flush_cache()  # warm-up above: first calls compile kernels and allocate
        figures: dict = {}
        if workload:
            work = SimpleNamespace(**(SHARED_PREFIX_TOY if ctx.dry_run else SHARED_PREFIX))
            reqs = offline.shared_prefix_workload(work, vocab)
            tokens = sum(len(r) for r in reqs) + len(reqs) * work.output_len
            seconds, _ = offline.run_engine(engine, reqs, work.output_len)
            stats = engine.server_info()["stats"]
            engine.check_integrity()
            engine.flush_cache()
            figures = {"requests": len(reqs), "tok_per_s": tokens / seconds,
                       "hit": stats["cached_tokens"] / max(1, stats["prompt_tokens"])}
        one, out_len = [offline.rand_ids(random.Random(2), 16, vocab)], 8 if ctx.dry_run else 64
        full, outs = offline.run_engine(engine, one, out_len)
        engine.flush_cache()
        prefill, _ = offline.run_engine(engine, one, 1)  # subtracted: decode steps only
        engine.flush_cache()
        engine.check_integrity()
        return {**figures, "decode_tok_per_s": (out_len - 1) / max(full - prefill, 1e-9),
                "tokens": outs[0]["output_ids"]}
    finally:
        engine.shutdown()
        del engine
        ctx.release_memory()


def step_llm(ctx: Context) -> list[dict]:
    ctx.require_device()
    folder = write_llm_config(ctx)
    shape = "toy Llama" if ctx.dry_run else "Llama-3-8B-shaped bf16"
    flag = cuda_graph_flag()
    off = {flag: flag == "disable_cuda_graph"} if flag else {}
    rows, runs = [], {}
    for backend, extra in (("torch", {}), ("triton", off)):
        label = f"{shape}, shared-prefix workload, {backend} attention"
        try:
            runs[backend] = r = _engine_figures(ctx, folder, backend, extra)
        except Exception as exc:  # the other backend still runs
            rows.append(row(label, "FAILED", error_line(exc)))
            continue
        rows.append(row(label, f"{r['tok_per_s']:.0f} tok/s",
                        f"{r['requests']} requests; prefix cache hit {100 * r['hit']:.0f}%; "
                        f"batch-1 decode {r['decode_tok_per_s']:.1f} tok/s"))
    if len(runs) == 2:
        rows.append(row("triton vs torch attention, shared prefix",
                        f"{runs['triton']['tok_per_s'] / runs['torch']['tok_per_s']:.2f}x", ""))
    label = "CUDA graphs on vs off, batch-1 decode (triton)"
    if flag is None:
        rows.append(row(label, "not built yet",
                        f"EngineArgs has none of {', '.join(CUDA_GRAPH_FLAGS)}"))
    elif "triton" in runs:
        # A dry run has no CUDA: the same buckets, buffers and padding with the forward called
        # instead of a graph replayed (the runtime's eager capture, for tests).
        on_args = {flag: flag != "disable_cuda_graph", "cuda_graph_max_bs": 4,
                   **({"cuda_graph_capture": "eager"} if ctx.dry_run else {})}
        try:
            on = _engine_figures(ctx, folder, "triton", on_args, workload=False)
        except Exception as exc:
            rows.append(row(label, "FAILED", error_line(exc)))
            return rows
        off_run = runs["triton"]
        same = on["tokens"] == off_run["tokens"]
        ratio = on["decode_tok_per_s"] / off_run["decode_tok_per_s"]
        # On a GPU a mismatch is reported beside the speed; on a CPU tokens must agree.
        figure = ("eager capture (dry run)" if same else "FAILED") if ctx.dry_run else (
            f"{ratio:.2f}x")
        rows.append(row(label, figure,
                        f"on {on['decode_tok_per_s']:.1f} tok/s, off "
                        f"{off_run['decode_tok_per_s']:.1f} tok/s (target >= 1.5x); greedy "
                        f"tokens {'identical' if same else 'DIFFER'}"))
    if "triton" in runs:
        rows.append(_overlap_row(ctx, folder, off, runs["triton"]))
    return rows


def _overlap_row(ctx: Context, folder: Path, off: dict, off_run: dict) -> dict:
    """--enable-overlap-schedule on vs off at batch-1 decode (triton, graphs off), against the
    triton run above; a runtime without the flag gets a 'not built yet' row."""
    from genserve.srt.server_args import EngineArgs

    label = "overlap schedule on vs off, batch-1 decode (triton)"
    if "enable_overlap_schedule" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return row(label, "not built yet", "EngineArgs has no enable_overlap_schedule")
    try:
        on = _engine_figures(ctx, folder, "triton", {**off, "enable_overlap_schedule": True},
                             workload=False)
    except Exception as exc:
        return row(label, "FAILED", error_line(exc))
    same = on["tokens"] == off_run["tokens"]
    ratio = on["decode_tok_per_s"] / off_run["decode_tok_per_s"]
    figure = ("worker thread (dry run)" if same else "FAILED") if ctx.dry_run else f"{ratio:.2f}x"
    return row(label, figure, f"on {on['decode_tok_per_s']:.1f} tok/s, off "
                              f"{off_run['decode_tok_per_s']:.1f} tok/s; greedy tokens "
                              f"{'identical' if same else 'DIFFER'}")
