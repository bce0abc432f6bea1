"""Train `shapes-stream` on the endless shapes world and export it as a diffusers folder.

    # the recipe under way (docs/benchmarks.md has the runs' figures; it resumes across runs)
    python -m genserve.demo_models.stream_train --minutes 30 --batch-size 24 --lr 8e-4
    python -m genserve.demo_models.stream_train --minutes 50 --batch-size 24 --lr 8e-4 \
        --cosine --first-frac 0.4 --grid-frac 0.6 --rollout-frac 0.15

Each example is one chunk of a stream: the frames before it (up to the history window, zeros
before the video starts), the video's first frame (the prefix Helios keeps), and the chunk's
prompt. `--first-frac` of the examples open a video (no history; the shape starts in the centre,
`stream_world.StreamState.start`): that chunk is drawn from the prompt alone, the hardest one to
learn. The chunk's scene changes from the history's with `--switch-prob` (a prompt switch:
position and size continue, everything the prompt says changes). Rectified flow on the packed
pixels: x_s = (1 - s) x0 + s noise, s drawn uniformly or from the serving step grids; the loss
is on the clean chunk, whatever the transformer's output means (`--prediction`: the clean chunk
itself, the velocity, or EDM's skip mix; `stream_model.Parameterization`, saved in the export).
Shape pixels weigh more in the loss, and with `--shape-weight` so do the latent values that
tell the shapes apart (the distance from the same chunk drawn with each other shape): a blob
half-way between a circle and a square costs little in a plain MSE, the corners being a few
pixels, and that is what a few-step sampler draws from high noise. `--contrast-weight` weighs
the chunks of a faint colour on its background more (purple on gray, whose shapes differ least
in the latents; `stream_world.contrast_weight`). A run may change
`--prediction` when it resumes (a fine-tune into the new parameterization); export with the
flag the run trained with.

Self-continuation: with `--rollout-frac`, that share of the examples replaces its last history
chunk with the model's own sample (EMA weights, the serving step count), reads where its shape
actually ended up (`stream_world.circular_centroid`), and trains the next chunk to continue from
there. The model so learns to continue its own output, not only clean history, and long streams
do not drift. History is also noised a little in half of the examples.

With `--autoencoder DIR` (a folder `stream_ae.py` exported) the run denoises that
autoencoder's latents instead of pixels: frames are encoded (frozen, bf16) as the batch is
built, and the exported folder carries the autoencoder as its `vae`.

Resumable (`training.TrainingRun`): a checkpoint every `--checkpoint-minutes` and at the end;
the EMA weights are exported to `--out`. Without a checkpoint, `--init DIR` starts from an
exported folder's weights (the shipped model, say) with a fresh optimizer, warm-up and cosine:

    W=genserve/demo_models/weights/shapes-stream
    python -m genserve.demo_models.stream_train --init $W --autoencoder $W/vae \
        --prediction edm --shape-weight 8 --cosine --lr 4e-4 --minutes 100 --guidance 1.5 \
        --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import numpy as np
import torch

from genserve.demo_models import scorer, stream_world, world
from genserve.demo_models.models import STREAM_WEIGHTS_PATH
from genserve.demo_models.stream_model import (
    DEFAULT_STEPS,
    FRAMES_PER_CHUNK,
    HISTORY_SIZES,
    MIN_SIGMA,
    MODEL_SIZE,
    PREDICTIONS,
    Parameterization,
    build_stream_pipeline,
    encode_prompts,
    history_inputs,
    predict_clean,
)
from genserve.demo_models.training import TrainingRun, parse_and_train, seed_and_work_dir

FG_WEIGHT = 4.0
PROMPT_DROPOUT = 0.1
WINDOW = sum(HISTORY_SIZES)
SERVING_SIGMAS = (0.999, 0.666, 0.333, 0.4995)  # the 3- and 2-step grids the family uses


def _to_tensor(frames: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> [3, F, H, W] in [-1, 1]."""
    return torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0


def _window(frames: torch.Tensor) -> torch.Tensor:
    """The last WINDOW frames of [3, F, H, W], zero-filled in front."""
    f = frames.shape[1]
    if f >= WINDOW:
        return frames[:, f - WINDOW :]
    pad = torch.zeros(frames.shape[0], WINDOW - f, *frames.shape[2:])
    return torch.cat([pad, frames], dim=1)


