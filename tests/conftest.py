import os
import shutil

import pytest

# Triton kernels run on this CPU only through Triton's interpreter, which must be chosen before
# any kernel module is imported. With a GPU the real compiler is used.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from genserve import envs  # noqa: E402

# Session fixtures that start a server, an engine or a worker: the modules using one run in
# the same pytest-xdist worker (see `pytest_collection_modifyitems`), so each starts once.
SHARED_RUNTIMES = ("shared_real_server", "smol_engine", "server_url", "engine_backend",
                   "diffusion_client", "smol_api_server", "shapes_demo_server",
                   "default_models_server", "smol_reference", "keyed_server")


def _test_threads() -> int:
    """torch threads for this test process and the servers it starts: GENSERVE_TEST_THREADS,
    else, under `pytest -n N`, the cores split between the N workers (two workers each running
    two threads on two cores slow each other many times over), else torch's default."""
    threads = envs.GENSERVE_TEST_THREADS.get()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if threads <= 0 and workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
    return threads


_THREADS = _test_threads()
if _THREADS > 0:
    # Inherited by every server and worker process the tests start.
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    os.environ["MKL_NUM_THREADS"] = str(_THREADS)


def pytest_configure(config):
    if _THREADS > 0:
        import torch

        torch.set_num_threads(_THREADS)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under `-n`, every worker starts diffusion workers, context-parallel ranks and pools
        # from its fork server, which imports its preloads once, when the first runtime of any
        # kind starts (an LLM's, often): named now, the diffusion workers' imports are in it.
        from genserve.multimodal_gen.engine_client import WORKER_PRELOAD
        from genserve.process_start import preload

        preload(*WORKER_PRELOAD)


def _xdist_groups(items) -> dict:
    """Each test's xdist group: one per set of modules tied together by a shared runtime (a
    module's tests always stay together: module fixtures start servers too). A module that sets
    `SPREAD_ACROSS_WORKERS = True` shares nothing between its tests, which then spread."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item in items:
        module = find(item.nodeid.split("::", 1)[0])
        for name in SHARED_RUNTIMES:
            if name in getattr(item, "fixturenames", ()):
                parent[find("fixture:" + name)] = module
    return {item.nodeid: item.nodeid if getattr(item.module, "SPREAD_ACROSS_WORKERS", False)
            else find(item.nodeid.split("::", 1)[0]) for item in items}


# tryfirst: pytest-xdist's worker reads the `xdist_group` marks in its own hook of the same
# name (registered after this conftest, so called before it): marks added later are ignored
# and `--dist loadgroup` spreads a module's tests, each worker starting its servers again.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    groups = _xdist_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def server_url():
    """`genserve serve` on the embedded SmolLM2 alone (16384 KV tokens, no API key), for the
    genserve.lang programs' HTTP backend and the LLM-only web UI; yields its URL. Pinned to
    int8wo weights (float32 activations): the precision class `auto` serves a GGUF in, and a
    decode step reads a quarter of float32's bytes (test_quantization.py holds int8wo to the
    float32 model's answers)."""
    from tests.needs import smollm2_folder
    from tests.serve_process import serve_process

    # Only the embedded SmolLM2 (its GGUF named), not the default second LLM (shapes-vl).
    gguf = smollm2_folder() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with serve_process("--model-path", str(gguf), "--max-total-tokens", "16384",
                       "--quantization", "int8wo") as url:
        yield url


@pytest.fixture(scope="session")
def smol_reference():
    """The unquantized embedded SmolLM2 (float32, 8192 KV tokens) that quantized and default
    servings are held to: (its dtype, the prompts, its greedy continuations of them, its own
    teacher-forced scores), from tests/srt/test_quantization.py's helpers. Its engine is shut
    down first: one torch process at a time."""
    from genserve import Engine
    from tests.needs import smollm2_folder
    from tests.srt.test_quantization import (
        SMOL_NEW_TOKENS,
        greedy_continuations,
        smol_prompts,
        teacher_forced,
    )

    gguf = smollm2_folder() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    engine = Engine(str(gguf), dtype="float32", max_total_tokens=8192)
    try:
        dtype = engine.model_info()["dtype"]
        prompts = smol_prompts(engine.tokenizer)
        seqs = greedy_continuations(engine, prompts, SMOL_NEW_TOKENS)
        return dtype, prompts, seqs, teacher_forced(engine, prompts, seqs)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def shapes_demo_server():
    """`genserve serve` on the demo models: shapes-vl, shapes-image and shapes-video, with the
    runtime's own KV pool size, started once for the modules that use them this way (the
    memory plan, the Responses image tool, the web UI's chat panel); yields its URL."""
    from tests.serve_process import serve_process

    with serve_process("--model-path", "shapes-vl", "--diffusion-model-path", "shapes-image",
                       "--diffusion-model-path", "shapes-video", diffusion=True) as url:
        yield url
