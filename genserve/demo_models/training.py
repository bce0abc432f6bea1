"""The resumable training loop the demo trainers share (`train` for the diffusion models,
`vl_train` for shapes-vl): seeding and the work dir, an exponential moving average of the
weights, a checkpoint written atomically and resumed from, and a run bounded by a step budget,
a wall-time budget and SIGINT / SIGTERM.

Each trainer builds its model and optimizer and writes its own step (batch, loss, backward);
`TrainingRun` does the rest around it:

    run = TrainingRun(args, work, model, opt, extra={"heads": heads})
    if run.resume(): ...
    run.begin("train shapes-vl")
    while run.going():
        loss = ...
        run.set_lr()
        ...; opt.step()
        run.finish_step(loss=f"{loss:.4f}")
    run.end()

A checkpoint (`<work>/checkpoint.pt`) holds `model`, `ema`, each `extra` part, `opt`, `step` and
the Python `rng` state.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def seed_and_work_dir(seed: int, work: Path) -> Path:
    """Seed torch (before the model is built, so its initial weights follow the seed) and make
    the checkpoint folder."""
    torch.manual_seed(seed)
    work.mkdir(parents=True, exist_ok=True)
    return work


def _budget_frac(t_start: float, deadline: float, steps_done: int, steps: int | None) -> float:
    frac = (time.time() - t_start) / max(deadline - t_start, 1e-9)
    if steps is not None:
        frac = max(frac, steps_done / max(steps, 1))
    return frac


class _StopFlag:
    """Becomes true on SIGINT / SIGTERM so the loop ends at a step boundary and saves."""

    def __init__(self) -> None:
        self._stop = False
        self._old = {sig: signal.signal(sig, self._set) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _set(self, signum, frame) -> None:
        print(f"\nsignal {signum}: stopping after this step", flush=True)
        self._stop = True

    def __bool__(self) -> bool:
        return self._stop

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _lr(step: int, base: float, warmup: int, decay_frac: float | None) -> float:
    """Linear warm-up, then constant, or a cosine to zero over the run when `decay_frac` (the
    fraction of the budget used so far) is given."""
    lr = base * min(1.0, (step + 1) / warmup)
    if decay_frac is not None:
        lr *= 0.5 * (1.0 + math.cos(math.pi * min(decay_frac, 1.0)))
    return lr


def parse_and_train(
    p: argparse.ArgumentParser, argv: list[str] | None, train: Callable[[argparse.Namespace], Any]
) -> None:
    """The end of both trainers' `main`: add `--threads`, parse, check the budget, train."""
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        p.error("--minutes must be positive")
    train(args)


class TrainingRun:
    """Step count, EMA, checkpoint and budgets of one training run.

    `args` carries the flags both trainers take: seed, restart, steps, minutes,
    checkpoint_minutes, lr, warmup, cosine and ema. `model` is what trains and what the EMA
    copies; `extra` names further state saved and resumed with it (e.g. training-only heads).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        work: Path,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        extra: dict[str, torch.nn.Module] | None = None,
    ):
        self.args = args
        self.path = work / CHECKPOINT_NAME
        self.model = model
        self.ema = copy.deepcopy(model).requires_grad_(False)
        self.opt = opt
        self.extra = dict(extra or {})
        self.step = 0
        self.rng = random.Random(args.seed)

    def resume(self) -> bool:
        """Load the checkpoint unless there is none or `--restart` was given."""
        if not self.path.exists() or self.args.restart:
            return False
        state = torch.load(self.path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        for name, part in self.extra.items():
            part.load_state_dict(state[name])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        return True

    def save(self) -> None:
        """Write the checkpoint to a temporary file, then rename it over the old one, so an
        interrupted write never leaves a broken checkpoint."""
        tmp = self.path.with_suffix(".tmp")
        torch.save(
            {
                "model": self.model.state_dict(),
                "ema": self.ema.state_dict(),
                **{name: part.state_dict() for name, part in self.extra.items()},
                "opt": self.opt.state_dict(),
                "step": self.step,
                "rng": self.rng.getstate(),
            },
            tmp,
        )
        tmp.replace(self.path)

    def begin(self, desc: str, **bar_options) -> None:
        """Start the clock, the progress bar and the signal handlers."""
        from tqdm import tqdm

        self.t_start = self.t_ckpt = time.time()
        self.first_step = self.step
        self.deadline = self.t_start + self.args.minutes * 60
        # Without a step budget the bar counts steps and shows the rate; the budget is wall time.
        self.bar = tqdm(
            total=self.args.steps,
            initial=self.step,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            **bar_options,
        )
        self.stop = _StopFlag()

    def going(self) -> bool:
        """Whether to take another step: no signal, and within the step and time budgets."""
        steps = self.args.steps
        return (
            not self.stop and (steps is None or self.step < steps) and time.time() < self.deadline
        )

    def set_lr(self) -> None:
        """Warm-up, then constant or (`--cosine`) decaying over this run's budget."""
        a = self.args
        frac = (
            _budget_frac(self.t_start, self.deadline, self.step - self.first_step, a.steps)
            if a.cosine
            else None
        )
        for group in self.opt.param_groups:
            group["lr"] = _lr(self.step, a.lr, a.warmup, frac)

    def finish_step(self, **postfix) -> None:
        """Count the step taken, move the EMA toward the weights, show `postfix` on the bar
        and checkpoint every `--checkpoint-minutes`."""
        self.step += 1
        decay = min(self.args.ema, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            for pe, pm in zip(self.ema.parameters(), self.model.parameters()):
                pe.lerp_(pm, 1.0 - decay)
        self.bar.update(1)
        self.bar.set_postfix(**postfix)
        if time.time() - self.t_ckpt > self.args.checkpoint_minutes * 60:
            self.save()
            self.t_ckpt = time.time()

    def end(self) -> None:
        """Close the bar, give the signals back and write the final checkpoint."""
        self.bar.close()
        self.stop.restore()
        self.save()

    @property
    def minutes(self) -> float:
        """Wall time since `begin`."""
        return (time.time() - self.t_start) / 60
