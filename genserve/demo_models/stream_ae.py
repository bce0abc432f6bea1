"""The small image autoencoder of `shapes-stream`: frames of the shapes world <-> a latent the
transformer denoises.

    python -m genserve.demo_models.stream_ae --minutes 8 --work-dir /work/train31/ae
    python -m genserve.demo_models.stream_ae --gate --work-dir /work/train31/ae --out AE_DIR

Why: a transformer that renders each 8x8-pixel patch with a linear map from its token draws
blobs (docs/benchmarks.md, issue 31 sessions 3-4): a crisp shape of any colour at any sub-token
offset is a product of a mask and a colour, which a linear read-out cannot form. A conv decoder
forms it easily, so the transformer denoises a latent that says where the shape is and what it
is, and the decoder draws it.

The model is diffusers' stock `AutoencoderTiny` (TAESD's architecture) with a small config:
32x32 frames -> [LATENT_CHANNELS, 8, 8] latents, frame by frame, deterministic (no KL). Training
draws random frames of the world (any scene of the grammar, any position on the torus, the
wrapped copies included) and minimises a shape-weighted MSE of the reconstruction. `--gate`
reads reconstructions of held-out scenes with the stream evaluator's `read_frame` (the cheap
check before a transformer is trained in this latent space).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderTiny

from genserve.demo_models import stream_world, world
from genserve.demo_models.training import TrainingRun, parse_and_train, seed_and_work_dir

FRAME_SIZE = stream_world.SIZE // 2  # the frames the model draws (stream_model.MODEL_SIZE)
LATENT_CHANNELS = 8
AE_CONFIG = dict(
    encoder_block_out_channels=(48, 48, 48), decoder_block_out_channels=(48, 48, 48),
    num_encoder_blocks=(1, 1, 2), num_decoder_blocks=(2, 1, 1), latent_channels=LATENT_CHANNELS,
    upsampling_scaling_factor=2, act_fn="relu")
FG_WEIGHT = 4.0


def build_autoencoder() -> AutoencoderTiny:
    return AutoencoderTiny(**AE_CONFIG)


def encode(ae: AutoencoderTiny, frames: torch.Tensor) -> torch.Tensor:
    """[N, 3, 32, 32] pixels in [-1, 1] -> [N, C, 8, 8] latents."""
    return ae.encoder(frames)


def decode(ae: AutoencoderTiny, latents: torch.Tensor) -> torch.Tensor:
    """[N, C, 8, 8] latents -> [N, 3, 32, 32] pixels in [-1, 1] (not clamped)."""
    return ae.decoder(latents)


def random_frames(rng: random.Random, nrng: np.random.Generator, scenes: list[world.Scene],
                  n: int, shape_weight: float = 0.0, contrast_weight: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` frames [n, 3, 32, 32] in [-1, 1] of random scenes at random torus positions, and a
    loss weight of the same shape: FG_WEIGHT on the shape's pixels, plus `shape_weight` on each
    pixel for every other shape of the grammar that would draw it differently there (a
    square's corners, a triangle's slopes: the few pixels that say which shape it is). With
    `contrast_weight` k, a frame whose colour is close to its background weighs more
    (`stream_world.contrast_weight`)."""
    frames, weights = [], []
    for _ in range(n):
        scene = scenes[rng.randrange(len(scenes))]
        state = stream_world.StreamState.random(nrng)
        t = _render(scene, state)
        bg = torch.tensor(world.BACKGROUNDS[scene.background], dtype=torch.float32)
        fg = ((t - (bg / 127.5 - 1.0).view(3, 1, 1)).abs().amax(0, keepdim=True) > 0.2).float()
        w = 1.0 + (FG_WEIGHT - 1.0) * fg
        if shape_weight > 0:
            for shape in world.SHAPES:
                if shape != scene.shape:
                    alt = _render(dataclasses.replace(scene, shape=shape), state)
                    w = w + shape_weight * ((alt - t).abs().amax(0, keepdim=True) > 0.2)
        w = w * stream_world.contrast_weight(scene, contrast_weight)
        frames.append(t)
        weights.append(w.expand(3, -1, -1))
    return torch.stack(frames), torch.stack(weights)


def _render(scene: world.Scene, state: stream_world.StreamState) -> torch.Tensor:
    pix, _ = stream_world.render([scene], state, FRAME_SIZE)
    return torch.from_numpy(pix[0]).permute(2, 0, 1).float() / 127.5 - 1.0


