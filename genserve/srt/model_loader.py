"""Find a model's files (HF folder, .gguf file, or the embedded default) and load its weights.

A GGUF file is checked against the registry and its own metadata, then dequantized once through
transformers' GGUF support into the serving dtype and cached as a regular HF folder (config +
safetensors + tokenizer) under GENSERVE_CACHE_DIR, so later starts take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from genserve import envs
from genserve.named_models import source_path
from genserve.srt.models.registry import (
    architecture_for_model_type,
    supported_architectures,
    unsupported_message,
)
from genserve.srt.named_models import EMBEDDED, row_for_path

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from genserve.srt.models.base import CausalLM, WeightLoader

logger = logging.getLogger(__name__)

def embedded_gguf_path() -> Path:
    """The GGUF of the embedded default (`named_models.EMBEDDED`), located in its package
    without importing it."""
    try:
        return source_path(EMBEDDED)
    except ValueError as e:
        raise ValueError(f"the embedded default model {EMBEDDED.name}: {e}, or pass "
                         "--model-path") from None


def resolve_model_folder(
    model_path: str | os.PathLike | None, dtype: str = "auto", device: str = "auto"
) -> tuple[Path, str]:
    """Return (HF folder with config.json + safetensors + tokenizer, display name).

    `model_path` is a local folder, a `.gguf` file (or a folder holding exactly one), a name
    of `named_models` (such as the demo model `shapes-vl`), a Hugging Face hub id (from the
    local HF cache, downloaded when missing and a network is there), or None for the embedded
    default. `dtype` / `device` are the serving ones: a GGUF is dequantized into that dtype.
    """
    row = row_for_path(None if model_path is None else str(model_path))
    if row is not None and row.kind == "gguf":
        gguf = embedded_gguf_path() if row is EMBEDDED else source_path(row)
        return _gguf_to_folder(gguf, _gguf_dtype(dtype, device)), row.name
    path = source_path(row) if row is not None else Path(str(model_path)).expanduser()
    if not path.exists():
        if _looks_like_hub_id(str(model_path)):
            return resolve_hub_id(str(model_path)), str(model_path)
        raise ValueError(
            f"model path {str(path)!r} does not exist (expected a model folder, a .gguf file "
            "or a Hugging Face hub id like org/name)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf or an HF folder")
        return _gguf_to_folder(path, _gguf_dtype(dtype, device)), path.stem
    if (path / "config.json").is_file():
        return path, path.name
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_to_folder(ggufs[0], _gguf_dtype(dtype, device)), ggufs[0].stem
    raise ValueError(
        f"{path} has no config.json (and not exactly one .gguf file); expected a Hugging Face "
        f"model folder (config.json + *.safetensors + tokenizer) of one of: "
        f"{', '.join(supported_architectures())}"
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_hub_id(repo_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The snapshot folder of a hub model: from the local HF cache without any network access,
    else downloaded (huggingface_hub shows a progress bar)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, cache_dir=cache_dir, local_files_only=True, allow_patterns=_HUB_FILES
        )
    except LocalEntryNotFoundError:
        logger.info("%s is not in the local Hugging Face cache: downloading it", repo_id)
        try:
            folder = snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=_HUB_FILES)
        except Exception as e:  # offline, unknown repo, gated: all end the start-up here
            raise ValueError(
                f"{repo_id!r} is not a local path, not in the local Hugging Face cache, and "
                f"could not be downloaded ({type(e).__name__}: {e})"
            ) from None
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"the cached snapshot of {repo_id!r} at {folder} has no config.json")
    return Path(folder)


def _gguf_dtype(dtype: str, device: str) -> torch.dtype:
    """The dtype a GGUF is dequantized into: the one the model will run in (bfloat16 or
    float16; float32 only where the CPU has no bf16 math, as `resolve_dtype` decides)."""
    from genserve.srt.device import resolve_device, resolve_dtype

    return resolve_dtype(dtype, resolve_device(device))


# llama.cpp's architecture names that differ from the HF model_type.
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}


def check_gguf(gguf: Path) -> str:
    """Read a GGUF's metadata (no tensor data) and return the registered architecture it holds.

    Refuses an architecture genserve does not serve, and tensors that disagree with the
    metadata (layer count, embedding width), before anything is converted.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except Exception as e:
        raise ValueError(f"{gguf} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture") or "?"
    name = (field("general.name") or "").lower()
    model_type = _GGUF_MODEL_TYPES.get(arch, arch)
    if arch == "llama" and "mistral" in name:
        model_type = "mistral"
    hf_arch = architecture_for_model_type(model_type)
    if hf_arch is None:
        raise ValueError(f"{gguf.name}: " + unsupported_message(f"{arch!r} (GGUF)"))
    blocks = field(f"{arch}.block_count")
    width = field(f"{arch}.embedding_length")
    names = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    layers = {int(n.split(".")[1]) for n in names if n.startswith("blk.")}
    if blocks is None or layers != set(range(int(blocks))):
        raise ValueError(
            f"{gguf.name}: metadata says {blocks} layers but the file has tensors for layers "
            f"{sorted(layers)[:4]}...{sorted(layers)[-2:] if layers else ''} "
            f"({len(layers)} layers): the file does not match its metadata"
        )
    embd = names.get("token_embd.weight")
    if embd is None or width is None or int(width) != embd[0]:
        raise ValueError(
            f"{gguf.name}: metadata embedding_length {width} does not match token_embd.weight "
            f"{embd}: the file does not match its metadata"
        )
    return hf_arch


