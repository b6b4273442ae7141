"""DeepSpeed backend (ZeRO-2, optimizer offload to CPU, gloo): same loss curve as the plain backend on the
same data and seed, and its checkpoint resumes."""

from __future__ import annotations

import pytest
import torch
from tailspec.drafter_trainer.checkpoint import load_latest
from tailspec.drafter_trainer.training_session import TrainingSession

from tests.test_trainer_session import cfg, frozen_teacher, make_buffer

pytest.importorskip("deepspeed")
torch.set_num_threads(1)
STEPS = 8
# fp32 both ways; the only differences are summation order in ZeRO's flat partition and its gradient-norm
# computation, so the curves agree far tighter than this.
RTOL = 1e-4


@pytest.fixture
def teacher():
    return frozen_teacher()


@pytest.mark.slow
def test_deepspeed_matches_torch_backend(tmp_path, teacher):
    buf = make_buffer()
    plain = TrainingSession(cfg(tmp_path / "plain", backend="torch"), teacher, buf)
    ref = plain.run(max_steps=STEPS).losses
    ds = TrainingSession(cfg(tmp_path / "ds", backend="deepspeed"), teacher, buf)
    assert type(ds.backend).__name__ == "DeepSpeedBackend"
    got = ds.run(max_steps=STEPS).losses
    assert ref[-1] < ref[0]  # it trains
    assert got == pytest.approx(ref, rel=RTOL), (got, ref)
    for k, v in plain.drafter.state_dict().items():
        assert torch.allclose(ds.drafter.state_dict()[k], v, rtol=1e-3, atol=1e-5), k
    ck = load_latest(tmp_path / "ds" / "ck")
    assert ck.step == STEPS and ck.trainer_state["backend"] == "deepspeed" and ck.optimizer_state["state"]
    ds.close()
    # Resume with the DeepSpeed backend: optimizer moments restored, training goes on.
    again = TrainingSession(cfg(tmp_path / "ds", backend="deepspeed"), teacher, buf)
    assert again.step == STEPS
    st = again.backend.state_dict()["state"]
    assert torch.equal(st[0]["exp_avg"], ck.optimizer_state["state"][0]["exp_avg"])
    assert again.run(max_steps=2).total_steps == STEPS + 2
    again.close()
