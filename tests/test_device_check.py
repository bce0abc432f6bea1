"""scripts/device_check.sh: its dry run (what CI runs of it) takes every step through its imports,
arguments and a toy-size run on the CPU, and reports every step with no FAILED row; a step that
fails is a FAILED row with its error's last line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location(
        "device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def table_steps(table: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [line.split("|")[1].strip() for line in rows[1:]]  # after the header row


@pytest.mark.slow  # about 30 s on one core: seven steps' imports and toy runs
def test_the_dry_run_runs_every_step_without_a_failure(tmp_path, device_check):
    out = tmp_path / "device_check.md"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    table = out.read_text()
    log = out.with_suffix(".log").read_text()
    assert done.returncode == 0, f"{table}\n{done.stderr[-2000:]}\n{log[-4000:]}"
    assert table in done.stdout  # the table goes to stdout too
    assert set(table_steps(table)) == {s.name for s in device_check.STEPS}
    assert "| FAILED |" not in table
    assert "CUDA graphs on vs off" in table
    assert "overlap schedule on vs off" in table


def test_a_failed_step_is_a_row_with_the_errors_last_line(device_check):
    records = [{"step": "attention", "error": "RuntimeError: CUDA error: out of memory"},
               {"step": "video", "rows": [{"measured": "a | b", "figure": "3 frames/s",
                                           "note": ""}]}]
    table = device_check.markdown(records, "# t")
    assert "| attention | Triton attention vs torch SDPA | FAILED | RuntimeError: CUDA error: " \
           "out of memory |" in table
    assert "| video | a \\| b | 3 frames/s |  |" in table
    assert device_check.last_line("Traceback\n  File x\nValueError: bad\n\n") == "ValueError: bad"


def test_help_needs_no_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import device_check\n"
            "try:\n    device_check.parse_args(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.stdout.strip().endswith("False"), done.stdout + done.stderr
    assert "memory_plan" in done.stdout
