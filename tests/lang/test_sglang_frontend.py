"""SGLang's own frontend (`sglang.RuntimeEndpoint`, installed with --no-deps) runs programs
unchanged against a real genserve server: gen, select (input-token logprobs), fork (prefix
caching through max_new_tokens 0), regex, run_batch and streaming."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_sglang_programs_run_unchanged(server_url):
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sglang_program.py")), server_url],
        capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert "Paris" in out["complete"]
    assert out["pick"] == " Paris"
    assert out["fork_text"].count("Fact 1:") == 1 and out["fork_text"].count("Fact 2:") == 1
    assert out["fork_text"].endswith("Done.")
    assert "Paris" in out["batch"][0] and "Rome" in out["batch"][1]
    assert re.fullmatch(r" 1[0-9]{3}", out["year"]), out["year"]
    assert len(out["stream_chunks"]) > 2
    assert "".join(out["stream_chunks"]) == out["stream_text"]
