"""`tailspec simulate` as a benchmark: its speed at 1,024 GPUs, its calibration in and out of sample, the published
RL results beside their projections, the drafter's drift, which constants are measured, and the sweep.

Lines (every figure a projection except the measured demo runs it is calibrated on):
- wall time of a 1,024-GPU x 100-step projection (Qwen2.5-7B, synchronous; target <= 10 s on 2 cores);
- calibration: a fresh `tailspec demo` (the default: deep policy, 6 steps, co-trained) replayed with its own
  measured costs; relative error of the rollout time, the idle GPU-seconds the scheduler counted and the
  reclaimed share (target <= 15%); `--run-dir DIR` replays a recorded run instead, `--no-demo` skips it;
- out-of-sample calibration: constants fitted on one recorded run (`--holdout`, default tests/data's) predict
  the others, recorded with other worker counts, steps, seeds, modes and verify rules: step time, rollout time,
  idle GPU-seconds, training share (target: the largest relative error <= 20%);
- anchors: each published RL result (NeMo-RL, SkyRL, Marin, Bebop, TLT) beside the projection of its setting
  (target: NeMo-RL's rollout and SkyRL's step figure within 25%);
- drift: the frozen drafter's decay and the co-trained drafter's recovery fitted on the recorded runs, and the
  co-trained vs frozen gap for 100, 300 and 1,000 steps of the default scenario, an interval;
- constants: which of the hardware model's constants a lent GPU measured and which are assumed, and the default
  drafter curve's (all assumed: the sweep's co-trained ÷ frozen gap rests on them; the drift fit is the measured one);
- the sweep: Qwen2.5-7B / Qwen3-32B / Qwen3-235B-A22B at 64 / 256 / 1,024 H100s, sync and async.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", metavar="DIR", help="calibrate on this recorded demo run (default: run a fresh one)")
    p.add_argument("--no-demo", action="store_true", help="skip the calibration")
    p.add_argument("--steps", type=int, default=20, help="steps per sweep projection (default 20)")
    p.add_argument("--holdout", nargs="+", metavar="RUN_DIR", default=None,
                   help="out-of-sample calibration: fit on the first run, predict the others (default: tests/data's)")


DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
HOLDOUT_FIT = "e2e-w4-cotrained"  # fitted on: the longest recorded co-trained run (10 steps)
HOLDOUT = ("e2e-w4-nospec", "e2e-w4-frozen", "oos-w2-cotrained-s0", "oos-w4-cotrained-s1",
           "oos-w4-cotrained-residual-s4", "drift-w4-cotrained-s1", "drift-w2-cotrained-s0",
           "oos-w4-cotrained-residual-s5")  # other settings


def holdout_dirs() -> list[str]:
    """The committed recorded runs: the one fitted on first, then those predicted."""
    return [str(DATA / n) for n in (HOLDOUT_FIT, *HOLDOUT)]


def drift_dirs() -> list[str]:
    """The committed recorded runs that measured the frozen drafter's acceptance."""
    return [d for d in holdout_dirs() if "nospec" not in d]


def nemo_rl_check() -> dict:
    """Qwen3-8B on 32 GB200, synchronous, frozen drafter at acceptance length 2.47 with k = 3."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.simulate.drafter import DrafterCurve
    from tailspec.simulate.fit import alpha_for
    from tailspec.simulate.run import Scenario, simulate

    curve = DrafterCurve(alpha0=alpha_for(2.47, 3), decay=0.0)
    sc = Scenario(model="qwen3-8b", gpu="GB200", gpus=32, k=3, k_max=3, length_median=1000, steps=10, curve=curve)
    s = simulate(sc).summary()
    return {"rollout_speedup_frozen": s["rollout_speedup_frozen"], "reported": [1.5, 1.8],
            "rollout_s_nospec": s["rollout_s"]["nospec"]}


def calibration(run_dir: str | None) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.commands.simulate import run_policy_model
    from tailspec.simulate.calibrate import calibrate

    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="tailspec-calibrate-")
        print(f"calibration: running `tailspec demo --no-dashboard --run-dir {run_dir}` (a few minutes)", flush=True)
        done = subprocess.run([sys.executable, "-m", "tailspec.cli", "demo", "--no-dashboard", "--run-dir", run_dir],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the demo run failed: {done.stderr[-2000:]}")
    return calibrate(run_dir, model=run_policy_model(run_dir)).to_dict()


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.commands.simulate import print_sweep, run_sweep
    from tailspec.simulate.run import Scenario, simulate

    t0 = time.perf_counter()
    big = simulate(Scenario(gpus=1024, steps=100)).summary()
    wall = time.perf_counter() - t0
    print(f"1,024 GPUs x 100 steps (qwen2.5-7b, sync): {wall:.2f} s wall; projected speedup co-trained "
          f"{big['speedup_cotrained']:.2f}x, reclaimed share {big['reclaimed_share']:.2f}")
    nemo = nemo_rl_check()
    print(f"NeMo-RL setting (qwen3-8b, 32 x GB200, frozen, acceptance 2.47 at k=3): projected rollout speedup "
          f"{nemo['rollout_speedup_frozen']:.2f}x (reported 1.5-1.8x)")
    result: dict = {"label": "projection", "wall_s": wall, "big": big, "nemo_rl_check": nemo}
    if not args.no_demo:
        cal = calibration(args.run_dir)
        result["calibration"] = cal
        result["calibration_max_rel_error"] = cal["max_rel_error"]
        errs = ", ".join(f"{k} {v:.1%}" for k, v in cal["rel_error"].items())
        print(f"calibration on {cal['run_dir']} ({cal['steps']} steps): {errs} (max {cal['max_rel_error']:.1%})")
    # deferred: the CLI imports every bench module to build its parser; these load when the bench runs
    from tailspec.commands.simulate import anchors_report, drift_report, holdout_report
    from tailspec.simulate.drafter import CONSTANTS as DRAFTER_CONSTANTS
    from tailspec.simulate.hardware import constants

    oos = holdout_report(args.holdout or holdout_dirs())
    result["out_of_sample"] = oos
    result["calibration_out_of_sample_max_rel_error"] = oos["max_rel_error"]
    result["anchors"] = anchors_report()
    result["drift"] = drift_report(drift_dirs(), Scenario(), "100,300,1000")
    result["constants"] = constants() | {k: status for k, (status, _) in DRAFTER_CONSTANTS.items()}
    print("constants: " + ", ".join(f"{k} {v}" for k, v in result["constants"].items()))
    rows = run_sweep(replace(Scenario(), steps=args.steps))
    print_sweep(rows)
    result["sweep"] = rows
    return result
