"""CLI parsing and the flag -> config mapping (the runtimes themselves are not started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from genserve.entrypoints.cli import build_parser, main
from genserve.entrypoints.serve import (
    _wanted,
    default_llm_paths,
    engine_args_from,
    gateway_config_from,
    llm_engine_args,
)


def test_serve_defaults_and_mapping():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    assert _wanted(args) == (True, True)
    cfg = gateway_config_from(args)
    assert cfg.api_key is None and cfg.cors_origins == () and cfg.max_queued_requests is None
    assert cfg.max_realtime_sessions == 4
    args = build_parser().parse_args([
        "serve", "--model-path", "/m.gguf", "--max-queued-requests", "8",
        "--max-running-requests", "4", "--api-key", "k", "--disable-radix-cache",
        "--chunked-prefill-size", "512", "--dtype", "float32", "--max-total-tokens", "4096",
        "--schedule-policy", "lpm", "--cors-origin", "http://a.example"])
    assert _wanted(args) == (True, False)
    cfg = gateway_config_from(args)
    assert cfg.max_queued_requests == 12 and cfg.api_key == "k"
    assert cfg.cors_origins == ("http://a.example",)
    engine = engine_args_from(args, "/m.gguf")
    assert engine.model_path == "/m.gguf" and engine.disable_radix_cache
    assert engine.chunked_prefill_size == 512 and engine.dtype == "float32"
    assert engine.schedule_policy == "lpm"
    assert not hasattr(engine, "max_queued_requests")  # the gateway holds the queue limit
    args = build_parser().parse_args(["serve", "--diffusion-model-path", "tiny-flux"])
    assert _wanted(args) == (False, True)
    # No model named: the embedded SmolLM2 (None) and the vision-language demo model.
    assert default_llm_paths() == [None, "shapes-vl"]


def test_lora_flags_reach_the_text_model_only():
    args = build_parser().parse_args(["serve", "--lora-paths", "a=/x", "b=/y", "--lora-paths",
                                      "c=/z", "--max-loaded-loras", "2"])
    engine = llm_engine_args(args, None)
    assert engine.lora_paths == ("a=/x", "b=/y", "c=/z") and engine.max_loaded_loras == 2
    # The default vision-language model serves beside it without adapters.
    assert llm_engine_args(args, "shapes-vl").lora_paths == ()
    args = build_parser().parse_args(["serve", "--lora-paths", "/no/name"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        engine_args_from(args, None)


def test_bad_values_are_one_line_errors(capsys):
    assert main(["serve", "--no-llm", "--no-diffusion"]) == 2
    assert "nothing to serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--schedule-policy", "random"])


def test_console_help_runs():
    result = subprocess.run([sys.executable, "-m", "genserve.entrypoints.cli", "serve",
                             "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--max-queued-requests" in result.stdout


def test_generate_routes_to_text_or_diffusion():
    from genserve.entrypoints.offline import is_diffusion_request

    parse = build_parser().parse_args
    assert not is_diffusion_request(parse(["generate", "--prompt", "hi"]))
    assert is_diffusion_request(parse(["generate", "--prompt", "a cat", "--output", "c.png"]))
    assert is_diffusion_request(parse(["generate", "--prompt", "a", "--model", "tiny-wan"]))
    assert is_diffusion_request(parse(["generate", "--prompt", "a", "--task", "text-to-video"]))
    assert main(["generate", "--prompt", "a", "--model", "tiny-flux"]) == 2  # no --output


def test_bench_subcommands_parse():
    args = build_parser().parse_args(["bench", "serving", "--dataset", "generated-shared-prefix",
                                      "--backend", "openai-chat", "--max-concurrency", "16"])
    assert (args.bench_command, args.gsp_num_groups, args.max_concurrency) == ("serving", 8, 16)
    args = build_parser().parse_args(["bench", "http-vs-offline", "--groups", "2"])
    assert (args.bench_command, args.groups, args.system_len) == ("http-vs-offline", 2, 512)


def test_max_queued_requests_turns_excess_requests_into_503():
    """`--max-running-requests 1 --max-queued-requests 1`: a gateway serving that config lets
    two requests in (one running, one waiting) and answers a third with 503 at once."""
    import asyncio

    import httpx

    from genserve.entrypoints.app import create_app
    from tests.entrypoints.conftest import start_server
    from tests.entrypoints.gateway_fakes import FakeEngine

    args = build_parser().parse_args([
        "serve", "--model-path", "/m.gguf", "--max-running-requests", "1",
        "--max-queued-requests", "1"])
    engine = FakeEngine(token_delay=0.05)
    server, thread, url = start_server(create_app(gateway_config_from(args), [engine]))
    long = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 200}}

    async def main() -> tuple[int, dict, int]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/generate", json=long) as first, \
                    client.stream("POST", "/generate", json=long) as second:
                lines = [first.aiter_lines(), second.aiter_lines()]  # kept: open streams
                for r, it in zip((first, second), lines, strict=True):
                    assert r.status_code == 200
                    assert (await it.__anext__()).startswith("data:")  # admitted, streaming
                third = await client.post("/generate", json={"text": "x"})
                body = third.json()
            while engine.running:  # the two streams closed: their slots come back
                await asyncio.sleep(0.01)
            after = await client.post("/generate", json={"text": "x"})
            return third.status_code, body, after.status_code

    try:
        status, body, after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert status == 503 and body["error"]["code"] == "queue_full", body
    assert after == 200


def test_compile_warm_up_is_background_for_serve_and_blocking_for_generate():
    from genserve.entrypoints.offline import text_engine_args
    from genserve.entrypoints.serve import _stagger

    serve = build_parser().parse_args(["serve", "--model-path", "/m.gguf"])
    assert llm_engine_args(serve, "/m.gguf").compile_warm_up == "background"
    assert not _stagger(serve, planner=object())  # nothing waits on a background compile
    asked = build_parser().parse_args(["serve", "--model-path", "/m.gguf",
                                       "--compile-warm-up", "blocking"])
    assert llm_engine_args(asked, "/m.gguf").compile_warm_up == "blocking"
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--compile"])
    assert text_engine_args(generate).compile_warm_up == "blocking"  # one request: wait
