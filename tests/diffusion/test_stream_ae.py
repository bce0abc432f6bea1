"""`stream_ae`, the autoencoder of `shapes-stream`: the loss weights of faint shapes and a
fine-tune that starts from an exported folder."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from genserve.demo_models import stream_ae, stream_world, world


def test_a_faint_shape_weighs_more_by_its_contrast():
    """`--contrast-weight k`: every pixel of a frame whose colour is close to its background
    weighs (CONTRAST_REF / distance) ** k times more; a frame of a bright shape (distance
    above the reference) keeps its weights."""
    faint = world.Scene("purple", "triangle", "gray", direction="left")
    bright = world.Scene("red", "square", "black", direction="right")
    for scene in (faint, bright):
        _, plain = stream_ae.random_frames(random.Random(2), np.random.default_rng(2), [scene], 2)
        _, weighed = stream_ae.random_frames(random.Random(2), np.random.default_rng(2), [scene],
                                             2, contrast_weight=2.0)
        distance = np.linalg.norm(np.subtract(world.COLOURS[scene.colour],
                                              world.BACKGROUNDS[scene.background]))
        factor = max(1.0, (stream_world.CONTRAST_REF / distance) ** 2)
        assert torch.allclose(weighed, plain * factor)
    assert stream_world.contrast_weight(faint, 2.0) > 3.0  # purple on gray: about three times
    assert stream_world.contrast_weight(bright, 2.0) == 1.0


def test_a_fine_tune_starts_from_an_exported_autoencoder(tmp_path):
    """`--init DIR`: with no steps taken the run exports the weights it started from; a
    decoder-only fine-tune keeps the encoder and so the latent scale."""
    from diffusers import AutoencoderTiny

    first, again, tuned = tmp_path / "first", tmp_path / "again", tmp_path / "tuned"
    stream_ae.export(stream_ae.build_autoencoder(), first, count=8)
    common = ["--batch-size", "2", "--init", str(first)]
    stream_ae.main(["--work-dir", str(tmp_path / "w1"), "--out", str(again), "--steps", "0",
                    *common])
    stream_ae.main(["--work-dir", str(tmp_path / "w2"), "--out", str(tuned), "--steps", "2",
                    "--decoder-only", "--lr", "1e-2", *common])
    a, b, c = (AutoencoderTiny.from_pretrained(d) for d in (first, again, tuned))
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
        if name.startswith("encoder."):
            assert torch.equal(value, c.state_dict()[name]), name
    assert any(not torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items()
               if k.startswith("decoder."))
    # The decoder-only fine-tune keeps the latent scale the transformer was trained at.
    assert c.config.scaling_factor == pytest.approx(b.config.scaling_factor)
