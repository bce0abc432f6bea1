"""Chat on a CPU: genserve's server against llama.cpp's server on the same GGUF, side by side.

    cpulock python benchmarks/bench_cpu_chat.py            # embedded SmolLM2 Q4_1 GGUF
    python benchmarks/bench_cpu_chat.py --gguf F.gguf --modes auto,none --tokens 64
    python benchmarks/bench_cpu_chat.py --smoke  # genserve alone, a tiny model: checks the script

Needs `pip install 'llama-cpp-python[server]'` (not part of CI). Each server runs alone (one is
stopped before the next starts) with the same prompts through `/v1/chat/completions` streaming:
- single stream: TTFT and decode tok/s (tokens after the first / time from first to last),
  one request at a time;
- 16 concurrent streams: aggregate output tok/s;
- genserve with each `--quantization` mode in `--modes` (batch 1), for int8wo vs none.
Prints a JSON summary with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten-year-old, step by step.",
    "Describe a walk through a busy market in a coastal town in the morning.",
    "List ten ideas for a weekend trip and say why each one is fun.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def stream_chat(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat: TTFT, chunk arrival times, token count."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the server streamed no tokens")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {
        "ttft": times[0] - t0,
        "tokens": len(times),
        "decode_tps": decode,
        "end": times[-1] - t0,
    }


def measure(base: str, model: str, tokens: int, streams: int) -> dict:
    stream_chat(base, model, "Hello!", 8)  # warm-up
    single = [stream_chat(base, model, p, tokens) for p in PROMPTS]
    results: list[dict] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        out = stream_chat(base, model, PROMPTS[i % len(PROMPTS)] + f" (variant {i})", tokens)
        with lock:
            results.append(out)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "single_decode_tps": statistics.median(r["decode_tps"] for r in single),
        "single_ttft_ms": statistics.median(r["ttft"] for r in single) * 1e3,
        "single_tokens": sum(r["tokens"] for r in single),
        f"concurrent{streams}_tps": sum(r["tokens"] for r in results) / wall,
        f"concurrent{streams}_tokens": sum(r["tokens"] for r in results),
    }


def run_server(cmd: list[str], health: str, env: dict | None = None) -> subprocess.Popen:
    # The server's log goes to a file: a pipe nobody reads fills up and blocks the server
    # (llama.cpp logs ~64 KB while loading).
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_ready(health, proc)
    except Exception:
        proc.kill()
        log.seek(0)
        print(log.read()[-3000:], file=sys.stderr)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_genserve(gguf: Path, mode: str, args) -> dict:
    """`mode` is a --quantization value, optionally with "+compile" or "+nocompile"."""
    port = free_port()
    quantization, _, extra = mode.partition("+")
    cmd = [
        sys.executable,
        "-m",
        "genserve.entrypoints.cli",
        "serve",
        "--no-diffusion",
        "--port",
        str(port),
        "--quantization",
        quantization,
    ]
    if extra in ("compile", "nocompile"):
        cmd.append("--compile" if extra == "compile" else "--no-compile")
    if not args.embedded:
        cmd += ["--model-path", str(gguf)]
    proc = run_server(cmd, f"http://127.0.0.1:{port}/health")
    try:
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        info = httpx.get(f"{base}/get_server_info").json()
        out = measure(base, model, args.tokens, args.streams)
        out["quantization"] = info.get("quantization")
        return out
    finally:
        stop(proc)


def bench_llama_cpp(gguf: Path, args) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--n_threads",
        str(args.threads),
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",
    ]
    proc = run_server(cmd, f"http://127.0.0.1:{port}/v1/models")
    try:
        return measure(f"http://127.0.0.1:{port}", "llama", args.tokens, args.streams)
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 Q4_1 GGUF")
    p.add_argument(
        "--modes",
        default="auto,auto+nocompile,none",
        help="genserve --quantization modes to run (the server's default --compile choice); "
        "MODE+compile adds --compile, MODE+nocompile --no-compile",
    )
    p.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="genserve only (unquantized, eager) on a tiny random model (not a GGUF, "
                   "so no llama.cpp), 4 tokens, 2 streams: checks the script")
    args = p.parse_args()
    from genserve.srt.model_loader import embedded_gguf_path

    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.gguf, args.skip_llama_cpp = str(tiny_chat_model()), True
        args.modes, args.tokens, args.streams = "none+nocompile", 4, 2
    args.embedded = args.gguf is None
    gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    flags = ""
    with open("/proc/cpuinfo") as f:
        text = f.read()
    for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if flag in text:
            flags = flag
            break
    summary: dict = {"gguf": gguf.name, "cpu_flag": flags, "threads": args.threads, "genserve": {}}
    if not args.skip_llama_cpp:
        summary["llama_cpp"] = bench_llama_cpp(gguf, args)
        print("llama.cpp", summary["llama_cpp"], flush=True)
    for mode in args.modes.split(","):
        summary["genserve"][mode] = bench_genserve(gguf, mode, args)
        print("genserve", mode, summary["genserve"][mode], flush=True)
    key = f"concurrent{args.streams}_tps"
    ratios: dict = {}
    g = summary["genserve"]
    if "llama_cpp" in summary:
        ref = summary["llama_cpp"]
        for mode, r in g.items():
            ratios[f"{mode}_vs_llama_cpp_single_decode"] = (
                r["single_decode_tps"] / ref["single_decode_tps"]
            )
            ratios[f"{mode}_vs_llama_cpp_ttft"] = r["single_ttft_ms"] / ref["single_ttft_ms"]
            ratios[f"{mode}_vs_llama_cpp_{key}"] = r[key] / ref[key]
    quantized = [m for m in g if g[m].get("quantization") not in (None, "none")]
    if "none" in g and quantized:
        m = quantized[0]
        ratios[f"{g[m]['quantization']}_vs_none_single_decode"] = (
            g[m]["single_decode_tps"] / g["none"]["single_decode_tps"]
        )
    summary["ratios"] = ratios
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