def train(args: argparse.Namespace) -> None:
    work = seed_and_work_dir(args.seed, Path(args.work_dir))
    ae = build_autoencoder()
    model = torch.nn.ModuleDict({"ae": ae})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if args.init:
        # A fine-tune of an exported autoencoder (its checkpoint gone): model and EMA start
        # from it, with a fresh optimizer.
        ae.load_state_dict(AutoencoderTiny.from_pretrained(args.init).state_dict())
    run = TrainingRun(args, work, model, opt)
    if run.resume():
        print(f"resumed at step {run.step}")
    if args.gate:
        print(gate(run.ema["ae"]))
    if args.gate or args.export_only:
        if args.out:
            export(run.ema["ae"], Path(args.out))
        return
    if args.decoder_only:
        # The encoder defines the latent space a transformer was trained in: freeze the one
        # that was exported (the EMA's) so only the decoder's drawing improves.
        ae.encoder.load_state_dict(run.ema["ae"].encoder.state_dict())
        ae.encoder.requires_grad_(False)
    scenes = world.training_scenes(video=True) + world.held_out(video=True)
    nrng = np.random.default_rng(args.seed + run.step)
    run.begin("train shapes-stream autoencoder")
    while run.going():
        x, w = random_frames(run.rng, nrng, scenes, args.batch_size, args.shape_weight,
                             args.contrast_weight)
        run.set_lr()
        z = encode(ae, x)
        z = z + args.latent_noise * torch.randn_like(z)  # a smooth latent to denoise in
        loss = (w * (decode(ae, z) - x) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.finish_step(loss=f"{loss.item():.4f}")
    run.end()
    print(gate(run.ema["ae"]))
    if args.out:
        export(run.ema["ae"], Path(args.out))


@torch.no_grad()
def export(ae: AutoencoderTiny, out: Path, count: int = 512) -> None:
    """Save `ae` with `scaling_factor` set so that scaled latents of random frames have unit
    standard deviation (what the transformer's noise levels assume)."""
    rng, nrng = random.Random(3), np.random.default_rng(3)
    scenes = world.training_scenes(video=True)
    x, _ = random_frames(rng, nrng, scenes, count)
    std = float(encode(ae, x).std())
    ae.register_to_config(scaling_factor=1.0 / std)
    ae.save_pretrained(out)
    print(f"exported to {out} (latent std {std:.3f})")


@torch.no_grad()
def gate(ae: AutoencoderTiny, count: int = 256, seed: int = 7) -> dict[str, float]:
    """Share of reconstructed held-out frames (upscaled to 64x64 as served) whose colour,
    shape and background `stream_evaluate.read_frame` reads right."""
    from genserve.demo_models.stream_evaluate import read_frame

    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    scenes = world.held_out(video=True)
    picked = [scenes[rng.randrange(len(scenes))] for _ in range(count)]
    right = {"colour": 0, "shape": 0, "background": 0, "truth_shape": 0}
    for scene in picked:
        pix, _ = stream_world.render([scene], stream_world.StreamState.random(nrng), FRAME_SIZE)
        x = torch.from_numpy(pix).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        y = decode(ae, encode(ae, x)).clamp(-1, 1)
        y = torch.nn.functional.interpolate(y, size=stream_world.SIZE, mode="bilinear",
                                            align_corners=False)
        img = ((y[0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy()
        r = read_frame(img)
        right["colour"] += r.colour == scene.colour
        right["shape"] += r.shape == scene.shape
        right["background"] += r.background == scene.background
        truth = torch.nn.functional.interpolate(x, size=stream_world.SIZE, mode="bilinear",
                                                align_corners=False)
        t_img = ((truth[0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy()
        right["truth_shape"] += read_frame(t_img).shape == scene.shape
    return {k: v / count for k, v in right.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default="work/shapes-stream-ae")
    p.add_argument("--out", default=None, help="save the EMA autoencoder here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--checkpoint-minutes", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--cosine", action="store_true")
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--latent-noise", type=float, default=0.05)
    p.add_argument("--shape-weight", type=float, default=0.0,
                   help="extra loss weight on the pixels where another shape would differ")
    p.add_argument("--gate", action="store_true", help="only read the checkpoint's gate")
    p.add_argument("--export-only", action="store_true", help="only export to --out")
    p.add_argument("--contrast-weight", type=float, default=0.0,
                   help="weigh frames of a colour close to its background more (a power)")
    p.add_argument("--init", default=None,
                   help="an exported autoencoder folder to start from (no checkpoint)")
    p.add_argument("--decoder-only", action="store_true",
                   help="train only the decoder (keeps the latent space of a trained encoder)")
    parse_and_train(p, argv, train)


if __name__ == "__main__":
    main()
