"""Validation, batching, the output store and encoding: no models, no worker."""

from __future__ import annotations

import numpy as np
import pytest

from genserve.multimodal_gen.batcher import RequestBatcher
from genserve.multimodal_gen.encoding import encode_image, encode_mp4, probe_mp4
from genserve.multimodal_gen.messages import (
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionRequest,
    ModelSpec,
    StepCacheConfig,
    StepDecision,
)
from genserve.multimodal_gen.output_store import OutputStore
from genserve.multimodal_gen.validation import parse_size, resolve_request

IMAGE = ModelSpec(name="img", task=TEXT_TO_IMAGE, family="flux", size_factor=16,
                  max_pixels=256 * 256, default_width=64, default_height=64, default_steps=4,
                  default_guidance=3.5, max_steps=50)
VIDEO = ModelSpec(name="vid", task=TEXT_TO_VIDEO, family="wan", size_factor=16,
                  max_pixels=128 * 128, default_width=64, default_height=64, default_steps=4,
                  default_guidance=1.0, default_num_frames=9, frame_rule="4k+1",
                  max_num_frames=33, default_fps=8)


def resolve(spec=IMAGE, **kw):
    return resolve_request(DiffusionRequest("r", spec.name, kw.pop("prompt", "a cat"), **kw),
                           spec, StepCacheConfig())


def test_defaults_filled_and_seeds_consecutive():
    r = resolve(seed=7, num_outputs=3)
    assert (r.width, r.height, r.num_inference_steps, r.num_frames) == (64, 64, 4, 1)
    assert r.seeds == (7, 8, 9)
    v = resolve(VIDEO)
    assert (v.num_frames, v.fps) == (9, 8)


@pytest.mark.parametrize("kw, words", [
    (dict(width=40), ["width 40", "multiple of 16", "use 32 or 48"]),
    (dict(width=512, height=512), ["512x512", "over the cap"]),
    (dict(num_inference_steps=0), ["num_inference_steps", "between 1 and 50"]),
    (dict(num_inference_steps=51), ["between 1 and 50", "got 51"]),
    (dict(guidance_scale=-1.0), ["guidance_scale", "between 0.0 and 30.0"]),
    (dict(prompt="  "), ["prompt must not be empty"]),
    (dict(num_outputs=9), ["n must be between 1 and 8"]),
    (dict(init_image=b"x"), ["does not support image edits"]),
])
def test_bad_image_input_says_what_to_do(kw, words):
    with pytest.raises(ValueError) as exc:
        resolve(**kw)
    for word in words:
        assert word in str(exc.value)


def test_frame_rule_is_explained_never_rounded():
    with pytest.raises(ValueError) as exc:
        resolve(VIDEO, num_frames=8)
    msg = str(exc.value)
    assert "num_frames 8" in msg and "4k+1" in msg and "5 or 9" in msg
    with pytest.raises(ValueError, match="over the cap of 33"):
        resolve(VIDEO, num_frames=37)
    assert resolve(VIDEO, num_frames=13).num_frames == 13
    with pytest.raises(ValueError, match="makes images"):
        resolve(IMAGE, num_frames=5)


