"""`--diffusion-cp 2`: one worker whose pipeline calls two ranks split (cache-dit Ulysses over
gloo on the CPU). A seeded request gives the same pixels as one device; a size whose tokens do
not split is a 400; a cancel leaves the call on both ranks; the step cache works across ranks;
a killed rank fails the request in flight with 503 and the group restarts; models or sizes
that cannot be split are start-up errors naming what works."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from genserve.multimodal_gen.launch import start_diffusion_client
from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ErrorEvent,
    ResultEvent,
    StepCacheConfig,
)
from genserve.multimodal_gen.validation import resolve_request
from genserve.multimodal_gen.worker import WorkerConfig
from genserve.supervision import RestartPolicy


def _args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"diffusion_cp": 2, "diffusion_batch_delay_ms": 50.0, **kw})


@pytest.fixture(scope="module")
def group():
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient

    config = WorkerConfig(("tiny-flux", "tiny-wan", "tiny-flux-kontext", "tiny-flux-fill",
                           "tiny-wan-i2v", "tiny-ltx", "tiny-wan22-ti2v", "tiny-wan22-a14b",
                           "tiny-ltx2"), num_threads=1, batch_delay_ms=50.0, cp_size=2)
    client = WorkerDiffusionClient(config, restart_policy=RestartPolicy(initial_delay_s=0.5))
    yield client
    asyncio.run(client.shutdown())


def _flux(rid: str, seed: int, size: int = 32, **kw) -> DiffusionRequest:
    fields = {"num_inference_steps": 2, "progress": False, **kw}
    return DiffusionRequest(rid, "tiny-flux", "a red cat", seed=seed, width=size, height=size,
                            **fields)


async def _events(client, req) -> list:
    return [e async for e in client.stream(req)]


def _on_one_device(req: DiffusionRequest, spec, step_cache=StepCacheConfig()):
    """The request's frames from the same model in this process, on one device."""
    from genserve.multimodal_gen.pipelines import load_model

    model = load_model(req.model)
    out = model.generate([resolve_request(req, spec, step_cache)])
    return out.frames, out.cached_steps


def test_two_ranks_draw_what_one_device_draws(group):
    flux = _flux("f", 7, num_outputs=2)
    wan = DiffusionRequest("w", "tiny-wan", "a dog running", seed=3, num_inference_steps=2,
                           width=32, height=32, num_frames=5, progress=False)

    async def main():
        return await asyncio.gather(_events(group, flux), _events(group, wan))

    flux_events, wan_events = asyncio.run(main())
    for req, events in ((flux, flux_events), (wan, wan_events)):
        result = events[-1]
        assert isinstance(result, ResultEvent), result
        expected, _ = _on_one_device(req, group.model_spec(req.model))
        assert len(result.outputs) == len(expected) == req.num_outputs
        for got, want in zip(result.outputs, expected, strict=True):
            assert got.shape == want.shape
            # Rows are batch-invariant and attention splits by whole heads; the ranks run with
            # fewer threads than one device, and oneDNN's AVX-512 kernels sum in a
            # thread-dependent order, so a pixel may move one level.
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def _png(color, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (32, 32), color).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("model", "fields", "tolerance"), [
    ("tiny-flux-kontext", {"reference_images": (_png((200, 10, 10)),)}, 0),
    ("tiny-flux-fill", {"reference_images": (_png((200, 10, 10)),), "mask_image": _png(255, "L")},
     0),
    ("tiny-wan-i2v", {"reference_images": (_png((200, 10, 10)),), "num_frames": 5}, 0),
    ("tiny-ltx", {"num_frames": 9, "width": 64, "height": 64}, 0),
    # The 2026 video families (a pixel may move one level, as in the first test):
    ("tiny-wan22-ti2v", {"num_frames": 5}, 1),
    # Four steps: the high-noise expert runs the first, the low-noise one the rest.
    ("tiny-wan22-a14b", {"num_frames": 5, "num_inference_steps": 4}, 1),
    ("tiny-ltx2", {"num_frames": 9, "width": 64, "height": 64}, 1),
])
def test_every_family_that_splits_draws_what_one_device_draws(group, model, fields, tolerance):
    fields = {"width": 32, "height": 32, "num_inference_steps": 2, "progress": False, **fields}
    req = DiffusionRequest(f"c-{model}", model, "a red cat", seed=4, **fields)
    result = asyncio.run(_events(group, req))[-1]
    assert isinstance(result, ResultEvent), result
    expected, _ = _on_one_device(req, group.model_spec(model))
    assert np.abs(result.outputs[0].astype(int) - expected[0].astype(int)).max() <= tolerance


