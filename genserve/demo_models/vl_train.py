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
import math
from pathlib import Path

import numpy as np
import torch

from genserve.demo_models import vl_data, world
from genserve.demo_models.training import TrainingRun, parse_and_train, seed_and_work_dir
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
    work = seed_and_work_dir(args.seed, Path(args.work_dir))
    tokenizer, proc = build_tokenizer(), build_image_processor()
    model = build_model(tokenizer)
    heads = AttributeHeads(model.config.vision_config.hidden_size)
    tap = TowerTap(model)
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    run = TrainingRun(args, work, model, opt, extra={"heads": heads})
    if run.resume():
        print(f"resumed shapes-vl from {run.path} at step {run.step}")
    rng, nrng = run.rng, np.random.default_rng(args.seed + run.step)
    make = BatchMaker(tokenizer, proc)
    scenes = world.training_scenes(False)
    print(
        f"training shapes-vl: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters, batch {args.batch_size}, budget {args.minutes} min / {args.steps} steps"
    )

    run.begin("train shapes-vl", mininterval=5.0)
    loss_avg = None
    model.train()
    while run.going():
        samples = [vl_data.sample(scenes, rng, nrng) for _ in range(args.batch_size)]
        answer_loss = model(**make(samples)).loss
        aux_loss = heads.loss(tap.take(), heads.targets([s[3] for s in samples]))
        loss = answer_loss + args.aux_weight * aux_loss
        run.set_lr()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses = torch.stack([answer_loss.detach(), aux_loss.detach()])
        loss_avg = losses if loss_avg is None else 0.98 * loss_avg + 0.02 * losses
        run.finish_step(answer=f"{loss_avg[0]:.4f}", attributes=f"{loss_avg[1]:.4f}")
    tap.handle.remove()
    run.end()
    answer_avg, aux_avg = loss_avg.tolist() if loss_avg is not None else (math.nan, math.nan)
    print(
        f"stopped at step {run.step} after {run.minutes:.1f} min; "
        f"answer loss {answer_avg:.4f}, attribute loss {aux_avg:.4f}"
    )
    return export(run.ema, tokenizer, proc, Path(args.export))


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
    parse_and_train(p, argv, train)


if __name__ == "__main__":
    main()