def test_parse_size_rejects_non_numeric():
    assert parse_size("32x48") == (32, 48)
    for bad in ("axb", "32", "32x", "-32x32", "32.5x32"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            parse_size(bad)


def test_step_cache_config_rejects_bad_values():
    with pytest.raises(ValueError, match="fn"):
        StepCacheConfig(enabled=True, fn=0)
    with pytest.raises(ValueError, match="residual_diff_threshold"):
        StepCacheConfig(residual_diff_threshold=-0.1)


def test_batcher_groups_same_shape_up_to_max_and_waits_delay():
    b = RequestBatcher(max_batch_size=3, delay_s=0.1)
    a1, a2 = resolve(seed=1), resolve(seed=2)
    big = resolve(seed=3, width=32)  # another shape: never with the 64x64 ones
    a3 = resolve(seed=4, num_outputs=2)
    object.__setattr__(a2, "rid", "a2")
    object.__setattr__(big, "rid", "big")
    object.__setattr__(a3, "rid", "a3")
    b.add(resolve(seed=9, width=48), now=-0.05)  # a burst is under way
    assert len(b.pop_batch(now=-0.05)) == 1  # ...whose first request ran at once
    b.add(a1, now=0.0)
    b.add(big, now=0.01)
    b.add(a2, now=0.02)
    b.add(a3, now=0.03)
    b.check_integrity()
    assert b.pop_batch(now=0.05) == []  # not full (1 + 1 + 2 > 3 stops at a2), not due
    assert b.wait_time(now=0.05) == pytest.approx(0.05)
    batch = b.pop_batch(now=0.11)
    assert [r.rid for r in batch] == ["r", "a2"]
    b.check_integrity()
    assert [r.rid for r in b.pop_batch(now=0.2)] == ["big"]
    assert b.remove("a3") and not b.remove("a3")
    assert len(b) == 0 and b.wait_time() is None


def test_batcher_runs_a_lone_request_without_delay():
    b = RequestBatcher(max_batch_size=4, delay_s=10.0)
    b.add(resolve(seed=1), now=100.0)
    assert b.wait_time(now=100.0) == 0.0 and len(b.pop_batch(now=100.0)) == 1
    b.add(resolve(seed=2), now=100.5)  # within the window of the last arrival: waits
    assert b.pop_batch(now=101.0) == [] and len(b.pop_batch(now=110.5)) == 1


def test_batcher_runs_full_batch_at_once():
    b = RequestBatcher(max_batch_size=2, delay_s=10.0)
    r1, r2 = resolve(seed=1), resolve(seed=2)
    object.__setattr__(r2, "rid", "r2")
    b.add(resolve(seed=3, width=32), now=-1.0)
    b.pop_batch(now=-1.0)
    b.add(r1, now=0.0)
    b.add(r2, now=0.0)
    assert len(b.pop_batch(now=0.0)) == 2


def test_batcher_regroups_a_batch_once_with_newcomers():
    b = RequestBatcher(max_batch_size=3, delay_s=10.0)
    first, second, third = (resolve(seed=i) for i in range(3))
    other = resolve(seed=3, width=32)
    for req, rid in ((second, "second"), (third, "third"), (other, "other")):
        object.__setattr__(req, "rid", rid)
    b.add(first, now=0.0)
    assert b.pop_batch(now=0.0) == [first]  # lone: ran at once
    assert b.joinable() == 0
    b.add(other, now=0.01)  # another shape cannot join
    assert b.joinable() == 0
    b.add(second, now=0.02)
    b.add(third, now=0.03)
    assert b.joinable() == 2
    b.requeue({"r"})
    b.check_integrity()
    # The regrouped request heads the queue and is due at once, with both newcomers.
    assert [r.rid for r in b.pop_batch(now=0.04)] == ["r", "second", "third"]
    b.add(resolve(seed=9), now=0.05)
    assert b.joinable() == 0  # full, and it was regrouped once already
    assert [r.rid for r in b.pop_batch(now=20.0)] == ["other"]
    assert b.joinable() == 0  # the queued one is another shape than "other"
    b.check_integrity()


def test_worker_regroup_forgets_a_member_cancelled_mid_run():
    """A batch [a, b] reports step 1; at step 2 `a` is cancelled and `c` arrives: the worker
    regroups b with c, keeps no state for a, and the next batch finishes b and c."""
    import queue

    from genserve.multimodal_gen.messages import ErrorEvent, ResultEvent, WorkerCancel, WorkerSubmit
    from genserve.multimodal_gen.worker import WorkerConfig, _Worker

    a, b, c = (resolve(seed=i) for i in range(3))
    for req, rid in ((a, "a"), (b, "b"), (c, "c")):
        object.__setattr__(req, "rid", rid)
        object.__setattr__(req, "model", "img")
    inbox, outbox = queue.Queue(), queue.Queue()

    class Model:
        calls: list[list[str]] = []

        def generate(self, batch, on_step):
            self.calls.append([r.rid for r in batch])
            for step in range(1, 9):
                if step == 2 and len(self.calls) == 1:
                    inbox.put(WorkerCancel("a"))
                    inbox.put(WorkerSubmit(c))
                decision = on_step(step, 8, {})
                if decision is not StepDecision.CONTINUE:
                    return _output([], decision)
            return _output([np.zeros((1, 2, 2, 3), np.uint8)] * len(batch))

    worker = _Worker(WorkerConfig(("m",)), inbox, outbox, models={"img": Model()},
                     batcher=RequestBatcher(max_batch_size=4, delay_s=10.0))
    worker.batcher.add(a, now=0.0)
    worker.batcher.add(b, now=0.0)
    worker.run_batch(worker.batcher.pop_batch(now=20.0))
    worker.check_integrity()  # "a" ended: no step count kept for it
    assert worker.reported == {"b": 1}
    worker.run_batch(worker.batcher.pop_batch())
    worker.check_integrity()
    assert Model.calls == [["a", "b"], ["b", "c"]] and worker.reported == {}
    events = [outbox.get_nowait() for _ in range(outbox.qsize())]
    steps_b = [e.step for e in events if e.rid == "b" and hasattr(e, "step")]
    assert steps_b == list(range(1, 9))  # step 1 once, then 2-8 from the regrouped batch
    assert [type(e) for e in events if e.rid == "a"][-1] is ErrorEvent
    assert {e.rid for e in events if isinstance(e, ResultEvent)} == {"b", "c"}


def _output(frames: list, decision: StepDecision = StepDecision.CONTINUE):
    """A fake model's call result: its frames, or none when a step decision ended it."""
    from genserve.multimodal_gen.pipelines.base import BatchOutput

    return BatchOutput(frames=frames, cached_steps=0, total_steps=8, timings={},
                       decision=decision)


@pytest.mark.parametrize("max_batch, regroup_step", [(2, 0), (4, 1)])
def test_worker_regroups_at_step_0_only_to_fill_the_batch(max_batch, regroup_step):
    """A request that arrives while a lone request's prompt is encoded joins it before the
    first step when that fills the batch (no step thrown away); otherwise after step 1, when
    more of a burst has arrived. No step is reported twice; the next batch holds both."""
    import queue

    from genserve.multimodal_gen.messages import ResultEvent, WorkerSubmit
    from genserve.multimodal_gen.worker import WorkerConfig, _Worker

    a, b = (resolve(seed=i) for i in range(2))
    for req, rid in ((a, "a"), (b, "b")):
        object.__setattr__(req, "rid", rid)
        object.__setattr__(req, "model", "img")
    inbox, outbox = queue.Queue(), queue.Queue()

    class Model:
        calls: list[tuple[list[str], list[int]]] = []

        def generate(self, batch, on_step):
            done = []
            self.calls.append(([r.rid for r in batch], done))
            if len(self.calls) == 1:
                inbox.put(WorkerSubmit(b))  # arrives during the prompt encoding
            for step in range(0, 9):
                decision = on_step(step, 8, {})
                if decision is not StepDecision.CONTINUE:
                    return _output([], decision)
                done.append(step)
            return _output([np.zeros((1, 2, 2, 3), np.uint8)] * len(batch))

    worker = _Worker(WorkerConfig(("m",), max_batch_size=max_batch), inbox, outbox,
                     models={"img": Model()},
                     batcher=RequestBatcher(max_batch_size=max_batch, delay_s=0.01))
    worker.batcher.add(a)
    worker.run_batch(worker.batcher.pop_batch())
    assert Model.calls[0] == (["a"], list(range(regroup_step)))
    worker.run_batch(worker.batcher.pop_batch())
    worker.check_integrity()
    assert Model.calls[1] == (["a", "b"], list(range(9))) and worker.reported == {}
    events = [outbox.get_nowait() for _ in range(outbox.qsize())]
    for rid in "ab":
        assert [e.step for e in events if e.rid == rid and hasattr(e, "step")] == \
            list(range(1, 9))
    assert {e.rid for e in events if isinstance(e, ResultEvent)} == {"a", "b"}


def test_output_store_caps_size_and_age(tmp_path, monkeypatch):
    store = OutputStore(tmp_path, max_bytes=250, max_age_s=60)
    for i in range(4):
        store.put(f"o{i}", bytes(100), "png")
        store.check_integrity()
    assert store.total_bytes <= 250 and len(store) == 2
    assert store.get("o0") is None and store.get("o3")[1] == "image/png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o2.png", "o3.png"]
    # A restarted store finds the files it left.
    again = OutputStore(tmp_path, max_bytes=250, max_age_s=60)
    assert again.get("o2") is not None
    import genserve.multimodal_gen.output_store as mod

    now = mod.time.time()
    monkeypatch.setattr(mod.time, "time", lambda: now + 61)
    assert again.get("o2") is None
    again.put("new", bytes(10), "mp4")
    again.check_integrity()
    assert len(again) == 1 and again.total_bytes == 10
    with pytest.raises(ValueError):
        again.put("../escape", b"x", "png")


