"""`shapes-stream`, the trained streaming demo model: its world and scorer (pure numpy, checked
on drawn ground truth and on broken streams), and the shipped weights through the served family
on held-out prompts and switch schedules, against the targets of the model card."""

from __future__ import annotations

import numpy as np
import pytest

from genserve.demo_models import stream_evaluate as ev
from genserve.demo_models import stream_world, world

SCENE = world.Scene("red", "circle", "black", direction="right")
OTHER = world.Scene("blue", "triangle", "white", direction="up")


def test_shape_moves_one_step_a_frame_and_wraps():
    state = stream_world.StreamState(60.0, 32.0)  # near the right border
    frames, after = stream_world.render([SCENE] * 6, state)
    assert after.cx == pytest.approx(72.0) and after.cy == pytest.approx(32.0)
    centres = [ev.read_frame(f).centre for f in frames]
    for a, b in zip(centres, centres[1:]):
        step = stream_world.torus_delta(a[0], b[0], 64)
        assert step == pytest.approx(stream_world.SPEED, abs=0.3)
        assert abs(stream_world.torus_delta(a[1], b[1], 64)) < 0.3
    # Across the border the shape is drawn on both sides and reads as one shape there.
    crossing = frames[1]  # centre at x = 64 = 0
    bg = crossing[0, 32]
    assert (crossing[:, :4] != bg).any() and (crossing[:, -4:] != bg).any()
    reading = ev.read_frame(crossing)
    assert reading.colour == "red" and reading.shape == "circle"
    assert min(reading.centre[0], 64 - reading.centre[0]) < 1.0


def _schedule_frames(schedule: ev.Schedule, n: int, jump_at: int | None = None) -> np.ndarray:
    state = stream_world.StreamState(10.0, 20.0)
    scenes = [schedule.scene_at(i) for i in range(n)]
    if jump_at is None:
        return stream_world.render(scenes, state)[0]
    a, state = stream_world.render(scenes[:jump_at], state)
    state = stream_world.StreamState(state.cx + 30, state.cy + 25, state.r)  # a cut
    b, _ = stream_world.render(scenes[jump_at:], state)
    return np.concatenate([a, b])


def test_scorer_on_ground_truth_and_on_broken_streams():
    schedule = ev.Schedule([SCENE, OTHER], [0, 45])
    truth = ev.score_stream(_schedule_frames(schedule, 90), schedule)
    s = ev.summarize([truth])
    assert s["colour"] == s["shape"] == s["background"] == s["direction"] == 1.0
    assert s["resets"] == 0 and s["max_step"] < 1 / 16 and s["switch_latency_max"] == 0
    # A cut is a reset; a switch that never happens is a full-length latency and wrong frames.
    cut = ev.summarize([ev.score_stream(_schedule_frames(schedule, 90, jump_at=20), schedule)])
    assert cut["resets"] == 1 and cut["max_step"] > 1 / 8
    stuck = ev.Schedule([SCENE, SCENE], [0, 45])
    late = ev.summarize([ev.score_stream(_schedule_frames(stuck, 90), schedule)])
    assert late["switch_latency_max"] == 45 and late["colour"] < 0.6
    assert late["direction"] == 0.5  # the second segment still moves right, not up
    # Switches in consecutive chunks: the short segment's latency ends at the next switch,
    # and one frame after the grace shows no direction, so it is not judged.
    quick = ev.Schedule([SCENE, OTHER, SCENE], [0, 36, 45])
    fine = ev.score_stream(_schedule_frames(quick, 90), quick)
    assert fine["latencies"] == [0, 0] and fine["directions"] == [True, True]
    missed = ev.score_stream(_schedule_frames(ev.Schedule([SCENE], [0]), 90), quick)
    assert missed["latencies"] == [9, 0]  # never blue within its 9 frames, then right at once


def test_held_out_schedules_use_held_out_scenes_and_switch_on_chunks():
    schedules = ev.held_out_schedules(6, 306, 9, switches=2)
    held = set(world.held_out(video=True))
    for s in schedules:
        assert all(scene in held for scene in s.scenes)
        assert s.starts[0] == 0 and all(x % 9 == 0 for x in s.starts)
        assert all(a != b for a, b in zip(s.scenes, s.scenes[1:]))


