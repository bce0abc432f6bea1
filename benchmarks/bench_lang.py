"""genserve.lang benchmark: prefix sharing through the frontend, measured side by side.

    python benchmarks/bench_lang.py            # both workloads, JSON summary at the end
    python benchmarks/bench_lang.py --smoke    # a tiny random model, 1 round: checks the script

Two real `genserve serve` processes (the embedded SmolLM2-135M-Instruct, float32, unquantized,
eager: `--quantization none --no-compile`, the configuration docs/benchmarks.md describes), one
after the other on the same machine: one with the radix cache, one with `--disable-radix-cache`.

1. Tree of thought: a 512-token shared context, then fork 4 (each branch generates 32 tokens),
   then each branch forks 4 again (32 tokens each): 20 generations. The same program runs on
   both servers; without the cache every call is an independent request that prefills its whole
   prompt. Target: radix >= 2x the throughput (generated tokens / s).
2. select over 4 choices after a 512-token context, cold cache: the frontend prefills the context
   once and scores the 4 choices in one batched request; against 4 separate scoring calls that
   each prefill context + choice. Reported: wall time and prefilled tokens of each.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx

from genserve.lang import RuntimeEndpoint, assistant, function, gen, select, user

CONTEXT = ("The city council met on Tuesday to discuss the new park, the bus lines, the library "
           "hours and the budget for the coming year. ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: argparse.Namespace, *extra: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        model = ["--model-path", args.model_path] if args.model_path else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
             "--port", str(port), "--dtype", "float32", "--quantization", args.quantization,
             "--no-compile", "--max-total-tokens", "32768", *model, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("genserve serve exited during start-up")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("genserve serve did not come up")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def context_text(backend: RuntimeEndpoint, tokens: int) -> str:
    """About `tokens` tokens of context (measured with the server's tokenizer)."""
    text = ""
    while True:
        text += CONTEXT
        _, meta = backend.generate(text, {"max_new_tokens": 0}, [])
        if meta["prompt_tokens"] >= tokens:
            return text


@function
def tree_of_thought(s, context, width, out_len):
    s += user(context + "How should the council spend the budget? Think step by step.")
    s += assistant("")
    level1 = s.fork(width)
    for i, a in enumerate(level1):
        a += f"Option {i + 1}: " + gen("thought", max_tokens=out_len, ignore_eos=True)
    level1.join()
    level2 = []
    for a in level1:
        subs = a.fork(width)
        for j, b in enumerate(subs):
            b += f"\nRefinement {j + 1}: " + gen("refine", max_tokens=out_len, ignore_eos=True)
        level2.append(subs)
    for subs in level2:
        subs.join()
    s += f"{width} options, {width * width} refinements."


def bench_tree(url: str, context: str, width: int, out_len: int, rounds: int) -> dict:
    backend = RuntimeEndpoint(url)
    tree_of_thought.run(context=context, width=width, out_len=4, backend=backend)  # warm-up
    times = []
    for _ in range(rounds):
        backend.flush_cache()
        t = time.perf_counter()
        tree_of_thought.run(context=context, width=width, out_len=out_len, backend=backend,
                            temperature=0)
        times.append(time.perf_counter() - t)
    generated = (width + width * width) * out_len
    best = min(times)
    return {"seconds": times, "generated_tokens": generated, "tok_per_s": generated / best}


def bench_select(url: str, context: str, choices: list[str], rounds: int) -> dict:
    backend = RuntimeEndpoint(url)

    @function
    def choose(s):
        s += user(context + "Which topic came first?")
        s += assistant("The first topic was " + select("topic", choices))

    lang_times, separate_times = [], []
    prefix = None
    for _ in range(rounds):
        backend.flush_cache()
        t = time.perf_counter()
        state = choose.run(backend=backend)
        lang_times.append(time.perf_counter() - t)
        text = state.text()
        prefix = text[: text.rindex("The first topic was ")] + "The first topic was "
        start = max(state.get_meta_info("topic")["prompt_tokens"] - 2, 0)
        t = time.perf_counter()
        for c in choices:  # each call alone: prefills context + choice and scores it
            backend.flush_cache()
            backend.score([prefix + c], start, [])
        separate_times.append(time.perf_counter() - t)
    prompt_tokens = state.get_meta_info("topic")["prompt_tokens"]
    return {
        "lang_select_seconds": min(lang_times),
        "separate_calls_seconds": min(separate_times),
        "speedup": min(separate_times) / min(lang_times),
        "prefilled_tokens_lang": prompt_tokens + 4 * 4,  # context once, each choice's tail
        "prefilled_tokens_separate": 4 * prompt_tokens,
        "picked": state["topic"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=512)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default="none",
                    help="the servers' --quantization (pinned: `auto` may pick per start)")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, a 32-token context, fork 2 x 2 tokens, 1 round")
    args = ap.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.model_path = args.model_path or str(tiny_chat_model())
        args.context_tokens, args.width, args.out_len, args.rounds = 32, 2, 2, 1
    results: dict = {"quantization": args.quantization}
    radix = Server(args)
    try:
        context = context_text(RuntimeEndpoint(radix.url), args.context_tokens)
        results["tree_radix"] = bench_tree(radix.url, context, args.width, args.out_len,
                                           args.rounds)
        print("tree, radix cache:", results["tree_radix"], flush=True)
        results["select"] = bench_select(radix.url, context,
                                         ["the park", "the bus lines", "the library hours",
                                          "the budget"], args.rounds + 1)
        print("select:", results["select"], flush=True)
    finally:
        radix.close()
    plain = Server(args, "--disable-radix-cache")
    try:
        results["tree_no_cache"] = bench_tree(plain.url, context, args.width, args.out_len,
                                              args.rounds)
        print("tree, no cache:", results["tree_no_cache"], flush=True)
    finally:
        plain.close()
    results["tree_speedup"] = (results["tree_radix"]["tok_per_s"]
                               / results["tree_no_cache"]["tok_per_s"])
    print(json.dumps({"tree_speedup": results["tree_speedup"],
                      "select_speedup": results["select"]["speedup"]}, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
