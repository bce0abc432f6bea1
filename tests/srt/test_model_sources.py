"""Model sources: a hub id from the local HF cache, GGUF files checked before conversion and
dequantized into the serving dtype, generation_config.json defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import (
    check_gguf,
    embedded_gguf_path,
    gguf_precision_class,
    resolve_model_folder,
)


def _fake_hub_cache(cache: Path, repo_id: str, src: Path) -> Path:
    """Lay out `src` the way huggingface_hub caches a downloaded snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch, tiny_model_factory):
    import huggingface_hub.constants

    snapshot = _fake_hub_cache(tmp_path, "acme/tiny-llama", tiny_model_factory("llama"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder, name = resolve_model_folder("acme/tiny-llama")
    assert folder == snapshot and name == "acme/tiny-llama"

    from genserve import Engine

    engine = Engine("acme/tiny-llama", dtype="float32", max_total_tokens=256)
    try:
        out = engine.generate(input_ids=[[1, 5, 9]], sampling_params={"max_new_tokens": 3})
        assert len(out[0]["output_ids"]) == 3
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model_folder("acme/not-there")


def _write_gguf(
    path: Path, arch: str, block_count: int, layers: int, width: int = 8, meta_width: int = 8
) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(block_count)
    w.add_embedding_length(meta_width)
    w.add_tensor("token_embd.weight", np.zeros((16, width), dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(width, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_of_an_unsupported_architecture_is_refused_before_conversion(tmp_path, monkeypatch):
    from genserve import envs

    monkeypatch.setenv(envs.GENSERVE_CACHE_DIR.name, str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "m.gguf", "gpt2", 1, 1)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(GGUF\).*Llama"):
        resolve_model_folder(path)
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (tmp_path / "cache" / "gguf").iterdir()
    )


def test_gguf_whose_tensors_do_not_match_its_metadata_is_refused(tmp_path):
    with pytest.raises(ValueError, match="metadata says 3 layers.*does not match"):
        check_gguf(_write_gguf(tmp_path / "a.gguf", "llama", 3, 2))
    with pytest.raises(ValueError, match="embedding_length 16 does not match"):
        check_gguf(_write_gguf(tmp_path / "b.gguf", "llama", 2, 2, width=8, meta_width=16))
    assert check_gguf(_write_gguf(tmp_path / "c.gguf", "llama", 2, 2)) == "LlamaForCausalLM"


def test_embedded_gguf_is_dequantized_into_the_serving_dtype(tmp_path, monkeypatch,
                                                              smollm_folder):
    """A bfloat16 serving of the embedded GGUF gets bfloat16 weights; with its float32
    conversion already there (every float32 serving makes it), they are that one rounded, not
    a second parse of the GGUF."""
    from genserve import envs

    monkeypatch.setenv(envs.GENSERVE_CACHE_DIR.name, str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / smollm_folder.name).symlink_to(smollm_folder)
    from genserve.srt import model_loader

    def no_parse(path):
        raise AssertionError(f"{path} was parsed again")

    monkeypatch.setattr(model_loader, "check_gguf", no_parse)
    folder, _ = resolve_model_folder(None, dtype="bfloat16")
    monkeypatch.undo()
    assert "bfloat16" in folder.name and folder.parent == tmp_path / "gguf"
    with safe_open(str(folder / "model.safetensors"), "pt") as f, \
            safe_open(str(smollm_folder / "model.safetensors"), "pt") as full:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert set(f.keys()) == set(full.keys())
        for name in list(f.keys())[:8]:
            assert f.get_tensor(name).equal(full.get_tensor(name).to(torch.bfloat16)), name
    size = (folder / "model.safetensors").stat().st_size
    assert size < 300 * 2**20  # 135M parameters in 2 bytes each, not 4
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (folder / "tokenizer.json").is_file()
    assert check_gguf(embedded_gguf_path()) == "LlamaForCausalLM"


def _write_matrices_gguf(path: Path, qtype) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_precision_is_parsed_once_per_file_version(tmp_path, monkeypatch):
    import gguf

    from genserve import envs

    monkeypatch.setenv(envs.GENSERVE_CACHE_DIR.name, str(tmp_path / "cache"))
    path = _write_matrices_gguf(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert gguf_precision_class(path) == "int8"

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    with monkeypatch.context() as m:  # a second engine start reads the cached answer
        m.setattr(gguf, "GGUFReader", no_parsing)
        assert gguf_precision_class(path) == "int8"
    # A new version of the file (other size and mtime) is parsed afresh.
    _write_matrices_gguf(path, gguf.GGMLQuantizationType.F32)
    assert gguf_precision_class(path) is None


def test_generation_config_sets_eos_ids_and_sampling_defaults(tmp_path, tiny_model_factory):
    src = tiny_model_factory("llama")
    shutil.copytree(src, tmp_path / "m")
    gen = {"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(gen))
    cfg = ModelConfig.from_folder(tmp_path / "m")
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.generation_defaults == {"temperature": 0.6, "top_p": 0.9}

    from genserve.srt.sampling.sampling_params import SamplingParams

    p = SamplingParams.from_dict({"top_p": 0.5}, cfg.generation_defaults)
    assert (p.temperature, p.top_p) == (0.6, 0.5)
    assert (
        SamplingParams.from_dict({"temperature": None}, cfg.generation_defaults).temperature == 0.6
    )
