"""The resumable loop both demo trainers share (`demo_models.training.TrainingRun`), on a
two-parameter-tensor model: the step budget, the warm-up learning rate, the EMA update, the
checkpoint keys, and a resume that continues from the saved step with the same state."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from genserve.demo_models.training import TrainingRun, seed_and_work_dir

FLAGS = dict(seed=3, minutes=5.0, checkpoint_minutes=5.0, lr=0.1, warmup=4, cosine=False, ema=0.9)


def _run(work, steps: int, restart: bool = False) -> tuple[TrainingRun, list[float]]:
    """Train a Linear(3, 2) to output zeros; returns the run and the learning rates used."""
    seed_and_work_dir(3, work)
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Linear(1, 1)  # stands in for vl_train's training-only heads
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    args = argparse.Namespace(**FLAGS, steps=steps, restart=restart)
    run = TrainingRun(args, work, model, opt, extra={"extra": extra})
    resumed = run.resume()
    assert resumed == (run.step > 0)
    run.begin("test", disable=True)
    lrs = []
    while run.going():
        x = torch.tensor([[run.rng.random() for _ in range(3)]])
        loss = model(x).pow(2).mean()
        run.set_lr()
        lrs.append(opt.param_groups[0]["lr"])
        before = {k: v.clone() for k, v in run.ema.state_dict().items()}
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.finish_step(loss=f"{loss.item():.3f}")
        decay = min(0.9, (1 + run.step) / (10 + run.step))
        for k, v in run.ema.state_dict().items():
            want = before[k] + (1 - decay) * (model.state_dict()[k] - before[k])
            torch.testing.assert_close(v, want)
    run.end()
    return run, lrs


def test_a_run_checkpoints_and_a_second_run_resumes_where_it_stopped(tmp_path):
    work = tmp_path / "work"
    first, lrs = _run(work, steps=2)
    assert first.step == 2 and lrs == pytest.approx([0.1 / 4, 0.1 * 2 / 4])
    state = torch.load(work / "checkpoint.pt", weights_only=False)
    assert list(state) == ["model", "ema", "extra", "opt", "step", "rng"]
    assert state["step"] == 2 and not list(work.glob("*.tmp"))
    assert state["opt"]["state"], "the optimizer moments are saved"
    drawn = random.Random(3)
    [drawn.random() for _ in range(2 * 3)]
    assert state["rng"] == drawn.getstate(), "the data rng is saved where the run left it"

    second, lrs = _run(work, steps=3)
    # the warm-up goes on from step 2
    assert second.step == 3 and lrs == pytest.approx([0.1 * 3 / 4])
    [drawn.random() for _ in range(3)]
    assert second.rng.getstate() == drawn.getstate(), "the resumed run drew on from there"
    resumed = torch.load(work / "checkpoint.pt", weights_only=False)
    assert resumed.keys() == state.keys() and resumed["step"] == 3
    assert resumed["opt"]["state"][0]["step"] == state["opt"]["state"][0]["step"] + 1
    # Resuming twice from one checkpoint continues identically.
    torch.save(state, work / "checkpoint.pt")
    again, _ = _run(work, steps=3)
    for k, v in again.ema.state_dict().items():
        assert torch.equal(v, second.ema.state_dict()[k])

    fresh, _ = _run(work, steps=1, restart=True)
    assert fresh.step == 1
