"""Score `shapes-stream` on held-out prompts and switch schedules, through the served family.

    python -m genserve.demo_models.stream_evaluate --streams 12 --frames 306

Each stream follows a schedule: a held-out scene (`world.held_out`), then switches to other
held-out scenes at chunk boundaries. Frames are read with the same image statistics as
`scorer.py` (background, shape by template IoU; colour by the median of the shape's pixels),
after rolling each frame so the shape sits in the middle (on the torus it may be drawn across
the border). Reported:

- colour / shape / background: share of frames right, not counting the `SWITCH_GRACE` frames
  after a switch (that is what the switch latency measures);
- continuity: the largest step of the shape's centre between consecutive frames (torus
  distance, as a share of the width) and how many steps exceed 1/8 of the width (a scene reset);
- direction: share of schedule segments whose net travel goes the prompt's way, over the
  segments with at least `HOLD` frames after the grace (two switches in consecutive chunks
  leave a segment too short to show a direction);
- switch latency: frames from a switch until colour, background and shape read right for
  `HOLD` frames in a row, within the segment the switch opens (the worst and mean over
  switches); a switch whose attributes never hold that long before the next one counts as the
  segment's length.

`score_stream` is pure numpy; `run_streams` drives the served `ShapesStreamFamily` chunk by chunk
as the realtime path does.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

import numpy as np

from genserve.demo_models import scorer, stream_world, world

SWITCH_GRACE = 8
HOLD = 8
MAX_STEP = 1 / 8  # of the width, between consecutive frames


@dataclass
class Schedule:
    """Scenes of one stream: scenes[i] from frame starts[i] on (starts[0] == 0)."""

    scenes: list[world.Scene]
    starts: list[int]

    def scene_at(self, frame: int) -> world.Scene:
        i = max(j for j, s in enumerate(self.starts) if s <= frame)
        return self.scenes[i]


def held_out_schedules(count: int, frames: int, chunk: int, switches: int = 2,
                       seed: int = 99) -> list[Schedule]:
    """`count` schedules over held-out scenes; each switches `switches` times at chunk
    boundaries, each switch changing at least one attribute."""
    rng = random.Random(seed)
    scenes = world.held_out(video=True)
    chunks = frames // chunk
    out = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(2, chunks - 1), switches)) if switches else []
        picks = [rng.choice(scenes)]
        for _ in cuts:
            picks.append(rng.choice([s for s in scenes if s != picks[-1]]))
        out.append(Schedule(picks, [0] + [c * chunk for c in cuts]))
    return out


@dataclass
class FrameReading:
    background: str
    colour: str | None
    shape: str | None
    centre: tuple[float, float] | None


def read_frame(frame: np.ndarray) -> FrameReading:
    """What the scorer sees in one frame (uint8 [H, W, 3]) of a torus world."""
    img = frame.astype(np.float32)
    background = scorer._nearest(np.median(img.reshape(-1, 3), axis=0), world.BACKGROUNDS)
    dist = np.linalg.norm(img - np.array(world.BACKGROUNDS[background], np.float32), axis=-1)
    mask = dist > scorer.FG_DISTANCE
    if mask.sum() < scorer.MIN_FG_PIXELS:
        return FrameReading(background, None, None, None)
    centre = stream_world.circular_centroid(mask.astype(np.float32))
    h, w = mask.shape
    # Roll the shape to the middle so a shape across the border reads whole.
    rolled = np.roll(frame, (h // 2 - int(centre[1]), w // 2 - int(centre[0])), axis=(0, 1))
    r = scorer.read_image(rolled)
    # The colour is the median of the shape's pixels, not their mean: the edges of a frame
    # upscaled from 32x32 blend the colour into the background, and their mean takes a yellow
    # shape on black for an orange one.
    colour = scorer._nearest(np.median(img[mask], axis=0), world.COLOURS)
    return FrameReading(background, colour, r.shape, centre)


def score_stream(frames: np.ndarray, schedule: Schedule) -> dict:
    """Scores of one stream's frames (uint8 [N, H, W, 3]) against its schedule."""
    n, h, w, _ = frames.shape
    readings = [read_frame(f) for f in frames]
    right = {"colour": [], "shape": [], "background": []}
    for i, r in enumerate(readings):
        if any(0 < i - s < SWITCH_GRACE or i == s for s in schedule.starts[1:]):
            continue
        scene = schedule.scene_at(i)
        right["colour"].append(r.colour == scene.colour)
        right["shape"].append(r.shape == scene.shape)
        right["background"].append(r.background == scene.background)
    steps, resets = [], 0
    for a, b in zip(readings[:-1], readings[1:]):
        if a.centre is None or b.centre is None:
            resets += 1
            steps.append(1.0)
            continue
        d = np.hypot(stream_world.torus_delta(a.centre[0], b.centre[0], w),
                     stream_world.torus_delta(a.centre[1], b.centre[1], h)) / w
        steps.append(float(d))
        resets += d > MAX_STEP
    directions = []
    bounds = schedule.starts[1:] + [n]
    for scene, start, end in zip(schedule.scenes, schedule.starts, bounds):
        lo = start + (SWITCH_GRACE if start else 0)
        if end - lo < HOLD:
            continue  # too short to travel measurably
        travel = np.zeros(2)
        for a, b in zip(readings[lo:end - 1], readings[lo + 1:end]):
            if a.centre is not None and b.centre is not None:
                travel += (stream_world.torus_delta(a.centre[0], b.centre[0], w),
                           stream_world.torus_delta(a.centre[1], b.centre[1], h))
        dx, dy = world.DIRECTIONS[scene.direction]
        along = travel[0] * dx + travel[1] * dy
        across = abs(travel[0] * dy) + abs(travel[1] * dx)
        directions.append(bool(along > 0.1 * w and along > 2 * across))
    latencies = []
    for start, end in zip(schedule.starts[1:], bounds[1:]):
        scene = schedule.scene_at(start)
        ok = [r.colour == scene.colour and r.background == scene.background
              and r.shape == scene.shape for r in readings[start:end]]
        latency = next((i for i in range(len(ok) - HOLD + 1) if all(ok[i:i + HOLD])), len(ok))
        latencies.append(latency)
    return {"colour": right["colour"], "shape": right["shape"],
            "background": right["background"], "steps": steps, "resets": resets,
            "directions": directions, "latencies": latencies}


