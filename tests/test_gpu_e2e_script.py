"""`benchmarks/gpu_e2e.sh`, the main job's GPU check, works before a GPU is lent: its payload is built and fits what
one device call carries (64 MiB), and the whole script runs here in its dry mode (`--dry`: the CPU, 1 step of a
small e2e), each check exiting 0 and the figures the GPU checks record present in its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_e2e.sh"


def _run(args: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHON=sys.executable, **env))


@pytest.mark.slow
def test_payload_fits_one_call(tmp_path):
    out = _run(["--pack", str(tmp_path / "payload")], timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("payload "))
    size = int(line.split("; ")[1].split()[0])
    print(line)
    assert 0 < size <= 64 << 20
    wheels = {p.name.split("-")[0] for p in (tmp_path / "payload" / "wheels").glob("*.whl")}
    assert {"tailspec", "redis", "pydantic", "pydantic_core"} <= wheels
    assert not any(w.lower().startswith(("ray", "vllm", "torch")) for w in wheels)
    # the carried redis-server runs through its wrapper, with its own libraries
    ver = subprocess.run([str(tmp_path / "payload" / "bin" / "redis-server"), "--version"], capture_output=True,
                         text=True, timeout=30)
    assert ver.returncode == 0 and "Redis server" in ver.stdout


@pytest.mark.slow
def test_dry_run_passes(tmp_path):
    """The dry mode on the `tiny` policy (`deep`, the dry mode's default, would pre-train for minutes on a fresh
    machine; make test has `tiny` cached by the time this runs)."""
    out_dir = tmp_path / "out"
    out = _run([str(out_dir), "900", "--dry"], timeout=1000, POLICY="tiny", STEPS="1")
    summary = (out_dir / "summary.txt").read_text()
    assert out.returncode == 0, summary + out.stderr
    for check in ("policy", "drafter", "hbm_floor", "e2e"):
        assert f"{check} rc=0" in summary, summary + (out_dir / f"{check}.txt").read_text()[-3000:]
    e2e = json.loads((out_dir / "e2e.json").read_text().strip().splitlines()[-1])
    for key in ("speedup_vs_nospec", "speedup_vs_frozen_last_third", "training_share", "reclaimed_share",
                "promotions", "acceptance_first_last"):
        assert key in e2e
    assert e2e["placement"]["device"] == "cpu" and e2e["policy"] == "tiny"
    floor = json.loads((out_dir / "hbm_floor.json").read_text().strip().splitlines()[-1])
    assert floor["step_over_hbm_floor"]["1"]["eager"] > 0
    assert floor["step_over_hbm_floor"]["1"]["graphs"] is None  # no graph pool off CUDA, and it says so
    assert "step_over_hbm_floor:" in summary and "e2e:" in summary