class Example:
    """One training chunk before packing (pixels [3, F, 32, 32] in [-1, 1])."""

    def __init__(
        self,
        rng: random.Random,
        nrng: np.random.Generator,
        scenes: list[world.Scene],
        switch_prob: float,
        rollout: bool,
        first_frac: float = 0.25,
    ):
        # k: chunks of the video before this one (0: this chunk opens the video).
        if rollout:
            k = rng.choice([1, 2, 3, 4])
        else:
            k = 0 if rng.random() < first_frac else rng.choice([1, 2, 3, 3, 4, 4])
        chunks = min(k, 3 + rollout)  # history chunks rendered (enough to fill the window)
        # Scenes chunk by chunk, from the target back: each earlier chunk keeps its
        # successor's scene unless the prompt switched between them.
        plan = [scenes[rng.randrange(len(scenes))]]
        for _ in range(chunks):
            plan.insert(
                0, plan[0] if rng.random() >= switch_prob else scenes[rng.randrange(len(scenes))]
            )
        started = k == chunks  # the first chunk drawn is the video's first
        state = (
            stream_world.StreamState.start() if started else stream_world.StreamState.random(nrng)
        )
        per_frame = [s for s in plan[:-1] for _ in range(FRAMES_PER_CHUNK)]
        if per_frame:
            past, state = stream_world.render(per_frame, state, MODEL_SIZE)
            self.past = _to_tensor(past)
        else:
            self.past = torch.zeros(3, 0, MODEL_SIZE, MODEL_SIZE)
        if k == chunks and chunks > 0:
            self.prefix = self.past[:, :1]  # the video started with the first chunk drawn
        elif k == 0:
            self.prefix = torch.zeros(3, 1, MODEL_SIZE, MODEL_SIZE)
        else:  # the video started long ago, maybe under another prompt
            early = plan[0] if rng.random() < 0.5 else scenes[rng.randrange(len(scenes))]
            far, _ = stream_world.render([early], stream_world.StreamState.random(nrng), MODEL_SIZE)
            self.prefix = _to_tensor(far)
        self.plan, self.state = plan, state
        self.started = started
        self.target_scene = plan[-1]
        self.target, _ = stream_world.render([plan[-1]] * FRAMES_PER_CHUNK, state, MODEL_SIZE)
        self.prompt = plan[-1].prompt()

    def retarget(self, generated: np.ndarray) -> None:
        """The last history chunk is now `generated` (uint8 [9, H, W, 3]): continue from where
        its shape is in its last frame."""
        self.past = torch.cat([self.past[:, :-FRAMES_PER_CHUNK], _to_tensor(generated)], dim=1)
        if self.started and self.past.shape[1] == FRAMES_PER_CHUNK:
            self.prefix = self.past[:, :1]  # the generated chunk opened the video
        bg = np.array(world.BACKGROUNDS[self.plan[-2].background], np.float32)
        dist = np.linalg.norm(generated[-1].astype(np.float32) - bg, axis=-1)
        centre = stream_world.circular_centroid((dist > scorer.FG_DISTANCE).astype(np.float32))
        if centre is not None:
            scale = stream_world.SIZE / MODEL_SIZE  # states are in SIZE pixels
            self.state = stream_world.StreamState(
                centre[0] * scale, centre[1] * scale, self.state.r
            )
            self.target, _ = stream_world.render(
                [self.target_scene] * FRAMES_PER_CHUNK, self.state, MODEL_SIZE
            )

    def other_shapes(self) -> list[np.ndarray]:
        """The target chunk drawn with each other shape of the grammar (same place, colour,
        background and motion): what the chunk would be had the prompt named another shape."""
        return [
            stream_world.render(
                [dataclasses.replace(self.target_scene, shape=shape)] * FRAMES_PER_CHUNK,
                self.state,
                MODEL_SIZE,
            )[0]
            for shape in world.SHAPES
            if shape != self.target_scene.shape
        ]


def _batch_inputs(pipe, examples: list[Example], before_last: bool = False):
    """Packed history inputs of `examples`; `before_last` builds the window that made their
    last history chunk instead (for roll-outs)."""
    hist, pre = [], []
    for ex in examples:
        past = ex.past[:, :-FRAMES_PER_CHUNK] if before_last else ex.past
        hist.append(_window(past))
        opening = before_last and ex.started and past.shape[1] == 0
        pre.append(torch.zeros_like(ex.prefix) if opening else ex.prefix)
    return _pack(pipe, torch.stack(hist)), _pack(pipe, torch.stack(pre))