def test_a_size_whose_tokens_do_not_split_is_a_400(group):
    events = asyncio.run(_events(group, _flux("odd", 1, size=48)))  # 3 x 3 latent tokens
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 400
    assert "--diffusion-cp 2" in events[-1].message and "9 tokens" in events[-1].message
    after = asyncio.run(_events(group, _flux("after", 1)))  # both ranks left that call
    assert isinstance(after[-1], ResultEvent)


def test_a_cancel_leaves_the_call_on_both_ranks(group):
    async def main():
        req = _flux("long", 1, num_inference_steps=100, progress=True, preview=True)
        stream = group.stream(req)
        first = await stream.__anext__()
        assert first.preview.shape == (1, 32, 32, 3)  # rank 0 previews on its own
        assert await group.cancel("long")
        cancelled = [e async for e in stream]
        return cancelled, await _events(group, _flux("next", 5))

    cancelled, following = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert cancelled[-1].status == 499
    assert isinstance(following[-1], ResultEvent)
    expected, _ = _on_one_device(_flux("next", 5), group.model_spec("tiny-flux"))
    assert np.abs(following[-1].outputs[0].astype(int) - expected[0].astype(int)).max() <= 1


def test_the_step_cache_decides_the_same_steps_on_every_rank(group):
    cache = StepCacheConfig(enabled=True, residual_diff_threshold=0.5)
    req = _flux("cached", 2, num_inference_steps=8, step_cache=cache)
    events = asyncio.run(_events(group, req))
    result = events[-1]
    assert isinstance(result, ResultEvent), result
    frames, cached = _on_one_device(req, group.model_spec("tiny-flux"), cache)
    assert result.cached_steps == cached > 0
    assert np.array_equal(result.outputs[0], frames[0])


def test_a_killed_rank_fails_the_call_in_flight_and_the_group_restarts(group):
    follower = group._link.followers[0]

    async def main():
        events = []
        req = _flux("doomed", 1, num_inference_steps=100, progress=True)
        async for event in group.stream(req):
            events.append(event)
            if len(events) == 1:
                os.kill(follower.pid, signal.SIGKILL)
        # The 503 can reach us before the supervisor has seen the worker exit: wait for the
        # restart itself, not only for health (still true in that window).
        while group.runtime_report()["restarts"] < 1 or not group.is_healthy():
            await asyncio.sleep(0.2)
        return events, await _events(group, _flux("again", 1))

    events, again = asyncio.run(asyncio.wait_for(main(), timeout=240))
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 503
    assert isinstance(again[-1], ResultEvent)
    report = group.runtime_report()
    assert report["restarts"] == 1 and report["state"] == "ready"
    assert not follower.is_alive() and group._link.followers[0].pid != follower.pid


def test_a_family_that_cannot_be_split_is_a_start_up_error_naming_those_that_can():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        start_diffusion_client(["tiny-sd3"], _args())
    assert ("'tiny-sd3' (family sd3) cannot be split over several devices; families that "
            "can: flux, flux-fill, flux-kontext, ltx, ltx2, wan, wan-i2v") in str(info.value)
    assert time.monotonic() - start < 120  # both ranks stopped; neither waited for the other


def test_a_rank_count_that_does_not_divide_the_heads_is_refused():
    from genserve.multimodal_gen.context_parallel import check_supported
    from genserve.multimodal_gen.pipelines import load_model

    model = load_model("tiny-flux")
    check_supported(model, 2)
    with pytest.raises(ValueError, match=r"--diffusion-cp 3 must divide the attention heads "
                                         r"of model 'tiny-flux' \(2 heads\)"):
        check_supported(model, 3)


def test_bad_cp_flags_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--diffusion-cp must be >= 1"):
        start_diffusion_client(["tiny-flux"], SimpleNamespace(diffusion_cp=0))
    with pytest.raises(ValueError, match="cannot be combined with --diffusion-workers"):
        start_diffusion_client(["tiny-flux"], _args(diffusion_workers=2))