def test_output_store_expires_only_the_old(tmp_path, monkeypatch):
    import genserve.multimodal_gen.output_store as mod

    clock = [1000.0]
    monkeypatch.setattr(mod.time, "time", lambda: clock[0])
    store = OutputStore(tmp_path, max_bytes=10_000, max_age_s=200)
    for i in range(6):  # o0 at 1000 s ... o5 at 1100 s
        store.put(f"o{i}", bytes(10), "png")
        clock[0] += 20
    store.put("o1", bytes(20), "png")  # put again at 1120 s: now the youngest
    assert len(store) == 6
    clock[0] = 1250.0  # o0 (250 s old) and o2 (210 s) have expired; o3 (190 s) has not
    store.put("new", bytes(5), "png")
    store.check_integrity()
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["new", "o1", "o3", "o4", "o5"]
    assert store.total_bytes == 10 * 3 + 20 + 5


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 5, 3), (64, 33, 3), (16, 16, 1), (9, 12, 4),
                                   (10, 6)])
@pytest.mark.parametrize("content", ["noise", "smooth", "flat", "textured"])
@pytest.mark.parametrize("deflate", ["isal", "zlib"])
def test_png_encoder_round_trips(shape, content, deflate, monkeypatch):
    from io import BytesIO

    from PIL import Image

    from genserve.multimodal_gen import encoding
    from genserve.multimodal_gen.encoding import encode_png

    if deflate == "isal":
        assert encoding._isal_zlib is not None, "isal is part of genserve[diffusion]"
    else:
        monkeypatch.setattr(encoding, "_isal_zlib", None)  # the fallback without ISA-L

    rng = np.random.default_rng(1)
    h, w = shape[:2]
    yy, xx = np.mgrid[0:h, 0:w]
    base = ((xx * 7 + yy * 3) % 256)[..., None] + np.arange(shape[2] if len(shape) == 3 else 1)
    smooth = base.reshape(shape) if len(shape) == 2 else base
    pixels = {
        "noise": rng.integers(0, 256, shape),
        "smooth": smooth,
        "flat": np.full(shape, 200),
        "textured": smooth + rng.integers(-6, 7, shape if len(shape) == 3 else (h, w)),
    }[content].clip(0, 255).astype(np.uint8).reshape(shape)
    png = encode_png(pixels)
    with Image.open(BytesIO(png)) as image:
        image.verify()  # chunk CRCs and structure
    decoded = np.asarray(Image.open(BytesIO(png)))
    assert np.array_equal(decoded.reshape(pixels.shape), pixels)
    assert encode_png(pixels) == png  # same pixels, same bytes
    if content == "flat" and pixels.size >= 1000:
        assert len(png) < pixels.size // 10  # compressible pictures are compressed
    assert len(png) < pixels.size + 200  # noise is stored, never inflated


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_png_filters_invert_by_the_spec(kind):
    """Each filter, undone by a plain transcription of the PNG spec's reconstruction, gives the
    rows back; the filter of sampled rows equals those rows of the whole image's filter."""
    from genserve.multimodal_gen.encoding import _png_filter

    rng = np.random.default_rng(kind)
    rows = rng.integers(0, 256, (6, 15), dtype=np.uint8)  # 5 pixels of 3 bytes a row
    filtered = _png_filter(rows, 3, kind)
    out = np.zeros((6, 15), dtype=int)
    for y in range(6):
        for x in range(15):
            a = out[y, x - 3] if x >= 3 else 0
            b = out[y - 1, x] if y >= 1 else 0
            pred = (0, a, b, (a + b) // 2)[kind]
            out[y, x] = (int(filtered[y, x]) + pred) % 256
    assert np.array_equal(out, rows)
    which = np.array([0, 2, 5])
    assert np.array_equal(_png_filter(rows, 3, kind, which), filtered[which])


def test_png_encoder_rejects_what_png_cannot_hold():
    from genserve.multimodal_gen.encoding import encode_png

    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="1-4 channels"):
        encode_png(np.zeros((4, 4, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match="non-empty"):
        encode_png(np.zeros((0, 4, 3), dtype=np.uint8))


def test_encoders_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (16, 32, 3), dtype=np.uint8)
    from io import BytesIO

    from PIL import Image

    png = encode_image(frame, "png")
    assert np.array_equal(np.asarray(Image.open(BytesIO(png))), frame)
    for fmt, pil in (("jpeg", "JPEG"), ("webp", "WEBP")):
        assert Image.open(BytesIO(encode_image(frame, fmt))).format == pil
    video = rng.integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    path = tmp_path / "v.mp4"
    path.write_bytes(encode_mp4(video, fps=8))
    info = probe_mp4(path)
    assert info == {"faststart": True, "codec": "h264", "pix_fmt": "yuv420p", "fps": 8.0,
                    "num_frames": 9, "width": 48, "height": 32}


def test_named_model_table_rows_resolve_and_agree_with_their_families():
    import dataclasses

    from genserve.demo_models.models import MODEL_NAMES
    from genserve.multimodal_gen.messages import ModelSpec
    from genserve.multimodal_gen.named_models import DIFFUSION_MODELS, default_model_names
    from genserve.multimodal_gen.pipelines.base import DiffusionFamily
    from genserve.named_models import locate, source_path

    assert DIFFUSION_MODELS.names() == [
        "shapes-image", "shapes-video", "shapes-stream", "tiny-flux", "tiny-wan", "tiny-sd3",
        "tiny-sd", "tiny-ltx", "tiny-sdxl", "tiny-flux-kontext", "tiny-flux-fill", "tiny-wan-i2v",
        "tiny-qwen-image", "tiny-qwen-image-edit", "tiny-helios", "tiny-helios-pyramid",
        "tiny-helios-distilled", "tiny-flux2", "tiny-flux2-klein", "tiny-z-image",
        "tiny-shapes-stream", "tiny-wan22-ti2v", "tiny-wan22-a14b", "tiny-hunyuan-video15",
        "tiny-ltx2"]
    assert default_model_names() == (*MODEL_NAMES.values(), "shapes-stream") == (
        "shapes-image", "shapes-video", "shapes-stream")
    spec_fields = {f.name for f in dataclasses.fields(ModelSpec)}
    for row in DIFFUSION_MODELS.rows:
        family = locate(row.family)
        assert issubclass(family, DiffusionFamily) and family.task == row.task, row.name
        assert set(row.spec) <= spec_fields, row.name
        if row.kind == "builder":
            assert callable(locate(row.source)), row.name
        else:
            assert (source_path(row) / "model_index.json").is_file(), row.name
        if row.pipeline:  # a class of its own: its family serves it
            assert row.pipeline_class_name in family.pipeline_classes
            assert locate(row.pipeline).__name__ == row.pipeline_class_name


def test_request_step_cache_fills_in_from_the_server_default():
    from genserve.entrypoints.diffusion.params import StepCacheParam, step_cache_config
    from genserve.entrypoints.errors import APIError

    server = StepCacheConfig(enabled=False, residual_diff_threshold=0.3, warmup_steps=2)
    assert step_cache_config(None, server) is None
    assert step_cache_config(True, server) == StepCacheConfig(True, 0.3, warmup_steps=2)
    assert step_cache_config("none", server).enabled is False
    override = step_cache_config(StepCacheParam(Fn=2, residual_diff_threshold=0.5), server)
    assert override == StepCacheConfig(True, 0.5, fn=2, warmup_steps=2)
    with pytest.raises(APIError) as exc:
        step_cache_config(StepCacheParam(bn=-1), server)
    assert exc.value.status_code == 400 and "bn" in exc.value.message


_ALLOCATION_ROUNDS = """
import resource, sys
import numpy as np
from genserve.multimodal_gen.malloc_tuning import tune_malloc
tuned = tune_malloc()
def one_round():  # a denoising step's pattern: a few dozen 1-4 MiB blocks, written, all freed
    live = [np.ones(((i % 4) + 1) << 18, dtype=np.float32) for i in range(30)]
    del live
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _allocation_faults(tuning: str) -> tuple[bool, int]:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GENSERVE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", _ALLOCATION_ROUNDS], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


def test_malloc_tuning_reuses_freed_tensor_memory():
    """With glibc's defaults, blocks freed by one step go back to the kernel and fault in again
    (zero-filled) at the next; tuned, the next step reuses them."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc malloc tuning is Linux-only")
    tuned, tuned_faults = _allocation_faults("1")
    if not tuned:
        pytest.skip("the C library is not glibc")
    untuned, default_faults = _allocation_faults("0")
    assert not untuned
    assert default_faults > 10_000  # 5 rounds x 30 blocks x 1-4 MiB of fresh pages
    assert tuned_faults < default_faults / 50


def test_worker_reports_a_failed_self_check_and_keeps_serving():
    import queue

    from genserve.multimodal_gen.messages import WorkerHealth
    from genserve.multimodal_gen.worker import WorkerConfig, _Worker

    outbox: queue.Queue = queue.Queue()
    worker = _Worker(WorkerConfig(("m",)), queue.Queue(), outbox)
    worker.self_check()
    assert outbox.empty()  # passing, as before: nothing to report
    worker.reported["gone"] = 3  # a step count kept for a request that is not queued
    worker.self_check()
    worker.self_check()  # reported once per change, not on every idle tick
    health = outbox.get_nowait()
    assert isinstance(health, WorkerHealth) and "gone" in health.integrity_error
    assert outbox.empty() and worker.integrity_error == health.integrity_error
    worker.reported.clear()
    worker.self_check()
    assert outbox.get_nowait() == WorkerHealth(None) and worker.integrity_error is None