@torch.no_grad()
def _pack(pipe, frames: torch.Tensor) -> torch.Tensor:
    """Training's latents of pixel frames; an autoencoder encodes under bf16 autocast (about
    half the time of fp32 on CPUs with bf16 units, and the encoder is most of a step)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pipe.vae is not None):
        return pipe.pack(frames).float()


@torch.no_grad()
def sample_chunks(
    pipe,
    model,
    prompts: list[str],
    history: torch.Tensor,
    prefix: torch.Tensor,
    steps: int,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    autocast: bool = False,
) -> torch.Tensor:
    """Euler sampling of one chunk per row on the serving family's step grid (the same
    sigmas and x-to-velocity rule, so a roll-out is what serving would draw), from `noise` or
    fresh noise of `generator`; packed latents [B, C, 9, h, w]."""
    b = history.shape[0]
    embeds = _encode(model, pipe, prompts)
    inputs = history_inputs(history, prefix)
    x = (
        noise
        if noise is not None
        else torch.randn(
            b, history.shape[1], FRAMES_PER_CHUNK, *history.shape[3:], generator=generator
        )
    )
    sigmas = list(np.linspace(0.999, 0.0, steps + 1))
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((b,), s * 1000.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            clean = predict_clean(
                model["transformer"], x, t, embeds, inputs, pipe.parameterization
            ).float()
        v = (x - clean) / max(s, MIN_SIGMA)
        x = x + (s_next - s) * v
    return x


def _encode(model, pipe, prompts: list[str]) -> torch.Tensor:
    return encode_prompts(pipe.tokenizer, model["text_encoder"], prompts)


def _fg_weight(pipe, target: torch.Tensor, scenes: list[world.Scene]) -> torch.Tensor:
    """1 on background pixels, FG_WEIGHT on shape pixels; packed like the latents (with an
    autoencoder: FG_WEIGHT on every latent pixel whose patch the shape touches)."""
    bgs = torch.tensor([world.BACKGROUNDS[s.background] for s in scenes], dtype=torch.float32)
    bgs = (bgs / 127.5 - 1.0).view(-1, 3, 1, 1, 1)
    fg = ((target - bgs).abs().amax(dim=1, keepdim=True) > 0.2).float()
    if pipe.vae is not None:
        channels, side = pipe.latent_shape
        k = target.shape[-1] // side
        fg = torch.nn.functional.max_pool3d(fg, (1, k, k))
        return (1.0 + (FG_WEIGHT - 1.0) * fg).expand(-1, channels, -1, -1, -1)
    w = 1.0 + (FG_WEIGHT - 1.0) * fg
    return pipe.pack(w.expand(-1, 3, -1, -1, -1).contiguous())


def _shape_weight(pipe, x0: torch.Tensor, examples: list[Example]) -> torch.Tensor:
    """Per latent value [B, C, F, h, w]: how far the target is from the same chunk drawn with
    each other shape (`Example.other_shapes`), summed. Large exactly where the latents say
    which shape it is (a square's corners, a triangle's slopes), and zero on the background
    and in the shape's middle, which every shape shares."""
    others = [torch.stack([_to_tensor(c) for c in ex.other_shapes()]) for ex in examples]
    alt = _pack(pipe, torch.cat(others))
    alt = alt.view(len(examples), len(others[0]), *x0.shape[1:])
    return (alt - x0.unsqueeze(1)).abs().sum(1)


