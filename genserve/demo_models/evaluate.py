"""Evaluate a demo model on prompts it never saw in training, with the scorer.

    python -m genserve.demo_models.evaluate image            # the committed weights
    python -m genserve.demo_models.evaluate video --steps 8 --json out.json
    python -m genserve.demo_models.evaluate image --scorer-only   # the scorer on clean renders

Prints per-attribute accuracy, per-output latency and (images) the step-cache speedup and PSNR
against the uncached output at `--cache-threshold`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from genserve.demo_models import scorer, world
from genserve.demo_models.models import KINDS, weights_path


def load(kind: str, path: str | None = None, dtype: str = "float32"):
    """The exported demo pipeline of `kind` (float32 on CPU by default)."""
    import torch

    from genserve.demo_models.pipeline import ShapesImagePipeline, ShapesVideoPipeline

    cls = ShapesVideoPipeline if kind == "video" else ShapesImagePipeline
    pipe = cls.from_pretrained(path or weights_path(kind), torch_dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, scenes: list[world.Scene], steps: int, guidance: float, seed: int,
             batch_size: int = 20) -> list[np.ndarray]:
    """uint8 outputs ([H, W, 3] or [F, H, W, 3]) for `scenes`, seed `seed + i` for scene i."""
    import torch

    outs: list[np.ndarray] = []
    for i in range(0, len(scenes), batch_size):
        chunk = scenes[i : i + batch_size]
        gens = [torch.Generator().manual_seed(seed + i + j) for j in range(len(chunk))]
        res = pipe([s.prompt() for s in chunk], num_inference_steps=steps,
                   guidance_scale=guidance, generator=gens, output_type="np")
        outs.extend(res.frames)
    return outs


def score(outputs: list[np.ndarray], scenes: list[world.Scene]) -> dict[str, float]:
    fn = scorer.score_video if scenes[0].is_video else scorer.score_image
    return scorer.summarize([fn(o, s) for o, s in zip(outputs, scenes)])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def scorer_only(kind: str, count: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    video = kind == "video"
    scenes = world.all_scenes(video)
    picks = [scenes[i % len(scenes)] for i in range(count)]
    outs = [world.render_video(s, rng) if video else world.render_image(s, rng) for s in picks]
    return score(outs, picks)


def step_cache_report(kind: str, path: str | None, scenes, steps: int, guidance: float,
                      threshold: float) -> dict[str, float]:
    """Denoising time and PSNR with cache-dit DBCache vs without, one output at a time."""
    import torch

    from genserve.demo_models.family import ShapesImageFamily
    from genserve.multimodal_gen.messages import StepCacheConfig
    from genserve.multimodal_gen.step_cache import make_step_cache

    pipe = load(kind, path)
    # The served family's block adapter (cache-dit does not know these pipelines by name).
    cache = make_step_cache("dbcache", pipe.transformer, ShapesImageFamily.cache_blocks)
    off = StepCacheConfig(enabled=False)
    on = StepCacheConfig(enabled=True, residual_diff_threshold=threshold, fn=1, bn=0)
    times = {"off": 0.0, "on": 0.0}
    psnrs, cached = [], []
    for i, scene in enumerate(scenes):
        outs = {}
        for name, cfg in (("off", off), ("on", on)):
            cache.configure(cfg, steps, separate_cfg=False)
            t0 = time.perf_counter()
            res = pipe(scene.prompt(), num_inference_steps=steps, guidance_scale=guidance,
                       generator=torch.Generator().manual_seed(i), output_type="np")
            times[name] += time.perf_counter() - t0
            outs[name] = res.frames[0]
            if name == "on":
                cached.append(cache.cached_steps())
        psnrs.append(psnr(outs["on"], outs["off"]))
    return {"threshold": threshold, "speedup": times["off"] / times["on"],
            "psnr_db": float(np.mean(psnrs)), "cached_steps_mean": float(np.mean(cached)),
            "steps": steps}


def save_grid(outputs: list[np.ndarray], path: str, columns: int = 10, scale: int = 4) -> None:
    """Outputs side by side (a video shows its first, two middle and last frames)."""
    from PIL import Image

    tiles = []
    for out in outputs:
        if out.ndim == 4:
            idx = np.linspace(0, len(out) - 1, 4).round().astype(int)
            out = np.concatenate([out[i] for i in idx], axis=1)
        tiles.append(out)
    while len(tiles) % columns:
        tiles.append(np.zeros_like(tiles[0]))
    rows = [np.concatenate(tiles[i : i + columns], axis=1) for i in range(0, len(tiles), columns)]
    grid = np.concatenate(rows, axis=0)
    h, w = grid.shape[:2]
    Image.fromarray(grid).resize((w * scale, h * scale), Image.NEAREST).save(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--path", default=None, help="diffusers folder (default: committed weights)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance (default: the model's default)")
    p.add_argument("--count", type=int, default=60, help="held-out prompts to score")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="also report DBCache speedup and PSNR at this threshold")
    p.add_argument("--scorer-only", action="store_true",
                   help="score the generator's own clean renders instead of a model")
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument("--grid", default=None,
                   help="save the outputs as one PNG (videos: 4 frames each), scaled 4x")
    args = p.parse_args(argv)

    from genserve.demo_models.models import DEFAULT_GUIDANCE

    report: dict = {"kind": args.kind}
    if args.scorer_only:
        report["scorer_on_clean_renders"] = scorer_only(args.kind, max(args.count, 500))
    else:
        import torch

        guidance = DEFAULT_GUIDANCE[args.kind] if args.guidance is None else args.guidance
        scenes = world.held_out(args.kind == "video", args.count)
        pipe = load(args.kind, args.path)
        generate(pipe, scenes[:1], args.steps, guidance, args.seed)  # warm-up
        t0 = time.perf_counter()
        outs = generate(pipe, scenes, args.steps, guidance, args.seed)
        elapsed = time.perf_counter() - t0
        if args.grid:
            save_grid(outs, args.grid, columns=3 if args.kind == "video" else 10)
        report.update(steps=args.steps, guidance=guidance, prompts=len(scenes),
                      threads=torch.get_num_threads(),
                      accuracy=score(outs, scenes),
                      ms_per_output_batched=elapsed / len(scenes) * 1e3)
        t0 = time.perf_counter()
        generate(pipe, scenes[:5], args.steps, guidance, args.seed, batch_size=1)
        report["ms_per_output_alone"] = (time.perf_counter() - t0) / 5 * 1e3
        if args.cache_threshold is not None:
            report["step_cache"] = step_cache_report(args.kind, args.path, scenes[:10],
                                                     max(args.steps, 16), guidance,
                                                     args.cache_threshold)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
