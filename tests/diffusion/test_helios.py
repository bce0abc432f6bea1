"""Helios (streaming video with history) against diffusers' own `HeliosPipeline` on the embedded
`tiny-helios`: a whole video, the same video made one chunk at a time (alone and batched beside
another stream), a prompt change mid-video, and a stopped chunk that leaves its stream as it
was. Plus the worker's stream store (limits, refusals, invariants)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig, StepDecision
from genserve.multimodal_gen.pipelines import load_model
from genserve.multimodal_gen.streams import StreamStore

CHUNK = 33  # frames per chunk of tiny-helios (9 latent frames)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-helios")


def _req(rid: str, prompt: str, seed: int, frames: int = CHUNK, guidance: float = 1.0,
         stream_id: str | None = None, reset: bool = False) -> ResolvedRequest:
    return ResolvedRequest(
        rid=rid, model="tiny-helios", prompt=prompt, negative_prompt=None, width=64,
        height=64, num_frames=frames, fps=8, num_inference_steps=2, guidance_scale=guidance,
        seeds=(seed,), step_cache=StepCacheConfig(), preview=False, preview_decode_every=0,
        init_image=None, strength=None, submitted_at=time.time(), stream_id=stream_id,
        stream_reset=reset)


def _diffusers(prompt: str, seed: int, chunks: int, guidance: float = 1.0, **kwargs):
    pipe = build_embedded("tiny-helios")
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed),
               num_inference_steps=2, guidance_scale=guidance, height=64, width=64,
               num_frames=chunks * CHUNK, output_type="np", **kwargs).frames[0]
    return (out * 255).round().astype(np.int16)


def _close(ours: np.ndarray, ref: np.ndarray, levels: int) -> None:
    # diffusers trims the joined chunks to 4k+1 frames; the frames it keeps must match.
    assert ours.shape[0] >= ref.shape[0] > 0
    assert np.abs(ours[: ref.shape[0]].astype(np.int16) - ref).max() <= levels


def _no_hook(step, total, tensors):
    return StepDecision.CONTINUE


def test_spec_is_chunked(model):
    spec = model.spec
    assert spec.streaming and spec.default_num_frames == CHUNK
    assert spec.frame_rule == f"{CHUNK}k+0"
    assert spec.frame_count_ok(3 * CHUNK) and not spec.frame_count_ok(CHUNK + 1)
    card = spec.to_model_card()
    assert card["streaming"] is True and card["chunk_frames"] == CHUNK


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_whole_video_equals_diffusers(model, guidance):
    steps = []
    out = model.generate([_req("a", "a red cat", 7, 3 * CHUNK, guidance)],
                         lambda s, t, x: steps.append((s, t)) or StepDecision.CONTINUE)
    assert out.frames[0].shape == (3 * CHUNK, 64, 64, 3)
    _close(out.frames[0], _diffusers("a red cat", 7, 3, guidance), 0)
    # Progress counts the steps of every chunk (each chunk first re-reports where it starts,
    # its moment to stop before any work).
    assert [s for s, _ in steps] == [0, 1, 2, 2, 3, 4, 4, 5, 6] and {t for _, t in steps} == {6}


def test_streamed_chunks_equal_one_call_alone_and_batched(model):
    ref = _diffusers("a red cat", 7, 3)
    ref_other = _diffusers("a blue dog", 9, 2)
    a, b = model.new_stream(7, 64, 64), model.new_stream(9, 64, 64)
    frames_a, frames_b = [], []
    out = model.generate([_req("a0", "a red cat", 7)], _no_hook, streams=[a])
    frames_a.append(out.frames[0])
    for k in (1, 2):  # b joins a's second chunk: rows at different points of their videos
        out = model.generate([_req(f"a{k}", "a red cat", 7), _req(f"b{k}", "a blue dog", 9)],
                             _no_hook, streams=[a, b])
        frames_a.append(out.frames[0])
        frames_b.append(out.frames[1])
    assert a.chunks == 3 and b.chunks == 2
    _close(np.concatenate(frames_a), ref, 1)
    _close(np.concatenate(frames_b), ref_other, 1)
    # The history is bounded by the model's window, whatever the video's length.
    assert a.history.shape[2] == sum(model.history_sizes) == b.history.shape[2]


def test_prompt_change_continues_the_history(model):
    stream = model.new_stream(5, 64, 64)
    for k in range(2):
        model.generate([_req(f"c{k}", "a red cat", 5)], _no_hook, streams=[stream])
    history, prefix = stream.history.clone(), stream.prefix.clone()
    out = model.generate([_req("c2", "a green tree", 5)], _no_hook, streams=[stream])
    # diffusers with the history of chunks < 2 and the new prompt, its generator advanced past
    # the noise of those two chunks.
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        torch.randn((1, 4, 9, 8, 8), generator=generator)
    pipe = build_embedded("tiny-helios")
    ref = pipe(prompt="a green tree", generator=generator, num_inference_steps=2,
               guidance_scale=1.0, height=64, width=64, num_frames=CHUNK, output_type="np",
               video_latents=history, add_noise_to_video_latents=False, image_latents=prefix,
               add_noise_to_image_latents=False).frames[0]
    _close(out.frames[0], (ref * 255).round().astype(np.int16), 0)
    assert stream.prompt == "a green tree"


def test_stopped_chunk_leaves_the_stream_unchanged(model):
    stream = model.new_stream(11, 64, 64)
    model.generate([_req("d0", "a red cat", 11)], _no_hook, streams=[stream])
    before = (stream.history.clone(), stream.chunks)

    def cancel_at_step_one(step, total, tensors):
        return StepDecision.CANCEL if step == 1 else StepDecision.CONTINUE

    out = model.generate([_req("d1", "a red cat", 11)], cancel_at_step_one, streams=[stream])
    assert out.decision is StepDecision.CANCEL and not out.frames
    assert torch.equal(stream.history, before[0]) and stream.chunks == before[1]
    again = model.generate([_req("d1", "a red cat", 11)], _no_hook, streams=[stream])
    _close(np.concatenate([_diffusers("a red cat", 11, 2)[:CHUNK], again.frames[0]]),
           _diffusers("a red cat", 11, 2), 0)


class _Model:
    def new_stream(self, seed, width, height):
        return _State()


class _State:
    def nbytes(self):
        return 100


def test_stream_store_limits_and_refusals():
    store = StreamStore(max_streams=2, max_bytes=10_000)
    first = _req("r1", "p", 1, stream_id="s1", reset=True)
    assert store.refusal(first) is None
    store.acquire([first], _Model())
    store.check_integrity(running=True)
    with pytest.raises(AssertionError, match="running"):
        store.check_integrity(running=False)
    message, status = store.refusal(_req("r2", "p", 1, stream_id="s1"))
    assert status == 400 and "already has a chunk running" in message
    store.release([first])
    store.check_integrity()
    assert store.refusal(_req("r3", "p", 1, stream_id="s1")) is None
    message, status = store.refusal(_req("r4", "p", 1, stream_id="gone"))
    assert status == 400 and "start a new stream" in message
    second = _req("r5", "p", 1, stream_id="s2", reset=True)
    store.acquire([second], _Model())
    store.release([second])
    message, status = store.refusal(_req("r6", "p", 1, stream_id="s3", reset=True))
    assert status == 503 and "2 streams" in message
    assert store.stats() == (2, 200)
    assert store.end("s1") and not store.end("s1")
    assert store.stats() == (1, 100)
    store.check_integrity()
