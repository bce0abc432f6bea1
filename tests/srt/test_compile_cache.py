"""The compile cache: a second start of a compiled model loads the first one's artifacts.

Each start runs in its own process (as a restart does) with torch's own cache folder fresh, so
the second start can only hit through genserve's stored artifacts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from genserve.srt.compile_cache import compile_cache_key, compile_cache_root
from genserve.srt.model_runner import has_cpp_compiler

START = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from genserve import Engine
engine = Engine(sys.argv[1], dtype="float32", max_total_tokens=2048, compile=True)
out = engine.generate(input_ids=[1, 2, 3, 4, 5],
                      sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 6})
print("RESULT " + json.dumps({"report": engine.server_info()["compile_report"],
                              "output_ids": out["output_ids"]}), flush=True)
engine.shutdown()
"""


def _start(folder: Path, cache: Path, torch_cache: Path) -> tuple[dict, str]:
    env = {**os.environ, "GENSERVE_COMPILE_CACHE_DIR": str(cache),
           "TORCHINDUCTOR_CACHE_DIR": str(torch_cache), "GENSERVE_COMPILE_CACHE": "1"}
    proc = subprocess.run([sys.executable, "-c", START, str(folder)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stderr


@pytest.mark.slow
def test_second_start_loads_the_compiled_artifacts(tiny_model_factory, tmp_path):
    if not has_cpp_compiler():
        pytest.skip("compiling on CPU needs a C++ compiler")
    folder = tiny_model_factory("llama")
    cache = tmp_path / "genserve-compile"
    first, first_log = _start(folder, cache, tmp_path / "torch-1")
    assert first["report"]["cache_hit"] is False and first["report"]["cache_loaded"] is False
    assert "compile cache miss" in first_log, first_log[-2000:]
    [artifacts] = list(cache.glob("*/artifacts.bin"))
    assert artifacts.stat().st_size > 0

    second, second_log = _start(folder, cache, tmp_path / "torch-2")
    assert second["report"]["cache_loaded"] is True and second["report"]["cache_hit"] is True
    assert f"compile cache hit, {artifacts}" in second_log, second_log[-2000:]
    assert second["output_ids"] == first["output_ids"]  # the loaded graph computes the same
    print(f"compile: first {first['report']['seconds']:.1f} s, "
          f"second {second['report']['seconds']:.1f} s")


def test_cache_key_changes_with_what_the_graph_depends_on(tiny_model_factory, monkeypatch):
    import torch

    folder = tiny_model_factory("llama")
    base = {"quantization": "int8wo", "dtype": "torch.float32", "max_total_tokens": 2048}
    key = compile_cache_key(folder, base)
    assert key == compile_cache_key(folder, dict(base))
    assert key != compile_cache_key(folder, {**base, "quantization": "int4wo"})
    assert key != compile_cache_key(folder, {**base, "max_total_tokens": 4096})
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert key != compile_cache_key(folder, base)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GENSERVE_CACHE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("GENSERVE_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.delenv("GENSERVE_COMPILE_CACHE", raising=False)
    assert compile_cache_root() == tmp_path / "base" / "compile"
    monkeypatch.setenv("GENSERVE_COMPILE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert compile_cache_root() == tmp_path / "elsewhere"
    monkeypatch.setenv("GENSERVE_COMPILE_CACHE", "0")
    assert compile_cache_root() is None


def test_automatic_pool_size_is_stable_across_small_memory_changes(tiny_model_factory,
                                                                   monkeypatch):
    """The KV pool's size is a static shape of the compiled graph: a start with a little more
    or less free memory must get the same pool (and so the cached graph)."""
    from types import SimpleNamespace

    from genserve import Engine
    from genserve.srt import kv_pool_sizing

    sizes = []
    for available in (1.00e8, 1.01e8, 0.99e8):
        monkeypatch.setattr(kv_pool_sizing.psutil, "virtual_memory",
                            lambda a=available: SimpleNamespace(available=int(a)))
        engine = Engine(str(tiny_model_factory("llama")), dtype="float32")
        sizes.append(engine.runtime.runner.max_total_tokens)
        engine.shutdown()
    assert sizes[0] == sizes[1] == sizes[2], sizes
    assert sizes[0] & (sizes[0] - 1) == 0 and 256 < sizes[0] < 1 << 20, sizes  # not a bound
