"""bench_kernels fails a case whose kernel output differs from SDPA (it used to only print it)."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(decode_err: float, extend_errs: list[float]) -> dict:
    return {
        "dtype": "bfloat16",
        "decode": {"max_abs_error_vs_sdpa": decode_err},
        "extend": [{"shape": {"prefix": p}, "max_abs_error_vs_sdpa": e}
                   for p, e in zip((0, 3072), extend_errs, strict=True)],
    }


def test_a_case_off_from_sdpa_fails_the_run(bench):
    assert bench.failed_cases(_result(1e-3, [2e-2, 4e-3])) == []
    failed = bench.failed_cases(_result(1e-3, [0.5, float("nan")]))
    assert [f.split(":")[0] for f in failed] == ["extend prefix=0", "extend prefix=3072"]


def test_the_smoke_run_passes_its_own_check(bench):
    assert bench.main(["--smoke"]) == 0
