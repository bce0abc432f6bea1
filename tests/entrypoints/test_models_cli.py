"""`genserve models`: every servable name of both named-model tables, and `models path NAME`,
whose folder stock transformers / diffusers load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from genserve.multimodal_gen.named_models import DIFFUSION_MODELS
from genserve.srt.named_models import LLM_MODELS, default_model_paths
from tests.needs import smollm2_folder


def _models(*argv: str, cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache_dir is not None:
        env["GENSERVE_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "genserve.entrypoints.cli", "models", *argv],
                          capture_output=True, text=True, timeout=600, env=env)


def test_models_lists_every_row_with_its_runtime_task_and_source():
    result = _models()
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["NAME", "RUNTIME", "TASK", "SOURCE", "DEFAULT", "ABOUT"]
    rows = [*LLM_MODELS.rows, *DIFFUSION_MODELS.rows]
    assert [line.split()[0] for line in lines] == [row.name for row in rows]
    for row, line in zip(rows, lines):
        assert line.split()[1] == row.runtime and f"  {row.task}  " in line
        assert ("  yes  " in line) == row.default, line
    by_name = dict(zip([row.name for row in rows], lines))
    assert "  gguf  " in by_name["SmolLM2-135M-Instruct"]
    assert "  package weights folder  " in by_name["shapes-vl"]
    assert "  embedded builder  " in by_name["tiny-flux"]
    assert "vision chat" in by_name["shapes-vl"] and "image-edit" in by_name["tiny-flux-kontext"]
    assert _models("list").stdout == result.stdout


def test_listing_imports_no_torch():
    code = ("import sys; from genserve.entrypoints.cli import main; main(['models']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_default_llms_come_from_the_table():
    assert default_model_paths() == [None, "shapes-vl"]  # None: the embedded SmolLM2
    assert default_model_paths(2) == [None]  # tensor parallelism does not split shapes-vl
    assert not LLM_MODELS["shapes-vl"].quantizable


def test_unknown_name_exits_2_and_lists_the_names():
    result = _models("path", "no-such-model")
    assert result.returncode == 2
    assert "unknown model name 'no-such-model'" in result.stderr
    assert "tiny-flux" in result.stderr and "shapes-vl" in result.stderr
    assert result.stdout == ""


def test_embedded_diffusion_model_loads_in_stock_diffusers(tmp_path):
    import diffusers
    import torch

    from genserve.multimodal_gen.embedded import build_embedded

    result = _models("path", "tiny-sd", cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder == tmp_path / "models" / "tiny-sd" and (folder / "model_index.json").is_file()
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    assert type(pipe) is diffusers.StableDiffusionPipeline
    # The weights genserve serves under the name (seed 0).
    served = build_embedded("tiny-sd", shared=False).unet.state_dict()
    for key, value in pipe.unet.state_dict().items():
        assert torch.equal(value, served[key]), key
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red cat", num_inference_steps=1, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    # A second call reuses the saved folder.
    stamp = (folder / "model_index.json").stat().st_mtime_ns
    again = _models("path", "tiny-sd", cache_dir=tmp_path)
    assert Path(again.stdout.strip()) == folder
    assert (folder / "model_index.json").stat().st_mtime_ns == stamp


def test_shipped_vision_language_model_loads_in_stock_transformers():
    import transformers

    from genserve.demo_models.vl_model import WEIGHTS_PATH

    result = _models("path", "shapes-vl")
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder == WEIGHTS_PATH
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == "llava"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("a red circle")["input_ids"]) == "a red circle"


def test_embedded_gguf_is_its_converted_folder():
    import transformers

    smollm2_folder()
    result = _models("path", "SmolLM2-135M-Instruct")
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert transformers.AutoConfig.from_pretrained(folder).model_type == "llama"
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token