def train(args: argparse.Namespace) -> None:
    work = seed_and_work_dir(args.seed, Path(args.work_dir))
    pipe = build_stream_pipeline(
        _load_autoencoder(args.autoencoder), Parameterization(args.prediction, args.sigma_data)
    )
    model = torch.nn.ModuleDict(
        {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder}
    )
    if args.init:
        _load_exported(model, Path(args.init))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    run = TrainingRun(args, work, model, opt)
    if run.resume():
        print(f"resumed at step {run.step}")
    if args.export_only:
        export(pipe, run.ema, Path(args.out), args.guidance)
        return
    scenes = world.training_scenes(video=True)
    nrng = np.random.default_rng(args.seed + run.step)
    gen = torch.Generator().manual_seed(args.seed + run.step)
    run.begin("train shapes-stream")
    while run.going():
        rng = run.rng
        n_roll = int(round(args.batch_size * args.rollout_frac))
        examples = [
            Example(
                rng, nrng, scenes, args.switch_prob, rollout=i < n_roll, first_frac=args.first_frac
            )
            for i in range(args.batch_size)
        ]
        if n_roll:
            rolls = examples[:n_roll]
            h, p = _batch_inputs(pipe, rolls, before_last=True)
            made = sample_chunks(
                pipe,
                run.ema,
                [ex.plan[-2].prompt() for ex in rolls],
                h,
                p,
                args.rollout_steps,
                gen,
                autocast=args.bf16,
            )
            with torch.no_grad():
                made = pipe.unpack(made)
            pix = ((made.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
            for ex, clip in zip(rolls, pix.permute(0, 2, 3, 4, 1).numpy()):
                ex.retarget(clip)
        history, prefix = _batch_inputs(pipe, examples)
        if args.history_noise > 0:
            noisy = torch.rand(len(examples)) < 0.5
            scale = torch.rand(len(examples)) * args.history_noise * noisy
            history = history + scale.view(-1, 1, 1, 1, 1) * torch.randn_like(history)
        target_pix = torch.stack([_to_tensor(ex.target) for ex in examples])
        x0 = _pack(pipe, target_pix)
        weight = _fg_weight(pipe, target_pix, [ex.target_scene for ex in examples])
        if args.shape_weight > 0:
            weight = weight + args.shape_weight * _shape_weight(pipe, x0, examples)
        if args.contrast_weight > 0:
            faint = [
                stream_world.contrast_weight(ex.target_scene, args.contrast_weight)
                for ex in examples
            ]
            weight = weight * torch.tensor(faint).view(-1, 1, 1, 1, 1)
        b = x0.shape[0]
        sigma = torch.rand(b)
        grid = torch.rand(b) < args.grid_frac
        picks = torch.randint(len(SERVING_SIGMAS), (int(grid.sum()),))
        sigma[grid] = torch.tensor(SERVING_SIGMAS)[picks]
        noise = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        prompts = ["" if rng.random() < PROMPT_DROPOUT else ex.prompt for ex in examples]
        run.set_lr()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            embeds = _encode(model, pipe, prompts)
            clean = predict_clean(
                model["transformer"],
                xt,
                sigma * 1000.0,
                embeds,
                history_inputs(history, prefix),
                pipe.parameterization,
            )
        loss = (weight * (clean.float() - x0) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.finish_step(loss=f"{loss.item():.4f}")
    run.end()
    export(pipe, run.ema, Path(args.out), args.guidance)


def _load_exported(model: torch.nn.ModuleDict, folder: Path) -> None:
    """Start from an exported folder's transformer and text encoder (a fine-tune once the
    run's checkpoint is gone: the optimizer and the step count start afresh). A resumed
    checkpoint, if there is one, overrides this."""
    for name in ("transformer", "text_encoder"):
        if not (folder / name / "config.json").exists():
            raise SystemExit(f"--init {folder}: no {name}/ (not an exported shapes-stream folder)")
        trained = type(model[name]).from_pretrained(folder / name)
        model[name].load_state_dict(trained.state_dict())
    print(f"initialised from {folder}")


def _load_autoencoder(path: str | None):
    """The frozen autoencoder of a latent-space run (`stream_ae.py`), or None."""
    if not path:
        return None
    from diffusers import AutoencoderTiny

    ae = AutoencoderTiny.from_pretrained(path).eval()
    ae.requires_grad_(False)
    return ae


def export(trained, ema: torch.nn.ModuleDict, out: Path, guidance: float = 1.0) -> None:
    """Save the EMA weights (and the autoencoder and parameterization of `trained`) as the
    served diffusers folder, which serves with `guidance` by default."""
    pipe = build_stream_pipeline(trained.vae, trained.parameterization, guidance)
    pipe.transformer.load_state_dict(ema["transformer"].state_dict())
    pipe.text_encoder.load_state_dict(ema["text_encoder"].state_dict())
    pipe.save_pretrained(out, safe_serialization=True)
    print(f"exported to {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default="work/shapes-stream")
    p.add_argument("--out", default=str(STREAM_WEIGHTS_PATH))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--cosine", action="store_true", help="decay the rate over this run")
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--switch-prob", type=float, default=0.3)
    p.add_argument(
        "--first-frac",
        type=float,
        default=0.25,
        help="share of examples that open a video (no history: the hardest chunk)",
    )
    p.add_argument(
        "--grid-frac",
        type=float,
        default=0.5,
        help="share of examples noised to a serving step's level (else uniform)",
    )
    p.add_argument("--rollout-frac", type=float, default=0.0)
    p.add_argument("--rollout-steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--history-noise", type=float, default=0.1)
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast (slower than fp32 for this small model on CPUs)",
    )
    p.add_argument(
        "--autoencoder",
        default=None,
        help="a trained stream_ae folder: denoise its latents instead of pixels",
    )
    p.add_argument(
        "--prediction",
        choices=PREDICTIONS,
        default="sample",
        help="what the transformer's output means (stream_model.Parameterization)",
    )
    p.add_argument(
        "--sigma-data",
        type=float,
        default=1.0,
        help="standard deviation of the clean latents, for --prediction edm",
    )
    p.add_argument(
        "--shape-weight",
        type=float,
        default=0.0,
        help="extra loss weight per unit of latent distance from the chunk drawn with the "
        "other shapes: what tells the shapes apart weighs more",
    )
    p.add_argument(
        "--contrast-weight",
        type=float,
        default=0.0,
        help="weigh chunks of a colour close to its background more (a power; "
        "stream_world.contrast_weight)",
    )
    p.add_argument(
        "--init",
        default=None,
        help="an exported shapes-stream folder to start from (with --autoencoder its vae)",
    )
    p.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="the classifier-free guidance the exported folder serves with unless a request "
        "names one (1: none; choose it with stream_evaluate --guidance)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the checkpoint's EMA weights to --out without training",
    )
    parse_and_train(p, argv, train)


if __name__ == "__main__":
    main()
