"""The compiled decode step's artifacts, kept between starts.

torch.compile of the decode step spends most of its time in AOTAutograd and Inductor (code
generation and the C++ compiler). torch keeps both stages' results in its own caches, keyed by
the graph; `torch.compiler.save_cache_artifacts()` gathers what one process compiled into bytes
and `load_cache_artifacts()` puts them back into those caches. genserve stores the bytes in one
folder per model, quantization mode, dtype, device and torch version
(`$GENSERVE_COMPILE_CACHE_DIR`, by default `$GENSERVE_CACHE_DIR/compile/<key>`), so a restart,
even on a machine whose temporary folder (torch's default cache place) was cleared, compiles
from them. Dynamo's tracing of the Python code is not cached and runs at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from genserve import envs

logger = logging.getLogger(__name__)

ARTIFACTS = "artifacts.bin"


def compile_cache_root() -> Path | None:
    """The folder holding one sub-folder per cache key, or None when the cache is off."""
    if not envs.GENSERVE_COMPILE_CACHE.get():
        return None
    custom = envs.GENSERVE_COMPILE_CACHE_DIR.get()
    if custom:
        return Path(os.path.expanduser(custom))
    return envs.GENSERVE_CACHE_DIR.get() / "compile"


def _weights_identity(folder: Path) -> list[list]:
    """Name, size and modification time of the folder's config and weight files (a changed
    checkpoint gets a new key without hashing gigabytes)."""
    files = sorted([*folder.glob("*.safetensors"), *folder.glob("*.gguf"),
                    *folder.glob("config.json")])
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def compile_cache_key(folder: Path, facts: dict) -> str:
    """A short hash of what the compiled artifacts depend on: the model's files, the facts
    given (quantization mode, dtype, device, attention backend, pool size) and torch's
    version."""
    ident = {
        "folder": str(folder.resolve()),
        "files": _weights_identity(folder),
        "torch": torch.__version__,
        **facts,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class CompileCacheReport:
    """What one start's compile found: `hit` when every graph came from a cache (torch's
    AOTAutograd and Inductor caches, filled from genserve's artifacts or left by an earlier
    process), `loaded` when genserve's artifacts were found and loaded, `path` the artifacts
    file (None with the cache off)."""

    hit: bool
    loaded: bool
    path: Path | None


class DecodeCompileCache:
    """Loads the artifacts before the warm-up compile and saves them after a miss."""

    def __init__(self, folder: Path, facts: dict) -> None:
        root = compile_cache_root()
        self.path = None if root is None else root / compile_cache_key(folder, facts) / ARTIFACTS
        self.loaded = False

    def load(self) -> None:
        """Put stored artifacts into torch's caches (call before the first compile)."""
        from torch._dynamo.utils import counters

        counters["inductor"].clear()
        counters["aot_autograd"].clear()
        if self.path is None or not self.path.is_file():
            return
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:  # a file from another torch build, or a truncated write
            logger.warning("compile cache: could not load %s (%s); compiling afresh",
                           self.path, exc)
            return
        self.loaded = info is not None

    def finish(self) -> CompileCacheReport:
        """After the warm-up compile: whether it hit, and store the artifacts on a miss."""
        from torch._dynamo.utils import counters

        ind, aot = counters["inductor"], counters["aot_autograd"]
        hit = (ind["fxgraph_cache_hit"] > 0 and ind["fxgraph_cache_miss"] == 0
               and aot["autograd_cache_miss"] == 0 and aot["autograd_cache_bypass"] == 0)
        if self.path is not None and not (hit and self.loaded):
            _save_artifacts(self.path)
        return CompileCacheReport(hit=hit, loaded=self.loaded, path=self.path)


def _save_artifacts(path: Path) -> None:
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(saved[0])
    os.replace(tmp, path)  # atomic: a concurrent start reads a whole file or none
