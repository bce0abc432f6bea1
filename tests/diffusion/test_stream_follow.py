"""The follow frame of `shapes-stream` (`stream_follow`): each chunk is drawn with the stream's
shape in the middle of the frame and its pixels rolled back to where the world has them. The
shift is checked on drawn ground truth; the shipped weights check that what the family hands
out (chunks, previews, a re-run after a stopped chunk) is the world's picture, not the frame's."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from genserve.demo_models import stream_evaluate as ev
from genserve.demo_models import stream_follow, stream_world, world
from genserve.demo_models.stream_model import MODEL_SIZE
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig, StepDecision

SCENE = world.Scene("red", "square", "black", direction="right")


def _pixels(state: stream_world.StreamState) -> torch.Tensor:
    """One drawn frame [1, 3, 32, 32] in [-1, 1] with the shape where `state` has it."""
    frames, _ = stream_world.render([SCENE], state, MODEL_SIZE)
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _centre(pixels: torch.Tensor) -> tuple[float, float]:
    mask = (pixels[0].max(0).values > 0).numpy().astype(np.float32)  # red on black
    return stream_world.circular_centroid(mask)


@pytest.mark.parametrize("where", [(32.0, 32.0), (62.0, 20.0), (1.0, 63.0)])
def test_the_shift_brings_the_shape_to_the_middle_even_across_the_border(where):
    frame = _pixels(stream_world.StreamState(*where))
    shift = stream_follow.centring_shifts(frame)
    moved = stream_follow.roll_rows(frame, shift)
    cx, cy = _centre(moved)
    assert abs(cx - MODEL_SIZE / 2) <= 1 and abs(cy - MODEL_SIZE / 2) <= 1
    assert shift.abs().max() <= MODEL_SIZE // 2  # never more than half a turn
    # A roll is a permutation: rolling back gives the frame itself.
    assert torch.equal(stream_follow.roll_rows(moved, -shift), frame)


def test_a_frame_without_a_shape_is_not_moved():
    empty = torch.full((2, 3, MODEL_SIZE, MODEL_SIZE), -0.5)
    assert not stream_follow.centring_shifts(empty).any()


@pytest.fixture(scope="module")
def served():
    from genserve.multimodal_gen.pipelines import load_model

    return load_model("shapes-stream")


def _request(served, rid: str, seed: int, prompt: str) -> ResolvedRequest:
    spec = served.spec
    return ResolvedRequest(
        rid=rid, model=spec.name, prompt=prompt, negative_prompt=None, width=64, height=64,
        num_frames=served.chunk_frames, fps=24, num_inference_steps=spec.default_steps,
        guidance_scale=spec.default_guidance, seeds=(seed,), step_cache=StepCacheConfig(),
        preview=True, preview_decode_every=0, init_image=None, strength=None,
        submitted_at=time.time(), stream_id="follow", stream_reset=False)


def test_chunks_and_previews_show_the_world_not_the_frame(served):
    """Six chunks of a shape moving right (it wraps across the border): from the second
    chunk on each is drawn in a moved frame, yet the video moves on without a jump, and the
    last step's preview (decoded with the per-row offset the worker hands it) is the chunk."""
    stream = served.new_stream(3, 64, 64)
    frames, offsets = [], []
    for k in range(6):
        seen = {}
        req = _request(served, f"f{k}", 3, SCENE.prompt())

        def keep_last(step, total, tensors, seen=seen, req=req):
            if tensors:
                seen["preview"] = served.preview(
                    {key: t[:1] for key, t in tensors.items()}, req, full_decode=False)
            return StepDecision.CONTINUE

        out = served.generate([req], keep_last, streams=[stream])
        offsets.append(stream.offset.clone())
        # The kept pixels hold no autograd graph (one would chain every chunk to the last).
        assert stream.pixels.grad_fn is None and not stream.pixels.requires_grad
        assert np.abs(seen["preview"].astype(int) - out.frames[0].astype(int)).max() <= 1
        frames.append(out.frames[0])
    assert not offsets[0].any() and all(o.any() for o in offsets[1:])
    video = np.concatenate(frames)
    scores = ev.score_stream(video, ev.Schedule([SCENE], [0]))
    assert scores["resets"] == 0 and all(scores["directions"]), scores
    assert np.mean(scores["colour"]) >= 0.95 and np.mean(scores["shape"]) >= 0.8, scores


def test_a_stopped_chunk_reruns_as_if_it_had_not_been_stopped(served):
    prompts = [SCENE.prompt(), SCENE.prompt(), "a blue triangle moving up on a white background"]
    plain = served.new_stream(8, 64, 64)
    expected = [served.generate([_request(served, f"p{k}", 8, p)], None, streams=[plain])
                for k, p in enumerate(prompts)]
    stream = served.new_stream(8, 64, 64)
    for k, p in enumerate(prompts[:2]):
        served.generate([_request(served, f"s{k}", 8, p)], None, streams=[stream])
    pixels, chunks = stream.pixels.clone(), stream.chunks

    def cancel(step, total, tensors):
        return StepDecision.CANCEL if step == 2 else StepDecision.CONTINUE

    req = _request(served, "s2", 8, prompts[2])
    assert served.generate([req], cancel, streams=[stream]).decision is StepDecision.CANCEL
    assert torch.equal(stream.pixels, pixels) and stream.chunks == chunks
    again = served.generate([req], None, streams=[stream])
    assert np.array_equal(again.frames[0], expected[2].frames[0])