@pytest.fixture(scope="module")
def model():
    from genserve.multimodal_gen.pipelines import load_model

    return load_model("tiny-shapes-stream")


def test_spec_is_a_streaming_model(model):
    spec = model.spec
    assert spec.streaming and spec.default_num_frames == model.chunk_frames == 9
    assert spec.native_size == "32x32" and spec.default_guidance == 1.0
    assert spec.max_num_frames == 9 * 64 and "moving {direction}" in spec.prompt_grammar


def test_served_chunks_equal_the_training_sampler(model):
    """The family's chunk loop (Helios scheduler, x-prediction turned into a velocity) and
    the trainer's roll-out sampler draw the same chunk from the same noise and history (the
    family's, in each stream's follow frame): what training continues from is what serving
    makes."""
    import torch

    from genserve.demo_models import stream_follow, stream_train

    schedules = ev.held_out_schedules(2, 18, 9, switches=0)
    seeds = (5, 6)
    served = ev.run_streams(model, schedules, 18, seed=5, size=32)
    # The trainer's sampler on the same streams: its own generator replays the family's noise.
    pipe = model.pipe
    parts = torch.nn.ModuleDict({"transformer": pipe.transformer,
                                 "text_encoder": pipe.text_encoder})
    streams = [model.new_stream(s, 32, 32) for s in seeds]
    prompts = [s.scene_at(0).prompt() for s in schedules]
    made = []
    for _ in range(2):
        stream_follow.enter_frames(pipe, streams)
        history = torch.cat([st.history for st in streams])
        prefix = torch.cat([st.prefix if st.prefix is not None
                            else torch.zeros_like(st.history[:, :, :1]) for st in streams])
        noise = torch.cat([torch.randn(1, *history.shape[1:2], 9, *history.shape[3:],
                                       generator=st.generator) for st in streams])
        x = stream_train.sample_chunks(pipe, parts, prompts, history, prefix, 3, noise=noise,
                                       autocast=False)
        model._advance(streams, x)
        made.append(torch.cat([st.drawn for st in streams]))  # rolled back to the world
    pixels = ((torch.cat(made, dim=2) + 1) * 127.5).round()
    pixels = pixels.permute(0, 2, 3, 4, 1).numpy()
    for row, video in enumerate(served):
        assert np.abs(pixels[row] - video.astype(np.float32)).max() <= 1


def test_streamed_chunks_continue_one_video(model):
    """Three chunks of one stream at two sizes: a larger size is the native video upscaled."""
    schedules = ev.held_out_schedules(1, 27, 9, switches=0)
    chunked = ev.run_streams(model, schedules, 27, seed=3, size=32)[0]
    big = ev.run_streams(model, schedules, 27, seed=3, size=64)[0]
    assert big.shape == (27, 64, 64, 3) and chunked.shape == (27, 32, 32, 3)
    # The same video, made at 64x64: the native frames upscaled bilinearly (the chunk loop is
    # the same; only decoding differs).
    import torch

    native = torch.from_numpy(chunked).permute(0, 3, 1, 2).float()
    up = torch.nn.functional.interpolate(native, size=(64, 64), mode="bilinear",
                                         align_corners=False).permute(0, 2, 3, 1).numpy()
    assert np.abs(up - big.astype(np.float32)).max() <= 2


def test_committed_model_follows_held_out_prompts_through_switches():
    """The shipped weights as `genserve serve` runs them (the folder's guidance, 3 steps, the
    follow frame): four held-out streams of 153 frames with two prompt switches each. The
    thresholds are the issue's targets, a little under the measured figures for shape (the
    model card's are over 24 streams), and far above chance: a third for shape and
    background, a sixth for colour, and a still or wandering shape fails direction and
    continuity."""
    from genserve.multimodal_gen.pipelines import load_model

    served = load_model("shapes-stream")
    assert served.spec.streaming and served.spec.default_guidance > 1.0
    schedules = ev.held_out_schedules(4, 153, served.chunk_frames, switches=2, seed=2)
    videos = ev.run_streams(served, schedules, 153)
    s = ev.summarize([ev.score_stream(v, sc) for v, sc in zip(videos, schedules)])
    assert s["colour"] >= 0.95 and s["background"] >= 0.95, s
    assert s["shape"] >= 0.85, s
    assert s["direction"] >= 0.9, s
    assert s["resets"] <= 1 and s["switch_latency_mean"] <= 8, s


