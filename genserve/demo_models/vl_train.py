"""Train `shapes-vl` on the shapes world and export it as a Hugging Face LLaVA folder.

    # the committed model: three resumed runs, 2,069 steps of batch 48 in about 24 min
    # (48 px pictures, 36 image tokens; the last run decays the learning rate)
    python -m genserve.demo_models.vl_train --minutes 9.5
    python -m genserve.demo_models.vl_train --minutes 7.5
    python -m genserve.demo_models.vl_train --minutes 7 --cosine

Teacher forcing on (picture, question, answer) samples from `vl_data.sample`: the loss is the
cross-entropy of the answer tokens and the closing `<|im_end|>` only, plus (`--aux-weight`)
that of linear read-outs of the four attributes from the vision tower's patch features
(`AttributeHeads`), which teach the tower the shape several times faster than the answers
alone. The whole model trains (tower, projector, decoder) with AdamW; an exponential moving
average of the weights is what gets exported. Only the training scenes of
`world.training_scenes` are drawn; the 60 held out are for `vl_evaluate`.

Runs until `--steps` or the wall-time budget `--minutes`, whichever comes first; a checkpoint
is written every `--checkpoint-minutes` and at the end, and a later run with the same
`--work-dir` resumes from it (SIGINT / SIGTERM stop at a step boundary and save).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from genserve.demo_models import vl_data, world
from genserve.demo_models.train import _budget_frac, _lr, _StopFlag
from genserve.demo_models.vl_model import (
    EOS_TOKEN,
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    WEIGHTS_PATH,
    build_image_processor,
    build_model,
    build_tokenizer,
)


class BatchMaker:
    """Turns samples into model inputs: image placeholders expanded to the image's tokens,
    labels only on the answer and the end of turn."""

    def __init__(self, tokenizer, image_processor) -> None:
        self.tok = tokenizer
        self.proc = image_processor
        self.image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    def prompt_ids(self, msgs: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids: list[int] = []
        for t in self.tok.encode(text, add_special_tokens=False):
            ids.extend([t] * TOKENS_PER_IMAGE if t == self.image_id else [t])
        return ids

    def __call__(self, samples: list[tuple]) -> dict[str, torch.Tensor]:
        rows, targets = [], []
        for _, msgs, ans, _ in samples:
            prompt = self.prompt_ids(msgs)
            out = self.tok.encode(ans, add_special_tokens=False) + [self.eos_id]
            rows.append(prompt + out)
            targets.append([-100] * len(prompt) + out)
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, t) in enumerate(zip(rows, targets)):
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, : len(t)] = torch.tensor(t)
            mask[i, : len(r)] = 1
        pixels = self.proc(images=[s[0] for s in samples], return_tensors="np")["pixel_values"]
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "pixel_values": torch.from_numpy(np.asarray(pixels, dtype=np.float32)),
        }


class AttributeHeads(torch.nn.Module):
    """Linear read-outs of the four attributes from the mean of the vision tower's patch
    features (the features the projector reads). Trained beside the answer loss, they give the
    tower a direct signal from the first step, so it learns the shape long before the answer
    loss alone would teach it (that signal has to pass through the projector and decoder). Not
    part of the exported model."""

    ATTRIBUTES = {
        "colour": list(world.COLOURS),
        "shape": list(world.SHAPES),
        "background": list(world.BACKGROUNDS),
        "position": list(world.POSITIONS),
    }

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleDict(
            {a: torch.nn.Linear(width, len(c)) for a, c in self.ATTRIBUTES.items()}
        )

    @classmethod
    def targets(cls, scenes: list[world.Scene]) -> dict[str, torch.Tensor]:
        return {
            a: torch.tensor([c.index(getattr(s, a)) for s in scenes])
            for a, c in cls.ATTRIBUTES.items()
        }

    def loss(self, patches: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        pooled = patches.mean(dim=1)
        return sum(
            torch.nn.functional.cross_entropy(head(pooled), targets[a])
            for a, head in self.heads.items()
        ) / len(self.heads)


class TowerTap:
    """Keeps the vision tower's last patch features of the current forward pass (a forward
    hook: the tower runs once per step for both losses). CLIP's last hidden state is the
    `vision_feature_layer=-1` feature LLaVA projects; the first token (CLS) is dropped as the
    "default" strategy does."""

    def __init__(self, model) -> None:
        self.patches: torch.Tensor | None = None
        self.handle = model.model.vision_tower.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        self.patches = output.last_hidden_state[:, 1:]

    def take(self) -> torch.Tensor:
        patches, self.patches = self.patches, None
        assert patches is not None, "the vision tower did not run"
        return patches


def train(args: argparse.Namespace) -> Path:
    torch.manual_seed(args.seed)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    tokenizer, proc = build_tokenizer(), build_image_processor()
    model = build_model(tokenizer)
    ema = copy.deepcopy(model).requires_grad_(False)
    heads = AttributeHeads(model.config.vision_config.hidden_size)
    tap = TowerTap(model)
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step = 0
    rng = random.Random(args.seed)
    if ckpt_path.exists() and not args.restart:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.setstate(state["rng"])
        print(f"resumed shapes-vl from {ckpt_path} at step {step}")
    nrng = np.random.default_rng(args.seed + step)
    make = BatchMaker(tokenizer, proc)
    scenes = world.training_scenes(False)
    print(
        f"training shapes-vl: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters, batch {args.batch_size}, budget {args.minutes} min / {args.steps} steps"
    )

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "ema": ema.state_dict(),
                "heads": heads.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "rng": rng.getstate(),
            },
            tmp,
        )
        tmp.replace(ckpt_path)

    from tqdm import tqdm

    t_start = t_ckpt = time.time()
    first_step = step
    deadline = t_start + args.minutes * 60
    bar = tqdm(
        total=args.steps,
        initial=step,
        desc="train shapes-vl",
        unit="step",
        dynamic_ncols=True,
        mininterval=5.0,
    )
    loss_avg = None
    model.train()
    stop = _StopFlag()
    while not stop and (args.steps is None or step < args.steps) and time.time() < deadline:
        samples = [vl_data.sample(scenes, rng, nrng) for _ in range(args.batch_size)]
        answer_loss = model(**make(samples)).loss
        aux_loss = heads.loss(tap.take(), heads.targets([s[3] for s in samples]))
        loss = answer_loss + args.aux_weight * aux_loss
        for group in opt.param_groups:
            group["lr"] = _lr(
                step,
                args.lr,
                args.warmup,
                _budget_frac(t_start, deadline, step - first_step, args.steps)
                if args.cosine
                else None,
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1.0 - decay)
        losses = torch.stack([answer_loss.detach(), aux_loss.detach()])
        loss_avg = losses if loss_avg is None else 0.98 * loss_avg + 0.02 * losses
        bar.update(1)
        bar.set_postfix(answer=f"{loss_avg[0]:.4f}", attributes=f"{loss_avg[1]:.4f}")
        if time.time() - t_ckpt > args.checkpoint_minutes * 60:
            save()
            t_ckpt = time.time()
    bar.close()
    stop.restore()
    tap.handle.remove()
    save()
    answer_avg, aux_avg = loss_avg.tolist() if loss_avg is not None else (math.nan, math.nan)
    print(
        f"stopped at step {step} after {(time.time() - t_start) / 60:.1f} min; "
        f"answer loss {answer_avg:.4f}, attribute loss {aux_avg:.4f}"
    )
    return export(ema, tokenizer, proc, Path(args.export))


def export(model, tokenizer, image_processor, out: Path) -> Path:
    """Write the weights (float32 safetensors), config, tokenizer and image processor."""
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    print(f"exported {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0, help="wall-time budget")
    p.add_argument("--steps", type=int, default=None, help="step budget (default: none)")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--cosine",
        action="store_true",
        help="decay the learning rate to zero over this run's budget (a final run)",
    )
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument(
        "--aux-weight",
        type=float,
        default=1.0,
        help="weight of the attribute read-out loss on the vision tower (0 = answers only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/shapes-vl-ckpt", help="checkpoints (resumed)")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--checkpoint-minutes", type=float, default=2.0)
    p.add_argument("--export", default=str(WEIGHTS_PATH), help="folder for the HF export")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        p.error("--minutes must be positive")
    train(args)


if __name__ == "__main__":
    main()