# GGML tensor types by the weight-only precision that keeps their information.
_GGUF_INT8_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K", "Q6_K"})
_GGUF_FULL_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def gguf_path_of(model_path: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model path names (None for the embedded default's), or None when the
    path is not a GGUF."""
    row = row_for_path(None if model_path is None else str(model_path))
    if row is not None:
        if row.kind != "gguf":
            return None
        return embedded_gguf_path() if row is EMBEDDED else source_path(row)
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def gguf_precision_class(gguf: Path) -> str | None:
    """Returns "int4" / "int8" when most of a GGUF's layer matrices are stored in 2-6 / 8 bits, None
    when they are full precision (F16 / BF16 / F32). Reads metadata only, once per file: the
    answer is kept in the cache next to the converted folders (parsing the metadata means
    parsing the whole vocabulary, seconds for every engine start otherwise)."""
    cached = _gguf_cache_dir() / f"{gguf.stem}-{_gguf_key(gguf)}.precision.json"
    try:
        return json.loads(cached.read_text())["precision"]
    except (OSError, ValueError, KeyError):
        pass
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(gguf)).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    precision = None
    if counts:
        dominant = max(counts, key=lambda k: counts[k])
        if dominant not in _GGUF_FULL_TYPES:
            precision = "int8" if dominant in _GGUF_INT8_TYPES else "int4"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"precision": precision}))
        tmp.replace(cached)  # atomic: a concurrent start reads the old file or the new one
    except OSError as e:  # a read-only cache only costs the parse next time
        logger.debug("could not cache the precision of %s: %s", gguf, e)
    return precision


def _gguf_cache_dir() -> Path:
    return envs.GENSERVE_CACHE_DIR.get() / "gguf"


def _gguf_key(gguf: Path) -> str:
    """Identifies one version of a GGUF file (path, size, modification time)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return key.hexdigest()[:16]


def _gguf_to_folder(gguf: Path, dtype: torch.dtype) -> Path:
    """Dequantize a GGUF once into `dtype` and cache it as an HF folder."""
    dtype_name = str(dtype).removeprefix("torch.")
    folder = _gguf_cache_dir() / f"{gguf.stem}-{dtype_name}-{_gguf_key(gguf)}"
    if (folder / "config.json").is_file():
        return folder
    full = folder.with_name(f"{gguf.stem}-float32-{_gguf_key(gguf)}")
    if dtype in (torch.bfloat16, torch.float16) and (full / "config.json").is_file():
        return _cast_converted(full, folder, dtype)
    arch = check_gguf(gguf)
    logger.info(
        "converting %s to %s safetensors (first start only) into %s", gguf.name, dtype_name, folder
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _filled_then_named(folder) as tmp:
        try:
            # transformers shows a progress bar while it dequantizes the tensors.
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=dtype
            )
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"{gguf.name} could not be converted: {e}") from None
        # save_pretrained refuses GGUF-quantized models; the dequantized tensors are plain.
        state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [arch]
        cfg["torch_dtype"] = dtype_name
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model, state
    return folder


@contextlib.contextmanager
def _filled_then_named(folder: Path) -> Iterator[Path]:
    """A temporary folder beside `folder` for the block to fill; renamed to `folder` when the
    block ends without an error (kept as it is when another process made it meanwhile),
    removed in every case."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        yield tmp
        try:
            tmp.rename(folder)
        except OSError:  # another process made it meanwhile
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cast_converted(full: Path, folder: Path, dtype: torch.dtype) -> Path:
    """A GGUF already dequantized into float32, rounded into `dtype`: the tensors a conversion
    from the GGUF would write (it dequantizes in float32 and rounds the same way), without
    parsing the GGUF again."""
    logger.info("casting %s into %s", full.name, folder.name)
    with _filled_then_named(folder) as tmp:
        for src in full.iterdir():
            if src.name != "model.safetensors":
                shutil.copy2(src, tmp / src.name)
        state = load_file(str(full / "model.safetensors"))
        save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no .safetensors weights (.bin checkpoints are not read); "
            "expected config.json + *.safetensors + tokenizer files"
        )
    return files


def read_safetensors_header(path: Path) -> list[TensorEntry]:
    """The tensors of one .safetensors file, in file order, without reading their data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        size = int.from_bytes(head, "little")
        if size > 100 * 2**20 or size > path.stat().st_size:
            raise ValueError(f"{path} is not a safetensors file (bad header length)")
        header = json.loads(f.read(size))
    base = 8 + size
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries.append(TensorEntry(name, dtype, tuple(info["shape"]), base + begin, end - begin))
    return sorted(entries, key=lambda e: e.start)


def _read_exact(f: io.FileIO, start: int, out: torch.Tensor) -> None:
    """Read out.nbytes bytes at `start` straight into the (contiguous, CPU) tensor's memory."""
    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    f.seek(start)
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise ValueError(f"{f.name}: file ends inside a tensor (truncated checkpoint?)")
        done += n


def load_checkpoint(model: CausalLM, folder: Path,
                    on_linear_loaded: Callable[[str], None] | None = None,
                    weight_only: str = "none") -> None:
    """Stream every safetensors tensor into the model's parameters.

    A tensor whose dtype and device already match its destination is read from the file
    directly into the parameter's memory; any other goes through one temporary of its own
    size. Plain reads (not mmap) keep the file out of this process's resident memory, so the
    peak is the model plus the largest tensor. A pre-quantized checkpoint (`quantization_config`,
    layers/prequantized/) comes in one linear layer at a time after the rest
    (`prequantized_loader`): dequantized, or under `weight_only` "int4wo" on a CPU its 4-bit
    groups repacked as stored (GPTQ, AWQ, compressed-tensors int4), under "fp8" its float8
    weights kept as stored.
    on_linear_loaded: see `CausalLM.load_checkpoint` (the model's full-precision storage is
    allocated but untouched until written, so a layer quantized as soon as it is whole keeps
    the peak near the quantized model's size).
    weight_only: the mode `on_linear_loaded` quantizes the linear layers into.
    """
    from genserve.srt.layers.prequantized import checkpoint_quantization
    from genserve.srt.layers.prequantized.fp8_keep import FP8Keep
    from genserve.srt.layers.prequantized.int4_repack import Int4Repack
    from genserve.srt.prequantized_loader import load_quantized_weights

    scheme = checkpoint_quantization(model.config.hf)
    loader = model.weight_loader(on_linear_loaded)
    files = [(path, read_safetensors_header(path)) for path in safetensors_files(folder)]
    quantized, skipped = [], set()
    if scheme is not None:
        quantized, skipped = scheme.plan(e.name for _, entries in files for e in entries)
        skipped |= {n for qw in quantized for n in qw.parts.values()}
    for path, entries in files:
        with open(path, "rb", buffering=0) as f:
            for e in entries:
                if e.name not in skipped:
                    _load_tensor(loader, f, e)
                    loader.written(e.name)
    if quantized:
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        repack = (Int4Repack(model) if weight_only == "int4wo" and on_cpu
                  and scheme.stores_int4_groups else None)
        if weight_only == "fp8":
            repack = FP8Keep(model)
        load_quantized_weights(loader, scheme, quantized, files, repack)
    loader.finish()


def _load_tensor(loader: WeightLoader, f: io.FileIO, e: TensorEntry) -> None:
    from genserve.srt.models.base import take_part

    target = loader.destination(e.name, e.shape)
    if target is None:
        return
    dst, part = target
    _check_size(f, e)
    if e.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and dst.dtype != e.dtype:
        raise ValueError(
            f"{f.name}: tensor {e.name} is {e.dtype} with no scale next to it (config.json "
            "has no quantization_config that reads it)"
        )
    with torch.no_grad():
        if (part is None and dst.dtype == e.dtype and dst.device.type == "cpu"
                and dst.is_contiguous()):
            _read_exact(f, e.start, dst)
        else:  # a tensor-parallel rank reads the whole tensor, keeps its slice
            tmp = read_tensor(f, e)
            dst.copy_(take_part(tmp, part))
            del tmp


def _check_size(f: io.FileIO, e: TensorEntry) -> None:
    elt = torch.tensor([], dtype=e.dtype).element_size()
    if e.nbytes != math.prod(e.shape) * elt:
        raise ValueError(f"{f.name}: tensor {e.name} has {e.nbytes} bytes for {e.shape}")


def read_tensor(f: io.FileIO, e: TensorEntry) -> torch.Tensor:
    _check_size(f, e)
    out = torch.empty(e.shape, dtype=e.dtype)
    _read_exact(f, e.start, out)
    return out


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in memory (tests and tools; serving streams instead)."""
    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        weights.update(load_file(str(f)))
    return weights
