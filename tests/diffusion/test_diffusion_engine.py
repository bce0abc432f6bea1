"""The worker-process client: batching keeps each request's pixels, cancellation, a crashed
worker, and a gateway import that stays free of torch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np

from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ErrorEvent,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
)


async def collect(client, req):
    return [event async for event in client.stream(req)]


def image_req(rid, seed, prompt="a red cat", **kw):
    kw = {"num_inference_steps": 2, "width": 32, "height": 32, **kw}
    return DiffusionRequest(rid, "tiny-flux", prompt, seed=seed, **kw)


def test_events_in_order_with_previews(diffusion_client):
    events = asyncio.run(collect(diffusion_client, image_req("p1", 1, preview=True)))
    assert [type(e) for e in events] == [StepEvent, StepEvent, ResultEvent]
    assert [e.step for e in events[:2]] == [1, 2] and events[0].total_steps == 2
    assert events[0].preview.shape == (1, 32, 32, 3) and events[0].preview.dtype == np.uint8
    result = events[-1]
    assert result.outputs[0].shape == (1, 32, 32, 3) and result.seeds == [1]
    assert set(result.timings) >= {"queue", "denoise", "decode", "total"}


def test_a_request_without_progress_gets_only_its_result(diffusion_client):
    async def main():
        quiet, loud = await asyncio.gather(
            collect(diffusion_client, image_req("q1", 5, progress=False)),
            collect(diffusion_client, image_req("q2", 6)))
        return quiet, loud

    quiet, loud = asyncio.run(main())
    assert [type(e) for e in quiet] == [ResultEvent]
    assert [type(e) for e in loud] == [StepEvent, StepEvent, ResultEvent]
    with_preview = asyncio.run(collect(diffusion_client,
                                       image_req("q3", 5, progress=False, preview=True)))
    assert [type(e) for e in with_preview] == [StepEvent, StepEvent, ResultEvent]
    assert np.array_equal(with_preview[-1].outputs[0], quiet[-1].outputs[0])


def test_queued_requests_batch_and_match_alone(diffusion_client):
    """Requests that queue behind a running one run as one batch, with their pixels alone.

    Which requests share a call is set by the queue, not by timing: a long request of another
    shape holds the worker while the three are submitted, and is then cancelled; the cancel
    reaches the worker after the three (one pipe, in order), so all three are queued when the
    worker picks its next batch."""
    async def main():
        alone = [await collect(diffusion_client, image_req(f"alone{i}", 10 + i, f"p{i} cat"))
                 for i in range(3)]
        blocker = diffusion_client.stream(image_req("blocker", 1, num_inference_steps=100,
                                                    width=48, height=48))
        assert isinstance(await blocker.__anext__(), StepEvent)  # the worker is busy
        together = [asyncio.create_task(collect(
            diffusion_client, image_req(f"tog{i}", 10 + i, f"p{i} cat"))) for i in range(3)]
        while diffusion_client.queue_depth() < 4:  # each task has put its request in the pipe
            await asyncio.sleep(0)
        assert await diffusion_client.cancel("blocker")
        blocked = [event async for event in blocker]
        return alone, [await task for task in together], blocked

    alone, together, blocked = asyncio.run(main())
    assert isinstance(blocked[-1], ErrorEvent) and blocked[-1].status == 499
    assert all(events[-1].batch_size == 1 for events in alone)
    assert [events[-1].batch_size for events in together] == [3, 3, 3]  # one shared call
    for a, t in zip(alone, together, strict=True):
        assert np.array_equal(a[-1].outputs[0], t[-1].outputs[0])


def test_requests_arriving_early_in_a_lone_run_regroup_into_one_batch(diffusion_client):
    """A burst's first request runs at once; requests that arrive during its first steps stop
    it and all run as one batch, with the same pixels as alone and no step reported twice.

    The joiners are sent when the lead reports step 1 and must reach the worker within the
    first quarter of its steps. The step count is the largest a request may ask for, so that
    window is 24 steps, about 0.6 s on a 2-core CPU; a busy machine slows the steps and the
    gateway alike."""
    steps = 100

    def req(i):
        return image_req(f"burst{i}", 30 + i, f"p{i} cat", num_inference_steps=steps,
                         width=None, height=None)

    async def main():
        lead, joiners = [], []
        async for event in diffusion_client.stream(req(0)):
            lead.append(event)
            if isinstance(event, StepEvent) and event.step == 1:
                joiners = [asyncio.create_task(collect(diffusion_client, req(i)))
                           for i in (1, 2)]
        together = [lead] + [await task for task in joiners]
        alone = [await collect(diffusion_client, req(i)) for i in range(3)]
        return together, alone

    together, alone = asyncio.run(main())
    assert [events[-1].batch_size for events in together] == [3, 3, 3]
    assert [e.step for e in together[0][:-1]] == list(range(1, steps + 1))  # none twice
    assert all(events[-1].batch_size == 1 for events in alone)
    for t, a in zip(together, alone, strict=True):
        assert np.array_equal(t[-1].outputs[0], a[-1].outputs[0])


def test_bad_input_and_unknown_model_never_reach_the_worker(diffusion_client):
    [event] = asyncio.run(collect(diffusion_client, DiffusionRequest("x", "nope", "a cat")))
    assert isinstance(event, ErrorEvent) and event.status == 404
    [event] = asyncio.run(collect(diffusion_client, DiffusionRequest(
        "y", "tiny-wan", "a cat", num_frames=10)))
    assert event.status == 400 and "4k+1" in event.message


def test_cancel_stops_at_next_step_and_frees_the_slot(diffusion_client):
    async def main():
        long = image_req("long", 1, num_inference_steps=60, width=None, height=None)
        events = []

        async def consume():
            async for event in diffusion_client.stream(long):
                events.append(event)
                if isinstance(event, StepEvent) and event.step == 2:
                    assert await diffusion_client.cancel("long")

        await asyncio.wait_for(consume(), timeout=60)
        after = await collect(diffusion_client, image_req("after", 2))
        return events, after

    events, after = asyncio.run(main())
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 499
    steps = [e.step for e in events[:-1]]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 60  # stopped early
    assert isinstance(after[-1], ResultEvent)
    assert not asyncio.run(diffusion_client.cancel("long"))  # finished: unknown now


def test_closing_the_stream_cancels(diffusion_client):
    async def main():
        agen = diffusion_client.stream(image_req("gone", 1, num_inference_steps=60))
        first = await agen.__anext__()
        await agen.aclose()
        assert diffusion_client.queue_depth() == 0
        return first, await collect(diffusion_client, image_req("next", 3))

    first, nxt = asyncio.run(main())
    assert isinstance(first, StepEvent) and isinstance(nxt[-1], ResultEvent)


def test_step_cache_override_reports_cached_steps(diffusion_client):
    cache = StepCacheConfig(enabled=True, residual_diff_threshold=0.5)
    events = asyncio.run(collect(diffusion_client, image_req(
        "c", 1, num_inference_steps=8, step_cache=cache)))
    assert events[-1].cached_steps > 0 and events[-1].total_steps == 8


def test_crashed_worker_fails_in_flight_with_503_then_restarts():
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.worker import WorkerConfig
    from genserve.supervision import RestartPolicy

    client = WorkerDiffusionClient(WorkerConfig(("tiny-flux",), num_threads=1),
                                   restart_policy=RestartPolicy(initial_delay_s=0.5))
    first_pid = client.runtime_report()["pid"]

    async def main():
        events = []
        async for event in client.stream(image_req("doomed", 1, num_inference_steps=80)):
            events.append(event)
            if len(events) == 1:
                os.kill(first_pid, signal.SIGKILL)
        late = await collect(client, image_req("late", 1))
        while not client.is_healthy():
            await asyncio.sleep(0.1)
        again = await collect(client, image_req("again", 1))
        return events, late, again

    try:
        events, late, again = asyncio.run(asyncio.wait_for(main(), timeout=240))
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 503
        assert late[-1].status == 503
        assert isinstance(again[-1], ResultEvent)
        report = client.runtime_report()
        assert report["restarts"] == 1 and report["pid"] != first_pid
        assert report["state"] == "ready" and report["integrity_error"] is None
    finally:
        asyncio.run(client.shutdown())
    assert client.runtime_report()["state"] == "stopped"


def test_gateway_side_never_imports_torch():
    code = (
        "import sys\n"
        "import genserve.entrypoints.images.router, genserve.entrypoints.videos.router\n"
        "import genserve.multimodal_gen.launch, genserve.multimodal_gen.engine_client\n"
        "import genserve.multimodal_gen.generate_cli\n"
        "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
