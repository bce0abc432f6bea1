"""`genserve serve --dp 2`: two SmolLM2 replicas behind the unmodified sglang-router.

The router serves the OpenAI API through the replicas; on a shared-prefix workload its
`cache_aware` policy hits the replicas' prefix caches more often than `round_robin`; a replica
that dies is taken out of the rotation (no request lost once the router noticed) and the
launcher restarts it. Start-up errors (port in use, no router) are one clear line."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import psutil
import pytest

from genserve.entrypoints import data_parallel
from tests.needs import missing, smollm2_folder
from tests.serve_process import free_port

smollm2_folder(module_level=True)
if not data_parallel.router_available():
    missing("sglang-router", module_level=True)


def _wait(predicate, timeout: float, what: str, state=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {state()}")


@pytest.fixture(scope="module")
def cluster():
    """`genserve serve --dp 2` (round_robin) on a free port run; yields (router url, replica
    urls, launcher process). Each replica serves SmolLM2 alone: the defaults would load the
    vision demo model into every replica too, which no test here asks."""
    port = free_port()  # with the 3 ports above it free
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--dp", "2",
         "--model-path", "SmolLM2-135M-Instruct",
         "--router-policy", "round_robin", "--port", str(port), "--dtype", "float32",
         "--num-threads", "1", "--max-total-tokens", "8192", "--no-compile",
         "--quantization", "none"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"genserve serve --dp exited: {log.read()}")
            return all(w["is_healthy"] for w in httpx.get(url + "/workers", timeout=2)
                       .json()["workers"]) and len(_workers(url)) == 2

        _wait(ready, 300, "the router and both replicas")
        yield url, replicas, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(120) == 0  # a clean drain: router first, then the replicas
        finally:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
            log.close()


def _workers(router: str) -> list[dict]:
    return httpx.get(router + "/workers", timeout=5).json()["workers"]


def test_the_openai_api_through_the_router(cluster):
    router, _, _ = cluster
    client = openai.OpenAI(base_url=router + "/v1", api_key="none")
    [model] = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct"  # the replicas' served name, read by the router
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content


_PREFIXES = [
    f"You are assistant number {k}. " + " ".join(
        f"Rule {k}.{i}: answer about topic {k * 31 + i} politely and briefly." for i in range(12))
    for k in range(4)
]


def _hit_rate(router: str) -> float:
    """Shared-prefix workload, sequential: each prefix's questions arrive two in a row, so
    round robin puts them on different replicas and each replica computes each prefix once."""
    cached = prompt = 0
    with httpx.Client(timeout=120) as http:
        for round_ in range(2):
            for k, prefix in enumerate(_PREFIXES):
                for q in range(2):
                    body = {"text": f"{prefix}\nQuestion {round_}.{q}: what is {k} + {q}?",
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                    r = http.post(router + "/generate", json=body)
                    assert r.status_code == 200, r.text
                    meta = r.json()["meta_info"]
                    cached += meta["cached_tokens"]
                    prompt += meta["prompt_tokens"]
    return cached / prompt


def _flush(replicas: list[str]) -> None:
    for url in replicas:
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(cluster):
    router, replicas, _ = cluster
    _flush(replicas)
    round_robin = _hit_rate(router)
    _flush(replicas)
    port = free_port()
    aware = subprocess.Popen(
        data_parallel.router_command("127.0.0.1", port, replicas, "cache_aware"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    aware_url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: len(_workers(aware_url)) == 2
              and all(w["is_healthy"] for w in _workers(aware_url)), 60, "cache_aware router",
              lambda: (aware.poll(), _workers(aware_url)))
        cache_aware = _hit_rate(aware_url)
    finally:
        aware.terminate()
        aware.wait(15)
    # Round robin computes every prefix on both replicas; cache-aware keeps each on one.
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)


def test_a_dead_replica_leaves_the_rotation_and_is_restarted(cluster):
    router, replicas, launcher = cluster
    victim_port = replicas[0].rsplit(":", 1)[1]
    [victim] = [p for p in psutil.Process(launcher.pid).children()
                if victim_port in p.cmdline()]
    for proc in [*victim.children(recursive=True), victim]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()

    def noticed() -> bool:
        return not next(w for w in _workers(router) if w["url"] == replicas[0])["is_healthy"]

    _wait(noticed, 60, "the router to mark the killed replica unhealthy")
    with httpx.Client(timeout=120) as http:
        for i in range(6):  # every request lands on the live replica
            r = http.post(router + "/generate", json={
                "text": f"Count to {i}:", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
    # The launcher restarts the replica (backoff 1 s) and the router takes it back.
    _wait(lambda: httpx.get(replicas[0] + "/health", timeout=2).status_code == 200, 300,
          "the replica's restart")
    _wait(lambda: not noticed(), 60, "the router to take the replica back")


def test_port_in_use_is_a_clear_start_up_error():
    port = free_port()  # with the 3 ports above it free
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 2))
        busy.listen()
        result = subprocess.run(
            [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--dp", "2",
             "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"port {port + 2}" in result.stderr and "in use" in result.stderr


def test_missing_router_and_diffusion_flags_are_clear_errors(monkeypatch):
    from genserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--dp", "2"])
    monkeypatch.setattr(data_parallel, "router_available", lambda: False)
    with pytest.raises(ValueError, match="pip install sglang-router"):
        data_parallel.DataParallelLauncher(args, [])
    args = build_parser().parse_args(["serve", "--dp", "2", "--diffusion-model-path", "x"])
    with pytest.raises(ValueError, match="--no-llm"):
        data_parallel.DataParallelLauncher(args, [])


def test_worker_flags_drop_the_scale_out_ones():
    flags = ["--dp=2", "--router-policy", "round_robin", "--port", "9000", "--host", "0.0.0.0",
             "--model-path", "m.gguf", "--register-with", "http://r", "--num-threads", "1"]
    assert data_parallel.worker_argv(flags, 9001) == [
        "--model-path", "m.gguf", "--num-threads", "1", "--host", "127.0.0.1", "--port", "9001",
        "--no-diffusion"]


def test_the_router_launcher_imports_neither_sglang_nor_torch():
    """sglang-router's own launcher imports SGLang and torch; genserve's builds the same Rust
    router from the same flags without them (the cluster above runs behind it)."""
    if not data_parallel.router_available():
        missing("sglang-router")
    probe = ("import sys\n"
             "from genserve.entrypoints.router_launch import build_router\n"
             "build_router(sys.argv[1:])\n"
             "print(sorted(m for m in ('sglang', 'torch', 'transformers') if m in sys.modules))")
    cmd = data_parallel.router_command("127.0.0.1", free_port(), ["http://127.0.0.1:1"],
                                       "round_robin")
    assert cmd[1:3] == ["-m", "genserve.entrypoints.router_launch"]
    out = subprocess.run([sys.executable, "-c", probe, *cmd[3:]], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    bad = subprocess.run([sys.executable, "-m", "genserve.entrypoints.router_launch",
                          "--mini-lb", *cmd[3:]], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Rust router only" in bad.stderr
