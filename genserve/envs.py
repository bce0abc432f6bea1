"""Every environment variable genserve reads, declared once and typed.

`os.environ` is read nowhere else in the package. Access a value with `envs.NAME.get()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Var:
    name: str
    default: str
    doc: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)


class _Str(_Var):
    def get(self) -> str:
        return self.raw()


class _Int(_Var):
    def get(self) -> int:
        value = self.raw()
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{self.name} must be an integer, got {value!r}") from None


class _Bool(_Var):
    def get(self) -> bool:
        return self.raw().strip().lower() in ("1", "true", "yes", "on")


class _Path(_Var):
    def get(self) -> Path:
        return Path(os.path.expanduser(self.raw()))


GENSERVE_CACHE_DIR = _Path(
    "GENSERVE_CACHE_DIR",
    "~/.cache/genserve",
    "Where converted weights (GGUF -> safetensors) and other derived files are cached.",
)
GENSERVE_COMPILE_CACHE = _Bool(
    "GENSERVE_COMPILE_CACHE",
    "1",
    "Keep the compiled decode step's artifacts between starts (0 compiles afresh every start).",
)
GENSERVE_COMPILE_CACHE_DIR = _Str(
    "GENSERVE_COMPILE_CACHE_DIR",
    "",
    "Where the compiled decode step's artifacts are kept, one folder per model, quantization "
    "mode and torch version (empty: $GENSERVE_CACHE_DIR/compile).",
)
GENSERVE_LOG_LEVEL = _Str("GENSERVE_LOG_LEVEL", "info", "Logging level of every process.")
GENSERVE_NUM_THREADS = _Int(
    "GENSERVE_NUM_THREADS", "0", "torch intra-op threads in worker processes (0 = torch default)."
)
GENSERVE_TEST_THREADS = _Int(
    "GENSERVE_TEST_THREADS", "0", "torch threads used by the test suite (0 = torch default)."
)
CI = _Bool(
    "CI",
    "0",
    "Set by CI systems: the test suite fails, instead of skipping, when something CI installs "
    "(Chromium, the embedded LLM package) is missing.",
)
GENSERVE_OUTPUT_DIR = _Path(
    "GENSERVE_OUTPUT_DIR",
    "~/.cache/genserve/outputs",
    "Where generated images and videos are stored for the /content endpoints.",
)
GENSERVE_ALLOW_HUB_DOWNLOAD = _Bool(
    "GENSERVE_ALLOW_HUB_DOWNLOAD",
    "1",
    "Resolve Hugging Face hub ids when the machine has internet.",
)
GENSERVE_MALLOC_TUNING = _Bool(
    "GENSERVE_MALLOC_TUNING",
    "1",
    "Diffusion processes keep tensor-sized blocks in glibc's heap instead of mmap (fewer page "
    "faults); 0 leaves glibc's defaults.",
)
GENSERVE_SPEC_COMPILED_VERIFY = _Bool(
    "GENSERVE_SPEC_COMPILED_VERIFY",
    "0",
    "Under --compile, a lone request's speculative verify runs through the compiled decode "
    "step as decode rows (genserve/srt/speculative/verify_rows.py); off by default because "
    "each new row count compiles on first use.",
)
GENSERVE_PROCESS_START = _Str(
    "GENSERVE_PROCESS_START",
    "auto",
    "How runtime processes start (genserve/process_start.py): auto (a fork server that imports "
    "torch once, where the platform has one), forkserver, or spawn (a fresh interpreter each).",
)
