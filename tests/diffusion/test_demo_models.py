"""The trained demo models (shapes-image, shapes-video; shapes-stream's own tests are in
test_shapes_stream.py): the scorer, the committed weights drawing what the prompt says on
prompts held out of training, and serving them over HTTP."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from genserve.demo_models import scorer, world
from genserve.demo_models.models import DEFAULT_GUIDANCE
from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, TEXT_TO_VIDEO
from genserve.multimodal_gen.named_models import default_model_for, default_model_names
from tests.diffusion.helpers import error_of

# Fixed held-out prompts and seeds; thresholds are loose (the full evaluation is
# `python -m genserve.demo_models.evaluate`) but far above what noise scores.
IMAGE_SCENES = world.held_out(video=False)[:12]
VIDEO_SCENES = world.held_out(video=True)[:12]


def test_scorer_reads_the_generators_own_pictures():
    rng = np.random.default_rng(7)
    images = [scorer.score_image(world.render_image(s, rng), s)
              for s in world.all_scenes(video=False)]
    videos = [scorer.score_video(world.render_video(s, rng), s)
              for s in world.all_scenes(video=True)]
    assert scorer.summarize(images)["all"] >= 0.98
    assert scorer.summarize(videos)["all"] >= 0.98


def test_scorer_rejects_noise_and_wrong_prompts():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    scene = world.Scene("red", "circle", "white", position="center")
    assert not scorer.score_image(noise, scene)["all"]
    image = world.render_image(scene)
    assert scorer.score_image(image, scene)["all"]
    wrong = world.Scene("blue", "square", "black", position="top left")
    assert scorer.score_image(image, wrong) == {
        "colour": False, "shape": False, "background": False, "position": False, "all": False}
    still = np.stack([image] * 16)
    clip = world.Scene("red", "circle", "white", direction="right")
    result = scorer.score_video(still, clip)
    assert not result["direction"] and not result["frames_differ"]


def test_prompt_grammar_round_trips():
    for scene in world.all_scenes(False) + world.all_scenes(True):
        assert world.parse_prompt(scene.prompt()) == scene
    assert world.parse_prompt("A Red Circle on a White background, Top Left.") == world.Scene(
        "red", "circle", "white", position="top left")
    assert world.parse_prompt("a red cat on a white background, top") is None
    assert world.parse_prompt("a red circle moving sideways on a white background") is None


def test_held_out_prompts_are_never_trained_on():
    for video in (False, True):
        held = set(world.held_out(video))
        assert len(held) == 60
        assert not held & set(world.training_scenes(video))


@pytest.fixture(scope="module")
def image_pipe():
    from genserve.demo_models.evaluate import load

    return load("image")


def test_committed_image_model_draws_held_out_prompts(image_pipe):
    from genserve.demo_models.evaluate import generate

    outs = generate(image_pipe, IMAGE_SCENES, steps=8, guidance=DEFAULT_GUIDANCE["image"],
                    seed=100)
    scores = scorer.summarize([scorer.score_image(o, s) for o, s in zip(outs, IMAGE_SCENES)])
    # Chance would be 1/6 colour, 1/3 background, 1/3 shape, 1/9 position. The model gets all
    # 12 right with these seeds (11 with seed 101); the margins absorb CPU-to-CPU differences.
    assert scores["colour"] >= 0.9 and scores["background"] >= 0.9, scores
    assert scores["position"] >= 0.9 and scores["shape"] >= 0.75, scores
    assert scores["all"] >= 0.66, scores


def test_committed_video_model_moves_the_shape():
    from genserve.demo_models.evaluate import generate, load

    pipe = load("video")
    outs = generate(pipe, VIDEO_SCENES, steps=8, guidance=DEFAULT_GUIDANCE["video"], seed=200)
    assert outs[0].shape == (world.NUM_FRAMES, 32, 32, 3)
    scores = scorer.summarize([scorer.score_video(o, s) for o, s in zip(outs, VIDEO_SCENES)])
    # Chance would be 1/6 colour, 1/3 background; a still or wandering shape fails direction.
    assert scores["background"] >= 0.9 and scores["colour"] >= 0.66, scores
    assert scores["direction"] >= 0.75 and scores["frames_differ"] >= 0.9, scores


def test_same_seed_same_pixels_batched_or_alone(image_pipe):
    import torch

    from genserve.multimodal_gen.batch_invariance import make_batch_invariant

    make_batch_invariant(image_pipe.transformer)  # as the served family does
    make_batch_invariant(image_pipe.text_encoder)
    prompts = [s.prompt() for s in IMAGE_SCENES[:3]]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    batched = image_pipe(prompts, num_inference_steps=4, generator=gens).frames
    alone = image_pipe(prompts[1], num_inference_steps=4,
                       generator=torch.Generator().manual_seed(1)).frames
    assert np.array_equal(batched[1], alone[0])
    assert not np.array_equal(batched[0], batched[1])


# ---- served over HTTP (the session's worker serves the demo models next to tiny-flux) ----


def test_default_models_are_the_demo_models():
    assert default_model_names() == ("shapes-image", "shapes-video", "shapes-stream")
    # `genserve generate` picks the first default whose frame limit fits, else the first one:
    # a long video is one stream of the streaming model.
    assert default_model_for(TEXT_TO_VIDEO) == "shapes-video"
    assert default_model_for(TEXT_TO_VIDEO, 16) == "shapes-video"
    assert default_model_for(TEXT_TO_VIDEO, 300) == "shapes-stream"
    assert default_model_for(TEXT_TO_VIDEO, 10_000) == "shapes-video"  # fits none: the first
    assert default_model_for(TEXT_TO_IMAGE) == "shapes-image"


def test_models_list_the_demo_models_with_their_grammar(http):
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    image, video = models["shapes-image"], models["shapes-video"]
    assert image["task"] == "text-to-image" and video["task"] == "text-to-video"
    assert image["prompt_grammar"].startswith(world.IMAGE_GRAMMAR)
    assert video["prompt_grammar"].startswith(world.VIDEO_GRAMMAR)
    for card in (image, video):
        assert card["native_size"] == "32x32" and "bilinear" in card["upscaling"]
        assert card["square_only"] is True
    assert video["frame_rule"] == "16" and video["default_num_frames"] == 16
    stream = models["shapes-stream"]
    assert stream["task"] == "text-to-video" and stream["streaming"] is True
    assert stream["prompt_grammar"].startswith(world.VIDEO_GRAMMAR)
    assert stream["native_size"] == "32x32" and stream["default_num_frames"] == 9


def _image(http, scene: world.Scene, seed: int, size: str = "32x32") -> np.ndarray:
    r = http.post("/v1/images/generations", json={
        "model": "shapes-image", "prompt": scene.prompt(), "size": size, "seed": seed,
        "num_inference_steps": 8})
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_image_endpoint_serves_the_demo_model(http):
    native = [_image(http, s, seed=100 + i) for i, s in enumerate(IMAGE_SCENES[:4])]
    outs = [scorer.score_image(img, s) for img, s in zip(native, IMAGE_SCENES)]
    assert sum(o["background"] for o in outs) >= 3, outs
    # Larger sizes are the native picture upscaled: the same picture, bigger.
    big = _image(http, IMAGE_SCENES[0], seed=100, size="128x128")
    assert big.shape == (128, 128, 3)
    small = np.asarray(Image.fromarray(big).resize((32, 32), Image.BOX)).astype(int)
    assert np.abs(small - native[0].astype(int)).mean() < 8


def test_demo_models_reject_what_they_cannot_draw(http):
    r = http.post("/v1/images/generations", json={
        "model": "shapes-image", "prompt": "a red circle", "size": "64x32"})
    assert r.status_code == 400 and "square" in error_of(r)["message"]
    r = http.post("/v1/images/generations", json={
        "model": "shapes-image", "prompt": "a red circle", "size": "48x48"})
    assert r.status_code == 400 and "multiple of 32" in error_of(r)["message"]
    r = http.post("/v1/videos", json={
        "model": "shapes-video", "prompt": "a red circle moving up on a white background",
        "num_frames": 9})
    assert r.status_code == 400 and "exactly 16 frames" in error_of(r)["message"]


def _video_job(http, body: dict, path) -> tuple[dict, np.ndarray]:
    """Run a /v1/videos job of 64x64 frames to completion; its MP4's metadata and frames."""
    import imageio_ffmpeg

    r = http.post("/v1/videos", json={"size": "64x64", **body})
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    deadline = time.time() + 60
    while http.get(f"/v1/videos/{video_id}").json()["status"] != "completed":
        assert time.time() < deadline
        time.sleep(0.1)
    path.write_bytes(http.get(f"/v1/videos/{video_id}/content").content)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    return meta, np.stack([np.frombuffer(f, np.uint8).reshape(64, 64, 3) for f in reader])


