"""Frame deadlines: realtime chunks run ahead of batch work, which pauses at a step boundary and
goes on with the same pixels (batcher.py, worker.py)."""

from __future__ import annotations

import queue

import numpy as np

from genserve.multimodal_gen.batcher import RequestBatcher
from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ErrorEvent,
    ResultEvent,
    StepCacheConfig,
    StepDecision,
    WorkerCancel,
    WorkerSubmit,
)
from genserve.multimodal_gen.validation import resolve_request
from genserve.multimodal_gen.worker import WorkerConfig, _Worker
from tests.diffusion.test_diffusion_units import IMAGE, VIDEO, _output


def _req(rid: str, spec=IMAGE, deadline: float | None = None, seed: int = 0, steps: int = 4):
    req = DiffusionRequest(
        rid, spec.name, "a red circle", seed=seed, deadline=deadline, num_inference_steps=steps
    )
    return resolve_request(req, spec, StepCacheConfig())


def test_urgent_requests_head_the_queue_due_at_once_and_batch_alone():
    b = RequestBatcher(max_batch_size=4, delay_s=10.0)
    b.add(_req("img1"), now=0.0)
    b.add(_req("img2"), now=0.0)  # a burst: not quiet, waits the delay
    b.add(_req("late", deadline=200.0), now=0.0)
    b.add(_req("soon", deadline=100.0), now=0.0)
    assert b.wait_time(now=0.0) == 0.0  # no batch delay for a deadline
    # Earliest deadline first; same shape, but batch work never joins an urgent batch.
    assert [r.rid for r in b.pop_batch(now=0.0)] == ["soon", "late"]
    assert [r.rid for r in b.pop_batch(now=0.0)] == ["img1", "img2"]


def test_pop_urgent_skips_the_busy_model_and_keeps_the_regroup_state():
    b = RequestBatcher(max_batch_size=4, delay_s=0.0)
    b.add(_req("img1"), now=0.0)
    assert [r.rid for r in b.pop_batch(now=1.0)] == ["img1"]
    b.add(_req("img2"), now=1.0)
    b.add(_req("rt-img", deadline=5.0), now=1.0)
    b.add(_req("rt-vid", VIDEO, deadline=9.0), now=1.0)
    # The image pipeline is busy with the paused call: only the video chunk can run inside it.
    assert [r.rid for r in b.pop_urgent(exclude_model="img")] == ["rt-vid"]
    assert b.pop_urgent(exclude_model="img") == []
    assert b.joinable() == 1 and b.room() == 3  # img1's batch may still take img2
    assert [r.rid for r in b.pop_batch(now=1.0)] == ["rt-img"]


class _FakeModel:
    """A model whose calls log (model, rids, step) as they run; `at_step` hooks act mid-call."""

    def __init__(self, name: str, log: list, at_step=None):
        self.name, self.log, self.at_step = name, log, at_step or {}

    def generate(self, batch, on_step):
        rids = [r.rid for r in batch]
        for step in range(1, 5):
            self.log.append((self.name, tuple(rids), step))
            if step in self.at_step:
                self.at_step.pop(step)()
            decision = on_step(step, 4, {})
            if decision is not StepDecision.CONTINUE:
                return _output([], decision)
        return _output([np.full((1, 2, 2, 3), len(self.log), np.uint8)] * len(batch))


def test_worker_runs_a_chunk_inside_a_paused_batch_and_honours_a_cancel_meanwhile():
    """An image batch [a, b] is at step 2 when a realtime chunk arrives: the chunk runs to the
    end before the images' step 3, and a cancel of `a` that arrives during the chunk ends `a`;
    `b` goes on from step 3 in the same call (no step repeated, no regroup)."""
    inbox, outbox, log = queue.Queue(), queue.Queue(), []
    a, b = _req("a"), _req("b", seed=1)
    chunk = _req("chunk", VIDEO, deadline=1.0)
    image = _FakeModel("img", log, {2: lambda: inbox.put(WorkerSubmit(chunk))})
    video = _FakeModel("vid", log, {1: lambda: inbox.put(WorkerCancel("a"))})
    worker = _Worker(
        WorkerConfig(("m",)),
        inbox,
        outbox,
        models={"img": image, "vid": video},
        batcher=RequestBatcher(max_batch_size=4, delay_s=10.0),
    )
    worker.batcher.add(a, now=0.0)
    worker.batcher.add(b, now=0.0)
    worker.run_batch(worker.batcher.pop_batch(now=20.0))
    worker.check_integrity()
    assert log == [
        ("img", ("a", "b"), 1),
        ("img", ("a", "b"), 2),
        *[("vid", ("chunk",), s) for s in range(1, 5)],
        ("img", ("a", "b"), 3),
        ("img", ("a", "b"), 4),
    ]
    assert worker.preempted == 1 and worker.running == {} and worker.cancelled == set()
    events = [outbox.get_nowait() for _ in range(outbox.qsize())]
    results = [e.rid for e in events if isinstance(e, ResultEvent)]
    assert results == ["chunk", "b"]
    assert [type(e) for e in events if e.rid == "a"][-1] is ErrorEvent
    assert [e.step for e in events if e.rid == "b" and hasattr(e, "step")] == [1, 2, 3, 4]


def test_a_paused_image_batch_gives_the_same_pixels():
    """Real demo models: shapes-image requests paused at a step boundary for a shapes-video
    chunk give the pixels of the same requests run without a pause."""
    from genserve.multimodal_gen.pipelines import load_model

    models = {name: load_model(name) for name in ("shapes-image", "shapes-video")}
    specs = {name: model.spec for name, model in models.items()}

    def request(rid, model, seed, deadline=None):
        req = DiffusionRequest(
            rid,
            model,
            "a blue square",
            seed=seed,
            deadline=deadline,
            num_inference_steps=3,
            num_frames=None,
        )
        return resolve_request(req, specs[model], StepCacheConfig())

    def run(with_chunk: bool) -> tuple[dict, int, list[str]]:
        inbox, outbox = queue.Queue(), queue.Queue()
        worker = _Worker(
            WorkerConfig(("m",)),
            inbox,
            outbox,
            models=models,
            batcher=RequestBatcher(max_batch_size=4, delay_s=0.0),
        )
        if with_chunk:  # it arrives while the images' prompts are encoded
            inbox.put(WorkerSubmit(request("chunk", "shapes-video", 5, deadline=0.0)))
        for i in range(2):
            worker.batcher.add(request(f"img{i}", "shapes-image", 10 + i), now=0.0)
        worker.run_batch(worker.batcher.pop_batch(now=1.0))
        events = [outbox.get_nowait() for _ in range(outbox.qsize())]
        results = [e for e in events if isinstance(e, ResultEvent)]
        assert not [e for e in events if isinstance(e, ErrorEvent)]
        return ({e.rid: e.outputs for e in results}, worker.preempted, [e.rid for e in results])

    alone, preempted, _ = run(False)
    paused, preempted_with, order = run(True)
    assert preempted == 0 and preempted_with == 1
    assert order == ["chunk", "img0", "img1"]  # the chunk ended first
    for rid in ("img0", "img1"):
        assert len(paused[rid]) == len(alone[rid]) == 1
        np.testing.assert_array_equal(paused[rid][0], alone[rid][0])
