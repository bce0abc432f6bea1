"""`genserve` console script: `serve`, `generate`, `models`, `bench serving`.

Argument parsing only; the work is in `serve.py`, `offline.py`, `model_catalog.py` and
`genserve.bench`. Choices come from the settings they configure (server args, gateway config,
diffusion options). Nothing here imports torch: each command imports its runtime when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from genserve import __version__
from genserve.entrypoints import data_parallel
from genserve.entrypoints.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from genserve.multimodal_gen import messages as diffusion_options
from genserve.srt import server_args as llm_args

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _add_llm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LLM runtime")
    g.add_argument("--model-path", action="append", default=None, metavar="PATH",
                   help="HF folder, .gguf file, hub id or model name of an LLM (repeatable). "
                        "Default: the default LLMs `genserve models` lists.")
    g.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="Extra name under which the first LLM is served (repeatable).")
    g.add_argument("--dtype", default=None, choices=llm_args.DTYPES,
                   help="Weights and activations dtype (default auto: the runtime picks).")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    g.add_argument("--quantization", default="auto", choices=llm_args.QUANTIZATIONS,
                   help="Weight-only quantization of the linear layers (torchao). auto "
                        "(default) runs a quantized GGUF as int8wo, an FP8 checkpoint as fp8 "
                        "on CUDA, and leaves full-precision checkpoints as they are. fp8 keeps "
                        "an FP8 checkpoint's float8 weights (per-tensor or per-channel "
                        "scales) and runs them with torch._scaled_mm.")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the batch-1 decode step (needs a C++ compiler on CPU): "
                        "one chat streams faster, compiling adds minutes to start-up "
                        "(docs/benchmarks.md). Default: on for int8wo/int4wo weights on a CPU "
                        "with g++ or clang++ and one rank, else off; --no-compile skips it.")
    g.add_argument("--compile-warm-up", default=None, choices=("background", "blocking"),
                   help="background (serve's default): the server answers at once and decodes "
                        "eagerly until the compiled step is ready; blocking (generate's "
                        "default): the start waits for it.")
    g.add_argument("--attention-backend", default=None, choices=llm_args.ATTENTION_BACKENDS)
    g.add_argument("--enable-cuda-graph", dest="enable_cuda_graph", action="store_true",
                   default=None,
                   help="CUDA: replay decode steps from graphs captured at start-up, one per "
                        "batch-size bucket (1, 2, 4, 8, 16, 24...; triton attention backend). "
                        "Off by default until the device check shows it wins "
                        "(docs/benchmarks.md).")
    g.add_argument("--disable-cuda-graph", dest="enable_cuda_graph", action="store_false",
                   help="Decode eagerly (SGLang's flag; the default here).")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="Largest decode batch with a graph (default: 32, at most "
                        "--max-running-requests); larger batches decode eagerly.")
    g.add_argument("--enable-overlap-schedule", action="store_true", default=None,
                   help="Launch each decode step before the previous one's tokens reach the "
                        "host, whose work on them (stop checks, streaming, finishing) runs "
                        "meanwhile. Off by default until the device check shows it wins "
                        "(docs/benchmarks.md).")
    g.add_argument("--schedule-policy", default="fcfs", choices=llm_args.SCHEDULE_POLICIES)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="LLM waiting-queue limit (on top of --max-running-requests); "
                        "more requests get 503 at once.")
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=None,
                   help="The whole server's share of the device (default 0.85): weights, "
                        "the diffusion peak and the LLMs' KV pools together, in one memory "
                        "plan (README, 'One memory plan').")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens.")
    g.add_argument("--chunked-prefill-size", type=int, default=None)
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of each LLM scheduler process (default: the thread "
                        "split of genserve/thread_split.py).")
    g.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=None, metavar="N",
                   help="Tensor parallelism: split every layer's heads and columns over N "
                        "processes (one GPU each on CUDA, gloo on CPU). Text models of the "
                        "Llama family (Llama, Mistral, Qwen2, Qwen3).")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--is-embedding", action="store_true",
                   help="Serve a decoder (Qwen3, Llama...) as a last-token-pooling embedder "
                        "on /v1/embeddings. Folders with a sentence-transformers pooling "
                        "config, encoders and rerankers are detected without it.")
    g.add_argument("--grammar-backend", default=None, choices=llm_args.GRAMMAR_BACKENDS,
                   help="Constrained decoding (json_schema / regex / ebnf, response_format, "
                        "tool_choice required). Default xgrammar.")
    g.add_argument("--disable-jump-forward", action="store_true",
                   help="Decode grammar-forced text token by token instead of appending it.")
    g.add_argument("--speculative-algorithm", default=None,
                   choices=llm_args.SPECULATIVE_ALGORITHMS,
                   help="Speculative decoding. ngram: draft tokens by prompt lookup (the "
                        "request's own prompt and output); draft: a smaller model with the "
                        "same tokenizer proposes them (--speculative-draft-model-path); "
                        "eagle: an EAGLE-1/2 or EAGLE-3 head (LlamaForCausalLMEagle or "
                        "LlamaForCausalLMEagle3 folder at --speculative-draft-model-path) "
                        "drafts from the target's features. The "
                        "target verifies them in one forward; greedy output is unchanged, "
                        "sampled output keeps its distribution.")
    g.add_argument("--speculative-draft-model-path", default=None, metavar="PATH",
                   help="draft: the draft model (HF folder, .gguf, or a served name); "
                        "eagle: the EAGLE head's folder.")
    g.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft, eagle: tokens drafted per decode step (default: "
                        "--speculative-num-draft-tokens).")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="Draft tokens verified per decode step (default 4).")
    g.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None,
                   help="ngram: shortest context suffix that may match (default 2).")
    g.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None,
                   help="ngram: longest context suffix tried first (default 6).")
    g.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=None,
                   help="ngram: most distinct continuations (earlier matches of the context) "
                        "merged into one draft tree of --speculative-num-draft-tokens nodes "
                        "and verified in one forward with a tree attention mask (default 1: "
                        "one chain).")
    g.add_argument("--lora-paths", nargs="+", action="extend", default=None,
                   metavar="NAME=PATH",
                   help="PEFT LoRA adapter folders served at start-up (repeatable). A request "
                        "selects one by name: lora_path on /generate, model NAME or "
                        "BASE:NAME on the OpenAI API.")
    g.add_argument("--max-loaded-loras", type=int, default=None,
                   help="Adapters held in the model's LoRA slots at once (default 4, or the "
                        "number of --lora-paths); the least recently used unpinned one "
                        "leaves when another is needed.")
    g.add_argument("--max-images-per-request", type=int, default=None,
                   help="Vision models: images one request may carry (default 16).")
    g.add_argument("--image-cache-bytes", type=int, default=None,
                   help="Vision models: byte budget of the image-embedding cache.")


def _add_diffusion_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("diffusion runtime")
    g.add_argument("--diffusion-model-path", action="append", default=None, metavar="PATH",
                   help="diffusers folder, hub id or model name (repeatable). Default: the "
                        "default diffusion models `genserve models` lists.")
    g.add_argument("--step-cache", default="none", choices=diffusion_options.STEP_CACHE_KINDS)
    g.add_argument("--step-cache-threshold", type=float, default=None)
    g.add_argument("--diffusion-max-batch-size", type=int, default=4)
    g.add_argument("--diffusion-num-threads", type=int, default=None,
                   help="torch threads of the diffusion worker (default: GENSERVE_NUM_THREADS, "
                        "else the thread split of genserve/thread_split.py).")
    g.add_argument("--diffusion-batch-delay-ms", type=float, default=10.0)
    g.add_argument("--diffusion-cpu-offload", action="store_true",
                   help="The same as --diffusion-offload model.")
    g.add_argument("--diffusion-offload", default="none", choices=diffusion_options.OFFLOAD_MODES,
                   help="Keep weights in host memory and move them to the GPU per component "
                        "(model) or per layer (sequential).")
    g.add_argument("--diffusion-vae-tiling", action="store_true",
                   help="Decode large pictures in tiles (bounded VAE memory).")
    g.add_argument("--diffusion-vae-slicing", action="store_true",
                   help="Decode a batch one picture at a time.")
    g.add_argument("--diffusion-quantization", default="none",
                   choices=diffusion_options.DIFFUSION_QUANTIZATIONS,
                   help="Weight-only int8 quantization of the denoiser (torchao).")
    g.add_argument("--lora", action="append", default=None, metavar="[MODEL:]NAME=PATH",
                   help="Load a LoRA adapter at start under NAME (repeatable); requests pick "
                        "adapters with \"lora\": {NAME: scale}. Without MODEL it is loaded "
                        "into every diffusion model, each of which it must fit.")
    g.add_argument("--diffusion-workers", type=int, default=1, metavar="N",
                   help="Diffusion worker processes, one per device (GPU i for worker i; on "
                        "a CPU-only machine they share the cores). Requests of one shape "
                        "still batch on one worker.")
    g.add_argument("--diffusion-cp", type=int, default=1, metavar="N",
                   help="Context parallelism: split each diffusion call's token sequences over "
                        "N devices (cache-dit Ulysses attention; GPU r for rank r, gloo on a "
                        "CPU). N must divide the model's attention heads. FLUX.1 (also "
                        "Kontext, Fill), Wan 2.1 (also image-to-video) and LTX-Video.")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="Start the HTTP server.",
                       description="Serve LLMs and diffusion models over HTTP. With no model "
                                   "argument both embedded defaults are served.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None,
                   help="Require this key (Bearer or x-api-key) on every route but /health, "
                        "/metrics and the web UI's page and files under /ui/.")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="Allow this browser origin (repeatable; CORS is off by default). "
                        "WebSockets from pages of other origins than the server's own are "
                        "refused unless allowed here.")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAMES",
                   help="Answer only requests whose Host header names one of these (comma "
                        "separated, repeatable; '*.example.com' matches its subdomains, '*' "
                        "any name). Default: with a loopback --host, only localhost names and "
                        "that address, which closes DNS rebinding; otherwise no check.")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)
    p.add_argument("--allowed-image-domains", action="append", default=None, metavar="HOSTS",
                   help="Vision models: fetch http(s) image URLs from these hosts (comma "
                        "separated, repeatable; '*' = any public host). Default: image URLs "
                        "are refused; base64 data URLs always work.")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024,
                   help="Largest image file a vision request may send or fetch.")
    p.add_argument("--max-realtime-sessions", type=int, default=4,
                   help="Concurrent realtime video WebSocket sessions.")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="Format of the model's tool calls (default: detected from the chat "
                        "template; hermes when the template does not render tools).")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="Split <think>...</think> out of chat answers into reasoning_content.")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="On SIGTERM / SIGINT: stop accepting connections, let in-flight "
                        "requests and video jobs finish for this long, then cancel the rest.")
    p.add_argument("--no-llm", action="store_true", help="Do not start an LLM runtime.")
    p.add_argument("--no-diffusion", action="store_true",
                   help="Do not start the diffusion runtime.")
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS)
    _add_llm_args(p)
    _add_diffusion_args(p)
    data_parallel.add_arguments(p)


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="Run one request without a server.",
                       description="Text for an LLM prompt; an image or video (written to "
                                   "--output) when a diffusion model or --task is given.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true",
                   help="LLM: send the prompt as-is instead of as a chat user message.")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--model", default=None,
                   help="Diffusion model: a name `genserve models` lists, a diffusers folder or "
                        "a hub id (implies a diffusion request).")
    p.add_argument("--task", default=None,
                   choices=(diffusion_options.TEXT_TO_IMAGE, diffusion_options.TEXT_TO_VIDEO),
                   help="Diffusion task (implies a diffusion model).")
    p.add_argument("--n", type=int, default=1, help="Diffusion: number of outputs.")
    p.add_argument("--output", default=None, help="Image / video output file.")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None)
    p.add_argument("--fps", type=int, default=None)
    p.add_argument("--num-inference-steps", type=int, default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS)
    _add_llm_args(p)
    _add_diffusion_args(p)


def _models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="List the servable model names, or materialize one.",
                       description="Without a subcommand: every name `serve` and `generate` "
                                   "accept, with its runtime, task and source, and whether it "
                                   "is served by default.")
    models_sub = p.add_subparsers(dest="models_command")
    models_sub.add_parser("list", help="List the servable names (the default).")
    path = models_sub.add_parser(
        "path", help="Print the folder of a named model, materializing an embedded one.",
        description="Prints a folder that stock transformers / diffusers load with "
                    "from_pretrained: an embedded diffusion model is built and saved under "
                    "$GENSERVE_CACHE_DIR/models (once), the embedded GGUF converted.")
    path.add_argument("name", metavar="NAME")


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="Run a benchmark.")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    from genserve.bench import http_vs_offline, serving

    serving.add_arguments(bench_sub.add_parser(
        "serving", help="Load-test a running server (genserve, SGLang, llama.cpp, vLLM...)."))
    http_vs_offline.add_arguments(bench_sub.add_parser(
        "http-vs-offline", help="Throughput kept by the HTTP path vs the offline Engine."))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genserve", description="One server for generative "
                                     "models: LLM chat and diffusion image/video generation.")
    parser.add_argument("--version", action="version", version=f"genserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    _models_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    tokens = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(tokens)
    try:
        if args.command == "serve" and args.dp > 1:
            serve_flags = tokens[tokens.index("serve") + 1:]
            return data_parallel.run_data_parallel(args, serve_flags)
        if args.command == "serve":
            from genserve.entrypoints.serve import run_serve

            return run_serve(args)
        if args.command == "generate":
            from genserve.entrypoints.offline import run_generate

            return run_generate(args)
        if args.command == "models":
            from genserve.entrypoints.model_catalog import run_models

            return run_models(args)
        if args.bench_command == "http-vs-offline":
            from genserve.bench.http_vs_offline import run_from_args as run_comparison
            from genserve.entrypoints.app import create_app
            from genserve.entrypoints.config import GatewayConfig

            return run_comparison(args, lambda engine: create_app(GatewayConfig(), [engine]))
        from genserve.bench.serving import run_from_args

        return run_from_args(args)
    except ValueError as exc:  # bad flag values: one clear line, no traceback
        print(f"genserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
