"""Run a script of benchmarks/ with `--smoke` as a user would (its own process, one torch thread,
a time limit) and read the JSON summary it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: str, *args: str, timeout: float = 300.0) -> str:
    """The stdout of `python benchmarks/<script>.py --smoke <args>`; fails the test with the end
    of its output when it exits non-zero or runs past `timeout` seconds."""
    import pytest

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # The output goes to files: a child server that inherits a pipe nobody reads can block.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"),
                                   "--smoke", *args], stdout=out, stderr=err, env=env,
                                  cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            err.seek(0)
            pytest.fail(f"{script} --smoke ran past {timeout} s:\n{err.read()[-3000:]}")
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        pytest.fail(f"{script} --smoke exited with {proc.returncode}:\n{stdout[-2000:]}\n"
                    f"{stderr[-3000:]}")
    return stdout


def last_json(stdout: str) -> Any:
    """The last JSON object the script printed: one line, or several starting with a line "{"."""
    lines = stdout.rstrip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        if lines[k].startswith("{"):
            try:
                return json.loads("\n".join(lines[k:]))
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"no JSON summary at the end of:\n{stdout[-2000:]}")


def has_keys(row: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in row]
    assert not missing, f"missing {missing} in {sorted(row)}"