def summarize(scores: list[dict]) -> dict[str, float]:
    """Pooled figures over streams."""
    def pool(key):
        return [v for s in scores for v in s[key]]
    lat = pool("latencies")
    return {
        "colour": float(np.mean(pool("colour"))), "shape": float(np.mean(pool("shape"))),
        "background": float(np.mean(pool("background"))),
        "direction": float(np.mean(pool("directions"))),
        "max_step": float(max(pool("steps"))), "resets": int(sum(s["resets"] for s in scores)),
        "switch_latency_max": int(max(lat)) if lat else 0,
        "switch_latency_mean": float(np.mean(lat)) if lat else 0.0,
        "streams": len(scores), "frames": len(pool("steps")) + len(scores),
    }


def run_streams(model, schedules: list[Schedule], frames: int, seed: int = 0,
                steps: int | None = None, size: int = stream_world.SIZE,
                guidance: float | None = None) -> list[np.ndarray]:
    """Frames uint8 [frames, size, size, 3] of each schedule from the served family, all
    streams advancing together (one batched chunk per step, as the worker batches them);
    `guidance` > 1 is classifier-free guidance against the empty prompt (default: the
    model's)."""
    from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig

    chunk = model.chunk_frames
    spec = model.spec
    streams = [model.new_stream(seed + i, size, size) for i in range(len(schedules))]
    out: list[list[np.ndarray]] = [[] for _ in schedules]
    for k in range(frames // chunk):
        batch = [ResolvedRequest(
            rid=f"eval-{i}-{k}", model=spec.name, prompt=s.scene_at(k * chunk).prompt(),
            negative_prompt=None, width=size, height=size, num_frames=chunk, fps=24,
            num_inference_steps=steps or spec.default_steps,
            guidance_scale=spec.default_guidance if guidance is None else guidance,
            seeds=(seed + i,), step_cache=StepCacheConfig(), preview=False,
            preview_decode_every=0, init_image=None, strength=None, submitted_at=time.time(),
            stream_id=f"eval-{i}", stream_reset=k == 0) for i, s in enumerate(schedules)]
        result = model.generate(batch, streams=streams)
        for i, clip in enumerate(result.frames):
            out[i].append(clip)
    return [np.concatenate(parts) for parts in out]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="shapes-stream", help="named model or folder")
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--frames", type=int, default=306)
    p.add_argument("--switches", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (1: none; default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write the first stream as an MP4 here")
    args = p.parse_args(argv)
    from genserve.multimodal_gen.pipelines import load_model

    model = load_model(args.model, name="shapes-stream")
    schedules = held_out_schedules(args.streams, args.frames, model.chunk_frames, args.switches)
    t0 = time.perf_counter()
    videos = run_streams(model, schedules, args.frames, args.seed, args.steps,
                         guidance=args.guidance)
    seconds = time.perf_counter() - t0
    summary = summarize([score_stream(v, s) for v, s in zip(videos, schedules)])
    summary["frames_per_s_batched"] = round(len(videos) * videos[0].shape[0] / seconds, 1)
    print(json.dumps(summary, indent=2))
    if args.save:
        import imageio.v3 as iio

        iio.imwrite(args.save, np.repeat(np.repeat(videos[0], 4, 1), 4, 2), fps=24)


if __name__ == "__main__":
    main()
