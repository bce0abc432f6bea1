"""Train a demo model on the procedural shapes world and export it as a diffusers folder.

    # the recipes of the committed models; the image run was 10 min, then resumed for 35 more
    # with the learning rate decaying (6,627 steps in all)
    python -m genserve.demo_models.train image --minutes 10 --batch-size 32 \
        --loss-min-sigma 1.0 --uniform-sigma 0.3
    python -m genserve.demo_models.train image --minutes 35 --batch-size 32 \
        --loss-min-sigma 1.0 --uniform-sigma 0.3 --cosine
    python -m genserve.demo_models.train video --minutes 40 --batch-size 16 \
        --loss-min-sigma 1.0 --uniform-sigma 0.3

Rectified flow in pixel space: x_s = (1 - s) x0 + s noise; the transformer predicts x0 itself or
the velocity noise - x0 (see `models.PREDICTION`); s is drawn logit-normal, or uniformly for
a `--uniform-sigma` share. Prompts are dropped 10% of the time so classifier-free
guidance works, and shape pixels weigh more than background pixels in the loss (they are a small
part of the frame but all of the meaning). The text encoder trains jointly. An exponential moving
average of the weights is what gets exported.

Runs until `--steps` or the wall-time budget `--minutes`, whichever comes first, with a progress
bar; a checkpoint is written every `--checkpoint-minutes` and at the end, and a later run with
the same `--work-dir` resumes from it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from genserve.demo_models import world
from genserve.demo_models.models import KINDS, MODEL_NAMES, build_pipeline
from genserve.demo_models.training import TrainingRun, parse_and_train, seed_and_work_dir

FG_WEIGHT = 4.0
PROMPT_DROPOUT = 0.1


def make_batch(kind: str, scenes: list[world.Scene], size: int, rng: random.Random,
               nrng: np.random.Generator) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """(pixels in [-1, 1] [B, 3F, 32, 32], prompts, foreground mask [B, 1, 32, 32])."""
    pics, prompts, masks = [], [], []
    for _ in range(size):
        scene = scenes[rng.randrange(len(scenes))]
        if kind == "video":
            frames = world.render_video(scene, nrng)  # [F, H, W, 3]
        else:
            frames = world.render_image(scene, nrng)[None]
        bg = np.array(world.BACKGROUNDS[scene.background], np.int16)
        fg = (np.abs(frames.astype(np.int16) - bg).max(axis=-1) > 8).any(axis=0)
        pics.append(frames.transpose(0, 3, 1, 2).reshape(-1, *frames.shape[1:3]))
        masks.append(fg)
        prompts.append("" if rng.random() < PROMPT_DROPOUT else scene.prompt())
    x = torch.from_numpy(np.stack(pics)).float() / 127.5 - 1.0
    m = torch.from_numpy(np.stack(masks)).float()[:, None]
    return x, prompts, m


def sample_sigmas(b: int, uniform_frac: float) -> torch.Tensor:
    """Noise levels: logit-normal (most weight mid-way), a `uniform_frac` share uniform (so the
    low-noise end, where edges are decided, is trained too)."""
    sigma = torch.sigmoid(torch.randn(b))
    uniform = torch.rand(b) < uniform_frac
    return torch.where(uniform, torch.rand(b).clamp(1e-3, 1.0), sigma)


def train(args: argparse.Namespace) -> Path:
    kind = args.kind
    work = seed_and_work_dir(args.seed, Path(args.work_dir) / MODEL_NAMES[kind])
    pipe = build_pipeline(kind)
    modules = torch.nn.ModuleDict({"text_encoder": pipe.text_encoder,
                                   "transformer": pipe.transformer})
    opt = torch.optim.AdamW(modules.parameters(), lr=args.lr, weight_decay=0.0,
                            betas=(0.9, 0.99))
    run = TrainingRun(args, work, modules, opt)
    if run.resume():
        print(f"resumed {kind} from {run.path} at step {run.step}")
    elif args.init_from:
        _load_exported(pipe, args.init_from)
        run.ema.load_state_dict(modules.state_dict())
        print(f"starting {kind} from the exported weights in {args.init_from}")
    rng, nrng = run.rng, np.random.default_rng(args.seed + run.step)
    n_params = sum(p.numel() for p in modules.parameters())
    print(f"training {MODEL_NAMES[kind]}: {n_params / 1e6:.2f}M parameters, batch "
          f"{args.batch_size}, budget {args.minutes} min / {args.steps} steps")
    scenes = world.training_scenes(kind == "video")

    run.begin(f"train {MODEL_NAMES[kind]}")
    loss_avg = None
    modules.train()
    while run.going():
        x0, prompts, fg = make_batch(kind, scenes, args.batch_size, rng, nrng)
        b = x0.shape[0]
        sigma = sample_sigmas(b, args.uniform_sigma)
        noise = torch.randn_like(x0)
        s = sigma.view(b, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        emb, mask = pipe.encode_prompt(prompts, torch.device("cpu"))
        weight = 1.0 + (FG_WEIGHT - 1.0) * fg
        if pipe.config.prediction == "sample":
            # The velocity error is the picture error over sigma; capping 1/sigma keeps the
            # nearly clean samples from drowning out the layout the noisy ones teach.
            out = pipe.raw_output(xt, sigma, emb, mask)
            err = (out - x0) / s.clamp(min=args.loss_min_sigma)
        else:
            err = pipe.predict(xt, sigma, emb, mask) - (noise - x0)
        loss = (weight * err**2).mean()
        run.set_lr()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        run.finish_step(loss=f"{loss_avg:.4f}")
    run.end()
    print(f"stopped at step {run.step} after {run.minutes:.1f} min; "
          f"loss {loss_avg if loss_avg is not None else float('nan'):.4f}")
    return export(pipe, run.ema, Path(args.export) / MODEL_NAMES[kind], args.fp16)


def _load_exported(pipe, folder: str) -> None:
    """Start from a diffusers folder this script exported (e.g. the committed weights): the
    optimizer state is not in it, so this is fine-tuning, not resuming."""
    from genserve.demo_models.pipeline import ShapesPipeline

    src = ShapesPipeline.from_pretrained(folder)
    for name in ("text_encoder", "transformer"):
        mine, theirs = getattr(pipe, name).state_dict(), getattr(src, name).state_dict()
        if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
            raise SystemExit(f"--init-from {folder}: its {name} is not shaped like this "
                             f"model's (models.py changed?); train from scratch")
        getattr(pipe, name).load_state_dict({k: v.float() for k, v in theirs.items()})


def export(pipe, ema: torch.nn.ModuleDict, out: Path, fp16: bool) -> Path:
    """Write the EMA weights as a diffusers folder (fp16 tensors when `fp16`)."""
    pipe.text_encoder.load_state_dict(ema["text_encoder"].state_dict())
    pipe.transformer.load_state_dict(ema["transformer"].state_dict())
    pipe.text_encoder.eval()
    pipe.transformer.eval()
    if fp16:
        pipe = pipe.to(torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    # transformers 5 records its tokenizer class as TokenizersBackend, which 4.x lacks; the
    # PreTrainedTokenizerFast name loads the same tokenizer.json under both.
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    print(f"exported {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    from genserve.demo_models.models import WEIGHTS_DIR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--minutes", type=float, default=45.0, help="wall-time budget")
    p.add_argument("--steps", type=int, default=None, help="step budget (default: none)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--cosine", action="store_true",
                   help="decay the learning rate to zero over this run's budget (a final run)")
    p.add_argument("--loss-min-sigma", type=float, default=0.3,
                   help="clean-picture models: cap the 1/sigma loss weight at this sigma")
    p.add_argument("--uniform-sigma", type=float, default=0.0,
                   help="share of noise levels drawn uniformly instead of logit-normal")
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="demo_train", help="checkpoints (resumed from)")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--init-from", default=None,
                   help="without a checkpoint, start from this exported diffusers folder "
                        "(e.g. the committed weights) instead of random weights")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--export", default=str(WEIGHTS_DIR), help="folder for the diffusers export")
    p.add_argument("--no-fp16", dest="fp16", action="store_false",
                   help="export float32 weights instead of float16")
    parse_and_train(p, argv, train)


if __name__ == "__main__":
    main()
