"""How a vision-language family is wired: its processor comes from the registry without torch,
and the model loads through the runner's one path, where kernels, quantization and tensor
parallelism are decided as for a text model (and refused with a clear error where a family
does not support them)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from genserve.srt.model_config import ModelConfig
from genserve.srt.model_runner import ModelRunner, choose_kernels, load_model
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.registry import get_model_class
from genserve.srt.server_args import EngineArgs
from tests.srt.vlm_models import make_tiny_llava, make_tiny_qwen2_vl

_NO_TORCH = """
import sys
from genserve.srt.models.registry import get_processor_class
from genserve.srt.multimodal.processor import VisionInputProcessor
for arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
             "LlavaForConditionalGeneration"):
    assert get_processor_class({"architectures": [arch]}) is not None, arch
assert "torch" not in sys.modules, "torch was imported"
"""


def test_processors_resolve_without_importing_torch():
    result = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_loads_through_the_common_path_in_the_serving_dtype(family, qwen2_vl, tmp_path):
    folder = qwen2_vl if family == "qwen2_vl" else make_tiny_llava(tmp_path / "llava")
    model = load_model(ModelConfig.from_folder(folder), folder, torch.device("cpu"),
                       torch.bfloat16, ModelKernels())
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.dtype for t in tensors if t.is_floating_point()} == {torch.bfloat16}
    assert not any(t.is_meta for t in tensors)


def test_m_rope_families_take_the_torch_rotary_and_refuse_triton():
    cls = get_model_class("Qwen2VLForConditionalGeneration")
    cuda = torch.device("cuda")  # the device's default kernel, without needing the device
    assert choose_kernels(EngineArgs(), cuda, cls) == ModelKernels("triton", "torch", "triton")
    with pytest.raises(ValueError, match="--rotary-kernel triton is not supported"):
        choose_kernels(EngineArgs(rotary_kernel="triton"), cuda, cls)
    llava = get_model_class("LlavaForConditionalGeneration")
    assert choose_kernels(EngineArgs(), cuda, llava).rotary == "triton"


def test_explicit_quantization_is_refused_and_auto_keeps_full_precision(qwen2_vl):
    config = ModelConfig.from_folder(qwen2_vl)
    args = EngineArgs(model_path=str(qwen2_vl), dtype="float32", max_total_tokens=256,
                      quantization="int8wo")
    with pytest.raises(ValueError, match="--quantization int8wo is not supported for Qwen2VL"):
        ModelRunner(args, config, qwen2_vl, 512)
    auto = ModelRunner(EngineArgs(model_path=str(qwen2_vl), dtype="float32",
                                  max_total_tokens=256, quantization="auto"),
                       config, qwen2_vl, 512)
    assert auto.quantization == "none"
