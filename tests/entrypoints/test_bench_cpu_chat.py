"""benchmarks/bench_cpu_chat.py's `--smoke` run: the script's output shape, never its speed.

genserve's side is the session's server on the embedded SmolLM2 GGUF (`server_url`, measured
through `--url`: no server start of its own); each peer (llama.cpp's `llama-server`,
llama-cpp-python's server) runs when installed and is otherwise skipped with its reason printed.
Every request asks for `ignore_eos`, and the tokens are read from `usage`, so genserve's and
llama.cpp's counts are exactly the requested lengths (llama-cpp-python streams no usage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import smollm2_folder

smollm2_folder(module_level=True)
_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu_chat.py"
PEERS = ("llama.cpp", "llama-cpp-python")


@pytest.mark.slow  # the shared SmolLM2 server (plus a start of each peer that is installed)
def test_smoke_run_reports_every_side_or_why_it_was_skipped(tmp_path, server_url):
    out = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(_SCRIPT.parents[1])}
    run = subprocess.run([sys.executable, str(_SCRIPT), "--smoke", "--threads", "1", "--url",
                          server_url, "--json", str(out)], capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["genserve"]["quantization"] == "int8wo"  # the session server's pin
    assert summary["genserve"]["url"] == server_url
    assert summary["rounds"] == 1 and summary["streams"] == 2 and summary["tokens"] == 4
    ran = [name for name in PEERS if name not in summary["skipped"]]
    for name in PEERS:
        if name in summary["skipped"]:
            assert f"skipping {name}: {summary['skipped'][name]}" in run.stdout
            assert "install" in summary["skipped"][name]
    assert set(summary["sides"]) == {"genserve", *ran}
    for name in summary["sides"]:
        (r,) = summary["per_round"][name]
        if name == "llama-cpp-python":  # no usage in its stream: its content chunks, counted
            assert summary["sides"][name]["tokens_counted_from"] == ["chunks"]
            assert 1 <= r["single"]["tokens"][0] <= 4 and 2 <= r["concurrent"]["tokens"] <= 8
        else:  # from usage: ignore_eos, max_tokens 4
            assert summary["sides"][name]["tokens_counted_from"] == ["usage"], name
            assert r["single"]["tokens"] == [4], name
            assert r["concurrent"]["tokens"] == 2 * 4, name
        assert r["single"]["decode_tps"] > 0 and r["concurrent"]["tps"] > 0
        assert set(r["idle_cpu_s"]) == {
            s for other in summary["sides"] if other != name for s in _servers(other)}
    assert set(summary["ratios"]) == {f"genserve_vs_{name}_{key}" for name in ran
                                      for key in ("single_decode_tps", "concurrent2_tps")}
    assert "| genserve |" in run.stdout


def _servers(side: str) -> list[str]:
    return ["llama.cpp", "llama.cpp -np 2"] if side == "llama.cpp" else [side]
