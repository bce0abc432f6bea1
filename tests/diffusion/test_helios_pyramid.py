"""Helios-Pyramid (coarse-to-fine chunks) against diffusers' own `HeliosPyramidPipeline` on the
embedded `tiny-helios-pyramid` (UniPC, guidance) and `tiny-helios-distilled` (DMD): a whole
video, the same video made one chunk at a time (alone and batched beside another stream at a
different chunk), and a stopped chunk that leaves its stream as it was."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig, StepDecision
from genserve.multimodal_gen.pipelines import load_model

CHUNK = 33  # frames per chunk (9 latent frames)
STEPS = 2  # per pyramid stage; 3 stages


@pytest.fixture(scope="module", params=["tiny-helios-pyramid", "tiny-helios-distilled"])
def model(request):
    return load_model(request.param)


def _req(model, rid: str, prompt: str, seed: int, frames: int = CHUNK,
         guidance: float = 1.0) -> ResolvedRequest:
    return ResolvedRequest(
        rid=rid, model=model.name, prompt=prompt, negative_prompt=None, width=64,
        height=64, num_frames=frames, fps=8, num_inference_steps=STEPS, guidance_scale=guidance,
        seeds=(seed,), step_cache=StepCacheConfig(), preview=False, preview_decode_every=0,
        init_image=None, strength=None, submitted_at=time.time(), stream_id=None,
        stream_reset=False)


def _diffusers(model, prompt: str, seed: int, chunks: int, guidance: float = 1.0):
    pipe = build_embedded(model.name)
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed),
               pyramid_num_inference_steps_list=[STEPS] * 3, guidance_scale=guidance,
               height=64, width=64, num_frames=chunks * CHUNK, output_type="np").frames[0]
    return (out * 255).round().astype(np.int16)


def _close(ours: np.ndarray, ref: np.ndarray, levels: int) -> None:
    assert ours.shape[0] >= ref.shape[0] > 0
    assert np.abs(ours[: ref.shape[0]].astype(np.int16) - ref).max() <= levels


def _no_hook(step, total, tensors):
    return StepDecision.CONTINUE


def test_whole_video_equals_diffusers(model):
    guidance = 1.0 if model.pipe.config.is_distilled else 3.0
    steps = []
    out = model.generate([_req(model, "a", "a red cat", 7, 2 * CHUNK, guidance)],
                         lambda s, t, x: steps.append((s, t)) or StepDecision.CONTINUE)
    assert out.frames[0].shape == (2 * CHUNK, 64, 64, 3)
    _close(out.frames[0], _diffusers(model, "a red cat", 7, 2, guidance), 0)
    per_chunk = 3 * STEPS
    assert [s for s, _ in steps] == [*range(per_chunk + 1), *range(per_chunk, 2 * per_chunk + 1)]
    assert {t for _, t in steps} == {2 * per_chunk}


def test_streamed_chunks_equal_one_call_alone_and_batched(model):
    ref = _diffusers(model, "a red cat", 7, 3)
    ref_other = _diffusers(model, "a blue dog", 9, 2)
    a, b = model.new_stream(7, 64, 64), model.new_stream(9, 64, 64)
    frames_a = [model.generate([_req(model, "a0", "a red cat", 7)], _no_hook,
                               streams=[a]).frames[0]]
    frames_b = []
    for k in (1, 2):  # b joins a's second chunk: rows at different points of their videos
        out = model.generate([_req(model, f"a{k}", "a red cat", 7),
                              _req(model, f"b{k}", "a blue dog", 9)], _no_hook, streams=[a, b])
        frames_a.append(out.frames[0])
        frames_b.append(out.frames[1])
    assert a.chunks == 3 and b.chunks == 2
    _close(np.concatenate(frames_a), ref, 1)
    _close(np.concatenate(frames_b), ref_other, 1)


def test_stopped_chunk_leaves_the_stream_unchanged(model):
    stream = model.new_stream(11, 64, 64)
    model.generate([_req(model, "d0", "a red cat", 11)], _no_hook, streams=[stream])
    before = (stream.history.clone(), stream.chunks)

    def cancel_mid_stage_two(step, total, tensors):  # after a stage's block noise was drawn
        return StepDecision.CANCEL if step == STEPS + 1 else StepDecision.CONTINUE

    out = model.generate([_req(model, "d1", "a red cat", 11)], cancel_mid_stage_two,
                         streams=[stream])
    assert out.decision is StepDecision.CANCEL and not out.frames
    assert torch.equal(stream.history, before[0]) and stream.chunks == before[1]
    again = model.generate([_req(model, "d1", "a red cat", 11)], _no_hook, streams=[stream])
    ref = _diffusers(model, "a red cat", 11, 2)
    _close(np.concatenate([ref[:CHUNK], again.frames[0]]), ref, 0)
