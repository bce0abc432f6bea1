"""One prepared run that measures genserve's GPU path on one CUDA GPU and writes a markdown table.

    scripts/device_check.sh [--dry-run] [--out FILE.md] [--only STEP ...]

Steps (each in its own process, with its own time budget; a step that fails or runs out of time
is a FAILED row with the error's last line, and the run goes on):
  device       the card's name, memory and peak bandwidth
  cuda_tests   the CUDA-only tests (`pytest -m gpu`)
  attention    Triton decode and extend attention vs torch SDPA (benchmarks/bench_kernels.py)
  fp8          an FP8 checkpoint's linears kept in float8 (torch._scaled_mm, per-token
               activations) vs dequantized once into bf16, Qwen2.5-0.5B-shaped, 1..2048 tokens
  llm          a random-weight Llama-3-8B-shaped bf16 model on the shared-prefix workload
               through the offline engine (benchmarks/bench_offline.py), torch vs triton;
               CUDA graphs on vs off, and the overlap schedule on vs off, at batch-1 decode
               (triton), with their greedy tokens
  flux         a random-weight FLUX.1-shaped transformer: genserve's pipeline vs plain diffusers
  video        a random-weight Helios-shaped streaming video model: frames per second
  memory_plan  an 8B LLM + a FLUX-sized DiT on one card: the server's memory plan from the
               measured weights and DiT peak, its KV pool allocated beside them
Random weights at real shapes measure speed without downloads. `--dry-run` runs every step at toy
sizes on the CPU (no CUDA call), so a broken import or argument shows before a GPU is lent.
The steps are in device_check_llm.py, device_check_fp8.py and device_check_diffusion.py; the
run stops at under 8 minutes (TOTAL_BUDGET_S), each step within its own budget.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # the benchmarks/ module with `step_<name>`
    budget_s: int  # wall-clock limit of the step's process on the GPU
    what: str


STEPS = (
    Step("device", "device_check_llm", 25, "the card"),
    Step("cuda_tests", "device_check_llm", 95, "the CUDA-only tests"),
    Step("attention", "device_check_llm", 50, "Triton attention vs torch SDPA"),
    Step("fp8", "device_check_fp8", 30, "fp8 _scaled_mm vs dequantized bf16, 0.5B layer"),
    Step("llm", "device_check_llm", 115, "Llama-3-8B-shaped model, offline engine"),
    Step("flux", "device_check_diffusion", 65, "FLUX.1-shaped transformer step"),
    Step("video", "device_check_diffusion", 75, "Helios-shaped streaming video"),
    Step("memory_plan", "device_check_diffusion", 50, "8B LLM + FLUX-sized DiT, one card"),
)
TOTAL_BUDGET_S = 470  # under 8 minutes with the start-up of the parent
DRY_RUN_BUDGET_S = 300  # all steps together, at toy sizes on a CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="toy sizes on the CPU, no CUDA call: checks imports and arguments")
    p.add_argument("--out", default="device_check.md", help="markdown table (default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], default=None,
                   help="run only these steps")
    # Internal: run these steps in this process, appending one JSON line per step to --result.
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the child: runs steps in this process ----

def run_child(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import importlib
    import traceback

    from device_check_llm import Context

    by_name = {s.name: s for s in STEPS}
    for name in args.child.split(","):
        step = by_name[name]
        ctx = Context(dry_run=args.dry_run, workdir=Path(args.workdir), budget_s=args.budget)
        start = time.perf_counter()
        try:
            fn = getattr(importlib.import_module(step.module), f"step_{name}")
            record = {"step": name, "rows": fn(ctx)}
        except Exception as exc:  # the table reports it; the next step runs
            traceback.print_exc()
            record = {"step": name, "error": last_line(
                "".join(traceback.format_exception_only(type(exc), exc)))}
        record["seconds"] = round(time.perf_counter() - start, 1)
        with open(args.result, "a") as f:
            f.write(json.dumps(record) + "\n")
        ctx.release_memory()
    return 0


# ---- the parent: one child process per step (all in one on a dry run) ----

def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_group(names: list[str], args, timeout_s: float, workdir: Path, log) -> list[dict]:
    """Run `names` in one child process; one record per step (an error for those that made
    none: the child timed out or died)."""
    result = workdir / f"result-{names[0]}.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(names),
           "--result", str(result), "--budget", str(timeout_s), "--workdir", str(workdir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if args.dry_run:
        cmd.append("--dry-run")
        env["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA call, even on a GPU machine
        env["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU, chosen before triton loads
        env.setdefault("OMP_NUM_THREADS", "1")
    log.write(f"\n==== {', '.join(names)} ====\n")
    log.flush()
    problem = None
    with tempfile.TemporaryFile("w+") as output:
        # A session of its own: on a timeout the whole group goes (a step's own children, such
        # as the CUDA tests' pytest, must not hold GPU memory into the next step).
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            if code != 0:
                problem = f"exit status {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            problem = f"timed out after {timeout_s:.0f} s"
        output.seek(0)
        text = output.read()
    log.write(text)
    log.flush()
    records = {}
    if result.exists():
        for line in result.read_text().splitlines():
            record = json.loads(line)
            records[record["step"]] = record
    for name in names:
        if name not in records:
            reason = problem or "no result"
            records[name] = {"step": name, "error": f"{reason}: {last_line(text)}"}
    return [records[n] for n in names]


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(records: list[dict], header: str) -> str:
    whats = {s.name: s.what for s in STEPS}
    lines = [header, "", "| step | what it measured | figure | note |", "|---|---|---|---|"]
    for rec in records:
        if "error" in rec:
            lines.append(f"| {rec['step']} | {cell(whats[rec['step']])} | FAILED | "
                         f"{cell(rec['error'])} |")
            continue
        for row in rec["rows"]:
            lines.append(f"| {rec['step']} | {cell(row['measured'])} | {cell(row['figure'])} | "
                         f"{cell(row['note'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    steps = [s for s in STEPS if args.only is None or s.name in args.only]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = time.monotonic() + (DRY_RUN_BUDGET_S if args.dry_run else TOTAL_BUDGET_S)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="device_check-") as tmp, \
            open(out.with_suffix(".log"), "w") as log:
        workdir = Path(tmp)
        groups = [[s.name for s in steps]] if args.dry_run else [[s.name] for s in steps]
        for names in groups:
            left = deadline - time.monotonic()
            budget = left if args.dry_run else min(
                next(s.budget_s for s in steps if s.name == names[0]), left)
            if budget < 5:
                records += [{"step": n, "error": "skipped: the run's time is spent"}
                            for n in names]
                continue
            print(f"device_check: {', '.join(names)} (budget {budget:.0f} s)", file=sys.stderr,
                  flush=True)
            got = run_group(names, args, budget, workdir, log)
            for rec in got:
                state = "FAILED: " + rec["error"] if "error" in rec else "ok"
                print(f"device_check: {rec['step']} {state} ({rec.get('seconds', '-')} s)",
                      file=sys.stderr, flush=True)
            records += got
            out.write_text(markdown(records, "# genserve device check (unfinished)"))
            if not args.dry_run and names == ["device"] and "error" in got[0]:
                print("device_check: no usable CUDA GPU here; use --dry-run on a CPU",
                      file=sys.stderr)
                break
    mode = "dry run: toy sizes on the CPU" if args.dry_run else "real shapes"
    header = (f"# genserve device check ({mode})\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
              f"{time.time() - started:.0f} s; log: {out.with_suffix('.log').name}")
    table = markdown(records, header)
    out.write_text(table)
    print(table)
    failed = any("error" in r or any(row["figure"] == "FAILED" for row in r["rows"])
                 for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
