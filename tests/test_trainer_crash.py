"""SIGKILL a training process at random moments (mid-step, mid-checkpoint, mid-export): the latest checkpoint
always loads and resumes, and the export directory is always whole or absent."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from tailspec.drafter_trainer.checkpoint import load_latest
from tailspec.drafter_trainer.export import export, load_export
from tailspec.drafter_trainer.training_session import TrainingSession

from tests.test_trainer_session import cfg, make_buffer

KILLS = 20


def _worker(root: str, ready) -> None:  # runs in a forked child until SIGKILLed
    from tailspec.drafter_trainer.teacher import Teacher

    from tests.test_trainer_model import make_target

    torch.set_num_threads(1)
    target = make_target(layers=4)
    teacher = Teacher(target, (1, 2, 3))
    s = TrainingSession(cfg(Path(root)), teacher, make_buffer())
    ready.set()
    while True:
        s.train_step()
        s.save()
        export(s.drafter, Path(root) / "export", "eagle3", meta={"step": s.step})


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path):
    ctx = mp.get_context("fork")
    rng = random.Random(7)
    last_step = 0
    for i in range(KILLS):
        ready = ctx.Event()
        p = ctx.Process(target=_worker, args=(str(tmp_path), ready), daemon=True)
        p.start()
        assert ready.wait(60), "worker did not start"
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        ck = load_latest(tmp_path / "ck")
        if ck is not None:
            assert ck.step >= last_step, (i, ck.step, last_step)  # never goes back
            last_step = ck.step
        out = tmp_path / "export"
        if out.exists():  # whole: config + weights readable and consistent
            d = load_export(out)
            assert json.loads((out / "config.json").read_text())["tailspec"]["step"] >= 1
            assert d.fc.weight.shape == (32, 96)
    assert last_step > 0, "no checkpoint was ever completed"
    # The last checkpoint resumes in a fresh session.
    from tailspec.drafter_trainer.teacher import Teacher

    from tests.test_trainer_model import make_target

    s = TrainingSession(cfg(tmp_path), Teacher(make_target(layers=4), (1, 2, 3)), make_buffer())
    assert s.step == last_step
    assert s.run(max_steps=1).total_steps == last_step + 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    leftovers += [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".ckpt")]
    assert len(leftovers) <= 2, leftovers  # at most the temp dirs of the last kill, cleaned by the next write