def test_training_resumes_and_exports_a_servable_folder(tmp_path):
    """Two steps (one with roll-outs), a resumed third that changes the parameterization (a
    fine-tune into it), then the exported folder serves a streamed chunk through the family
    with the parameterization it trained with."""
    import torch

    from genserve.demo_models import stream_train
    from genserve.multimodal_gen.pipelines import load_model

    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--work-dir", str(work), "--out", str(out), "--batch-size", "2",
              "--rollout-steps", "1"]
    stream_train.main([*common, "--steps", "2", "--rollout-frac", "0.5"])
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 2
    stream_train.main([*common, "--steps", "3", "--prediction", "edm"])
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 3
    served = load_model(str(out), name="shapes-stream-test")
    assert served.spec.streaming and served.pipe.parameterization.kind == "edm"
    video = ev.run_streams(served, ev.held_out_schedules(1, 9, 9, switches=0), 9, steps=1)[0]
    assert video.shape == (9, 64, 64, 3)


def test_a_run_starts_from_an_exported_folder(tmp_path):
    """`--init` loads an exported folder's weights into a fresh run (no checkpoint): with no
    steps taken, the run exports the very weights it started from, and the guidance it names
    is what the folder serves with. A folder that is not an export is refused by name."""
    import pytest
    from safetensors.torch import load_file

    from genserve.demo_models import stream_train
    from genserve.multimodal_gen.pipelines import load_model

    first, again = tmp_path / "first", tmp_path / "again"
    stream_train.main(["--work-dir", str(tmp_path / "w1"), "--out", str(first),
                       "--batch-size", "2", "--steps", "1", "--contrast-weight", "2"])
    stream_train.main(["--work-dir", str(tmp_path / "w2"), "--out", str(again),
                       "--steps", "0", "--init", str(first), "--guidance", "1.5"])
    for part, file in (("transformer", "diffusion_pytorch_model.safetensors"),
                       ("text_encoder", "model.safetensors")):
        a, b = load_file(str(first / part / file)), load_file(str(again / part / file))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert load_model(str(first), name="s-first").spec.default_guidance == 1.0
    assert load_model(str(again), name="s-again").spec.default_guidance == 1.5
    with pytest.raises(SystemExit, match="not an exported"):
        stream_train.main(["--work-dir", str(tmp_path / "w3"), "--out", str(tmp_path / "x"),
                           "--steps", "0", "--init", str(tmp_path / "w1")])


def test_latent_space_training_serves_through_the_autoencoder(tmp_path):
    """A run in the latent space of an autoencoder (`stream_ae`, here untrained) trains on
    its [8, 8, 8] latents and exports a folder whose family decodes chunks through it."""
    from genserve.demo_models import stream_ae, stream_train
    from genserve.multimodal_gen.pipelines import load_model

    ae_dir, out = tmp_path / "ae", tmp_path / "out"
    stream_ae.export(stream_ae.build_autoencoder(), ae_dir, count=8)
    stream_train.main(["--work-dir", str(tmp_path / "work"), "--out", str(out),
                       "--batch-size", "2", "--rollout-steps", "1", "--rollout-frac", "0.5",
                       "--steps", "1", "--autoencoder", str(ae_dir), "--shape-weight", "2"])
    served = load_model(str(out), name="shapes-stream-latent-test")
    assert served.pipe.latent_shape == (stream_ae.LATENT_CHANNELS, 8)
    stream = served.new_stream(0, 64, 64)
    assert stream.history.shape[1:] == (stream_ae.LATENT_CHANNELS, 19, 8, 8)
    video = ev.run_streams(served, ev.held_out_schedules(1, 9, 9, switches=0), 9, steps=1)[0]
    assert video.shape == (9, 64, 64, 3)