def test_video_job_serves_the_demo_model(http, tmp_path):
    scene = VIDEO_SCENES[0]
    meta, frames = _video_job(http, {"model": "shapes-video", "prompt": scene.prompt(),
                                     "seed": 200, "num_inference_steps": 8},
                              tmp_path / "clip.mp4")
    assert meta["size"] == (64, 64) and frames.shape[0] == world.NUM_FRAMES
    result = scorer.score_video(frames, scene)  # (64x64: the native clip upscaled)
    assert result["frames_differ"] and result["background"] and result["direction"], result


def test_long_video_job_is_one_stream_of_the_streaming_model(http, tmp_path):
    """A video longer than shapes-video's 16 frames, as `genserve generate` sends it: one
    stream of shapes-stream, whole chunks, one continuous scene in the MP4."""
    from genserve.demo_models import stream_evaluate

    scene = VIDEO_SCENES[2]
    _, frames = _video_job(http, {"model": "shapes-stream", "prompt": scene.prompt(),
                                  "seed": 4, "num_frames": 45}, tmp_path / "long.mp4")
    assert frames.shape[0] == 45
    schedule = stream_evaluate.Schedule([scene], [0])
    # (A lossy MP4: the continuity bound and background, not frame-exact attributes.)
    s = stream_evaluate.summarize([stream_evaluate.score_stream(frames, schedule)])
    assert s["resets"] == 0 and s["background"] >= 0.9 and s["direction"] == 1.0, s


