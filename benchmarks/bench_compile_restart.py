"""Start-to-first-token of `genserve serve` with its compiled decode step, first start vs restart.

    cpulock python benchmarks/bench_compile_restart.py            # embedded SmolLM2, defaults
    python benchmarks/bench_compile_restart.py -- --model-path F.gguf
    python benchmarks/bench_compile_restart.py --smoke   # a tiny model, eager: checks the script

Starts `genserve serve --no-diffusion` (`--with-diffusion`: the whole default server, its
diffusion models too; plus the flags after `--`) three times, one at a time,
and measures from launching the process to the first streamed token of a chat request:
- `first`: empty compile caches (genserve's and torch's own, both in fresh folders): the full
  compile;
- `restart`: the same caches again, as a second start on the same machine;
- `restart_genserve_cache_only`: genserve's cache with torch's own cache folder fresh again (a
  machine whose temporary folder was cleared), so only genserve's stored artifacts can hit.
For each it reports the wall time to /health, to the first token and to the compiled decode
step being in use (with `--compile-warm-up background`, the default, the server answers before
that), the warm-up compile's own time and whether the compile cache hit (the server's
`compile_report`). `--rounds N` repeats the two restarts. `--warm-ups background,blocking`
measures restarts under each `--compile-warm-up` instead, alternating which goes first from
round to round. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token(url: str, model: str) -> str:
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return delta["content"]
    raise RuntimeError("the stream ended without a token")


def start_once(flags: list[str], env: dict[str, str], timeout: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "genserve.entrypoints.cli", "serve",
             "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server did not come up: {log.read()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            healthy = time.perf_counter() - t0
            info = httpx.get(url + "/get_server_info", timeout=30).json()
            token = first_token(url, info["model_name"])
            ttft = time.perf_counter() - t0
            while info.get("compile_state") == "compiling":  # a background warm-up
                if time.monotonic() > deadline:
                    raise RuntimeError("the decode step did not finish compiling")
                time.sleep(0.25)
                info = httpx.get(url + "/get_server_info", timeout=30).json()
            compiled = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(60)
        log.seek(0)
        cache_lines = [ln.strip() for ln in log if "compile cache" in ln]
    return {"start_to_first_token_s": round(ttft, 2), "start_to_healthy_s": round(healthy, 2),
            "start_to_compiled_s": round(compiled, 2),
            "compile": info["compile"], "compile_state": info.get("compile_state"),
            "compile_report": info.get("compile_report"),
            "first_token": token, "log": cache_lines[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="restart pairs measured")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("flags", nargs="*", help="extra `genserve serve` flags (after --)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, eager, float32 (no compile, so no cache hit): "
                    "the three starts of one round, to check the script")
    ap.add_argument("--with-diffusion", action="store_true",
                    help="start the diffusion runtime too (the whole default server)")
    ap.add_argument("--warm-ups", default=None,
                    help="comma-separated --compile-warm-up values to restart under, in "
                         "interleaved rounds (instead of the two restart kinds)")
    args = ap.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.flags = ["--model-path", str(tiny_chat_model()), "--no-compile", "--quantization",
                      "none", "--dtype", "float32", *args.flags]
        args.rounds = 1
    if not args.with_diffusion:
        args.flags = ["--no-diffusion", *args.flags]
    work = Path(tempfile.mkdtemp(prefix="bench_compile_restart_"))
    env = {**os.environ, "GENSERVE_COMPILE_CACHE_DIR": str(work / "genserve"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "torch0")}
    out: dict = {"flags": args.flags, "first": start_once(args.flags, env, args.timeout),
                 "restart": [], "restart_genserve_cache_only": []}
    print(json.dumps({"first": out["first"]}), flush=True)
    if args.warm_ups:
        compare_warm_ups(args, env, out)
        return
    for r in range(args.rounds):
        out["restart"].append(start_once(args.flags, env, args.timeout))
        fresh = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / f"torch{r + 1}")}
        out["restart_genserve_cache_only"].append(start_once(args.flags, fresh, args.timeout))
        print(json.dumps({k: out[k][-1] for k in ("restart", "restart_genserve_cache_only")}),
              flush=True)
    print(json.dumps(out, indent=2))


def compare_warm_ups(args: argparse.Namespace, env: dict[str, str], out: dict) -> None:
    """Restarts (caches warm from the first start) under each warm-up, interleaved."""
    modes = args.warm_ups.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            run = start_once([*args.flags, "--compile-warm-up", mode], env, args.timeout)
            runs[mode].append(run)
            print(json.dumps({"round": r, "warm_up": mode, **run}), flush=True)
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {key: sorted(x[key] for x in rs) for key in (
            "start_to_healthy_s", "start_to_first_token_s", "start_to_compiled_s")}
    print(json.dumps({"flags": args.flags, "first": out["first"], "summary": summary},
                     indent=2))


if __name__ == "__main__":
    main()
