"""The model registry and the weight loader: what is servable, and what a bad checkpoint says."""

from __future__ import annotations

import json

import pytest
import torch

from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import load_checkpoint, read_safetensors_header
from genserve.srt.model_runner import load_model
from genserve.srt.models.base import CausalLM, ModelKernels
from genserve.srt.models.registry import (
    get_model_class,
    get_processor_class,
    supported_architectures,
)

VISION_LANGUAGE = {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                   "LlavaForConditionalGeneration"}
VISION_LANGUAGE |= {"Qwen3VLForConditionalGeneration", "Gemma3ForConditionalGeneration"}
VISION_LANGUAGE |= {"Qwen3VLMoeForConditionalGeneration"}


def test_every_registered_architecture_is_a_causal_lm():
    """Every family is a CausalLM (one load path); vision-language models also encode images
    and name their processor, text families name none."""
    from genserve.srt.models.vlm_base import VisionLanguageModel
    from genserve.srt.multimodal.processors.base import VisionProcessor

    archs = supported_architectures()
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(archs)
    assert VISION_LANGUAGE <= set(archs)
    for arch in archs:
        cls = get_model_class(arch)
        assert issubclass(cls, CausalLM), arch
        processor = get_processor_class({"architectures": [arch]})
        if arch in VISION_LANGUAGE:
            assert issubclass(cls, VisionLanguageModel), arch
            assert processor is not None and issubclass(processor, VisionProcessor), arch
        else:
            assert processor is None, arch


def test_unknown_architecture_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        get_model_class("BertModel")


def test_model_type_names_the_family_without_architectures():
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    assert ModelConfig.from_dict(cfg).architecture == "Qwen2ForCausalLM"


def test_folder_without_config_or_weights_is_a_clear_error(tmp_path, tiny_model_factory):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text((tiny_model_factory("llama") / "config.json").read_text())
    cfg = ModelConfig.from_folder(tmp_path)
    with pytest.raises(ValueError, match="no .safetensors weights"):
        load_model(cfg, tmp_path, torch.device("cpu"), torch.float32, ModelKernels())


def test_weights_load_straight_into_the_target_dtype(tiny_model_factory):
    path = tiny_model_factory("llama")
    cfg = ModelConfig.from_folder(path)
    model = load_model(cfg, path, torch.device("cpu"), torch.bfloat16, ModelKernels())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    from safetensors.torch import load_file

    ref = load_file(str(path / "model.safetensors"))
    # Stacked shards land in their slices of the fused weights.
    q = ref["model.layers.1.self_attn.q_proj.weight"]
    v = ref["model.layers.1.self_attn.v_proj.weight"]
    qkv = model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.to(torch.bfloat16))
    assert torch.equal(qkv[-v.shape[0] :], v.to(torch.bfloat16))
    up = ref["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight[up.shape[0] :], up.bfloat16())


def test_a_checkpoint_missing_a_tensor_is_refused(tmp_path, tiny_model_factory):
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    cfg = ModelConfig.from_folder(tmp_path)
    with pytest.raises(ValueError, match=r"missing weights.*qkv_proj.weight\[k\]"):
        load_model(cfg, tmp_path, torch.device("cpu"), torch.float32, ModelKernels())


def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path, tiny_model_factory):
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    cfg_dict = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg_dict))
    cfg = ModelConfig.from_folder(tmp_path)
    model_cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = model_cls(cfg, ModelKernels())
    model = model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"norm.weight: checkpoint shape \(3,\)"):
        load_checkpoint(model, tmp_path)


def test_safetensors_header_is_read_without_the_data(tiny_model_factory):
    path = tiny_model_factory("llama") / "model.safetensors"
    entries = read_safetensors_header(path)
    assert {e.name for e in entries} >= {"model.embed_tokens.weight", "model.norm.weight"}
    assert all(e.start + e.nbytes <= path.stat().st_size for e in entries)


def test_readme_lists_every_registered_architecture():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme.split("## Supported LLM architectures", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert listed == set(supported_architectures())


def test_only_headless_decoders_count_as_bare():
    """A VLM whose class is shared with another architecture is not an embedder."""
    from genserve.srt.models.registry import is_bare_decoder

    assert is_bare_decoder("Qwen3Model") and is_bare_decoder("LlamaModel")
    assert not is_bare_decoder("Qwen2_5_VLForConditionalGeneration")
    assert not is_bare_decoder("Qwen2ForCausalLM")