def test_video_model_takes_the_step_cache(http):
    """shapes-video is an SD3 MMDiT: DBCache attaches through its block adapter and skips steps."""
    r = http.post("/v1/videos", json={
        "model": "shapes-video", "prompt": VIDEO_SCENES[1].prompt(), "size": "32x32", "seed": 3,
        "num_inference_steps": 16, "step_cache": {"residual_diff_threshold": 0.5}})
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    deadline = time.time() + 60
    while (job := http.get(f"/v1/videos/{video_id}").json())["status"] != "completed":
        assert job["status"] in ("queued", "in_progress") and time.time() < deadline, job
        time.sleep(0.1)
    assert 0 < job["cached_steps"] < 16, job


def test_training_resumes_exports_and_fine_tunes(tmp_path, capsys):
    """The training entry point end to end at toy scale: a run, a resumed run, the export loading
    with from_pretrained, and a fresh run starting from that export."""
    import torch

    from genserve.demo_models import train
    from genserve.demo_models.pipeline import ShapesPipeline

    work, out = tmp_path / "work", tmp_path / "out"
    common = ["video", "--batch-size", "2", "--work-dir", str(work), "--export", str(out),
              "--minutes", "5"]
    train.main(common + ["--steps", "2"])
    state = torch.load(work / "shapes-video" / "checkpoint.pt", weights_only=False)
    assert list(state) == ["model", "ema", "opt", "step", "rng"] and state["step"] == 2
    train.main(common + ["--steps", "3"])
    assert "resumed video" in capsys.readouterr().out
    assert torch.load(work / "shapes-video" / "checkpoint.pt", weights_only=False)["step"] == 3
    from safetensors import safe_open

    folder = out / "shapes-video"
    with safe_open(folder / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    pipe = ShapesPipeline.from_pretrained(folder)
    assert pipe.num_frames == world.NUM_FRAMES
    frames = pipe("a red circle moving up on a white background", num_inference_steps=1).frames
    assert frames.shape == (1, world.NUM_FRAMES, 32, 32, 3)

    train.main(["video", "--batch-size", "2", "--work-dir", str(tmp_path / "work2"),
                "--export", str(tmp_path / "out2"), "--steps", "1",
                "--init-from", str(out / "shapes-video")])
    assert "starting video from the exported weights" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not shaped like"):
        train.main(["image", "--batch-size", "2", "--work-dir", str(tmp_path / "work3"),
                    "--steps", "1", "--init-from", str(out / "shapes-video")])


def test_image_model_takes_the_step_cache(http):
    """shapes-image is an SD3 MMDiT too: cached steps keep what the scorer reads."""
    scene = IMAGE_SCENES[0]
    body = {"model": "shapes-image", "prompt": scene.prompt(), "size": "32x32", "seed": 100,
            "num_inference_steps": 16, "response_format": "b64_json"}
    plain = http.post("/v1/images/generations", json=body)
    cached = http.post("/v1/images/generations",
                       json={**body, "step_cache": {"residual_diff_threshold": 0.3}})
    assert plain.status_code == 200 and cached.status_code == 200, cached.text
    assert plain.json()["cached_steps"] == 0 and 0 < cached.json()["cached_steps"] < 16
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
              for r in (plain, cached)]
    # The plain picture draws the prompt (scored), so the cached one matching it is a real check:
    # two failed pictures would also have equal scores.
    plain_scores = scorer.score_image(images[0], scene)
    assert plain_scores["all"], plain_scores
    assert scorer.score_image(images[1], scene) == plain_scores