def test_videos_open_in_the_centre_and_the_transformer_reads_torus_coordinates():
    """The world rule the first chunk relies on (a video opens with the shape in the centre,
    one step along its direction) and the coordinate channels that let the transformer place
    it: one turn of sin / cos across the frame, the same for every frame and row."""
    import random

    import torch

    from genserve.demo_models import stream_model, stream_train

    ex = stream_train.Example(random.Random(0), np.random.default_rng(0), [SCENE], 0.0,
                              rollout=False, first_frac=1.0)
    assert ex.past.shape[1] == 0 and ex.started
    centre = ev.read_frame(ex.target[0]).centre  # 32x32 frames
    assert centre == pytest.approx((16 + stream_world.SPEED / 2, 16), abs=0.5)
    latents = torch.randn(2, stream_model.LATENT_CHANNELS, 3, 16, 16)
    out = stream_model.with_coords(latents)
    assert out.shape == (2, stream_model.LATENT_CHANNELS + stream_model.COORD_CHANNELS, 3, 16, 16)
    assert torch.equal(out[:, :stream_model.LATENT_CHANNELS], latents)
    coords = out[:, stream_model.LATENT_CHANNELS:]
    assert torch.equal(coords[0, :, 0], coords[1, :, 2])
    sin_x, cos_x, sin_y, cos_y = coords[0, :, 0]
    assert torch.allclose(sin_x ** 2 + cos_x ** 2, torch.ones(16, 16))
    assert torch.allclose(sin_x[0], sin_x[5]) and torch.allclose(sin_y[:, 0], sin_y[:, 7])
    assert sin_x[0].sum().abs() < 1e-4 and cos_y[:, 0].sum().abs() < 1e-4  # one whole turn


def test_the_shape_weight_marks_what_tells_the_shapes_apart():
    """`--shape-weight`'s map: the distance of the target chunk from the same chunk drawn with
    each other shape. In pixel space it is zero on the far background and in the middle of the
    shape (every shape covers it), and at a square's corner at least a full red-on-black step
    (2 in the red channel: the circle leaves the corner black)."""
    import random

    from genserve.demo_models import stream_model, stream_train

    square = world.Scene("red", "square", "black", direction="right")
    ex = stream_train.Example(random.Random(0), np.random.default_rng(0), [square], 0.0,
                              rollout=False, first_frac=1.0)
    others = ex.other_shapes()
    assert len(others) == 2 and all(o.shape == ex.target.shape for o in others)
    assert sorted(ev.read_frame(o[0]).shape for o in others) == ["circle", "triangle"]
    pipe = stream_model.build_stream_pipeline()
    x0 = stream_train._pack(pipe, stream_train._to_tensor(ex.target)[None])
    d = stream_model.unpack(stream_train._shape_weight(pipe, x0, [ex]))[0, :, 0].sum(0)
    cx, cy = (round(v) for v in ev.read_frame(ex.target[0]).centre)
    r = int(stream_world.RADIUS * stream_model.MODEL_SIZE / stream_world.SIZE)
    assert d[cy, cx] == 0 and d[cy, (cx + 16) % 32] == 0  # the middle; the far background
    assert float(d[cy - r + 1, cx + r - 1]) >= 2.0


def test_the_autoencoder_weighs_the_pixels_that_tell_shapes_apart():
    """`stream_ae --shape-weight`: the same frames, and on top of the foreground weight one
    `shape_weight` per other shape that would draw the pixel differently; nothing elsewhere."""
    import random

    import torch

    from genserve.demo_models import stream_ae

    scenes = [world.Scene("red", "square", "black", direction="right"), OTHER]
    x1, w1 = stream_ae.random_frames(random.Random(1), np.random.default_rng(1), scenes, 4)
    x2, w2 = stream_ae.random_frames(random.Random(1), np.random.default_rng(1), scenes, 4, 3.0)
    assert torch.equal(x1, x2)
    extra = w2 - w1
    assert set(extra.unique().tolist()) == {0.0, 3.0, 6.0}
    assert 0 < float((extra > 0).float().mean()) < 0.1  # a few edge pixels a frame
