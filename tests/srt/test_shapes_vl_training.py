"""`shapes-vl` training at toy scale: the tower tap sees exactly the patch features LLaVA
projects, the attribute read-out trains the tower, and a run resumes and exports a folder that
loads in Hugging Face transformers without the training-only heads."""

from __future__ import annotations

import random

import numpy as np
import torch

from genserve.demo_models import vl_data, vl_train, world
from genserve.demo_models.vl_model import (
    TOKENS_PER_IMAGE,
    build_image_processor,
    build_model,
    build_tokenizer,
)


def test_tap_holds_the_projected_patch_features_and_heads_reach_the_tower():
    torch.manual_seed(0)
    tok, proc = build_tokenizer(), build_image_processor()
    model = build_model(tok)
    heads = vl_train.AttributeHeads(model.config.vision_config.hidden_size)
    tap = vl_train.TowerTap(model)
    scenes = world.training_scenes(False)
    samples = [vl_data.sample(scenes, random.Random(i), np.random.default_rng(i)) for i in range(3)]
    batch = vl_train.BatchMaker(tok, proc)(samples)
    model(**batch)
    patches = tap.take()
    assert patches.shape == (3, TOKENS_PER_IMAGE, model.config.vision_config.hidden_size)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"])
    projected = model.model.multi_modal_projector(patches)
    torch.testing.assert_close(torch.stack(list(features.pooler_output)), projected)

    targets = heads.targets([s[3] for s in samples])
    assert targets["shape"].tolist() == [world.SHAPES.index(s[3].shape) for s in samples]
    model.zero_grad()
    heads.loss(patches, targets).backward()
    tower = model.model.vision_tower.get_input_embeddings().weight
    assert tower.grad is not None and tower.grad.abs().sum() > 0
    assert model.lm_head.weight.grad is None  # the read-out does not reach the decoder
    tap.handle.remove()


def test_training_resumes_and_exports_without_the_heads(tmp_path, capsys):
    import transformers as tf

    out = tmp_path / "export"
    common = ["--batch-size", "2", "--work-dir", str(tmp_path / "work"), "--export", str(out)]
    vl_train.main(common + ["--steps", "2"])
    vl_train.main(common + ["--steps", "3"])
    log = capsys.readouterr().out
    assert "at step 2" in log and "stopped at step 3" in log
    state = torch.load(tmp_path / "work" / "checkpoint.pt", weights_only=False)
    assert list(state) == ["model", "ema", "heads", "opt", "step", "rng"] and state["step"] == 3
    model = tf.LlavaForConditionalGeneration.from_pretrained(out)
    assert not [k for k in model.state_dict() if "heads" in k]
    proc = tf.AutoImageProcessor.from_pretrained(out)
    assert proc.size["height"] == model.config.vision_config.image_size
