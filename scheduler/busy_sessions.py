"""A small real session for tests, the benchmark and the demo before the drafter trainer is wired in.

It holds the GPU id it was given (and checks CUDA_VISIBLE_DEVICES names it), does a fixed amount of CPU
work per step, renews its lease through `ctx.should_continue()` and reports its step. Each is a plain function,
which `scheduler.session_entry` accepts as an entry with nothing to warm up or read ahead
(session_process.FunctionEntry). The drafter trainer's real session is started the same way, through the
roof's entry object (default "tailspec.session_entry:ENTRY").
"""

from __future__ import annotations

import json
import os
import time

from tailspec.scheduler.session_process import SessionContext

STEP_ENV = "TAILSPEC_DEMO_STEP_ITERS"
SLEEP_ENV = "TAILSPEC_DEMO_STEP_SLEEP_S"


def busy_session(ctx: SessionContext) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible != str(ctx.gpu):
        raise RuntimeError(f"session for GPU {ctx.gpu} sees CUDA_VISIBLE_DEVICES={visible!r}")
    iters = int(os.environ.get(STEP_ENV, "20000"))  # ≈ 2-5 ms of Python arithmetic
    # A GPU-bound training step mostly waits on the device; the sleep stands for that wait.
    wait = float(os.environ.get(SLEEP_ENV, "0.02"))
    step, acc = 0, 0.0
    while ctx.should_continue():
        for i in range(iters):
            acc += (i % 7) * 1e-9
        if wait > 0:
            time.sleep(wait)
        step += 1
        ctx.report(step, loss=1.0 / step, tokens=step * 64)


def env_probe_session(ctx: SessionContext) -> None:
    """Records the environment the session ran with (tests of dispatch: which GPU did it get?)."""
    out = os.path.join(os.environ["TAILSPEC_PROBE_DIR"], f"probe-{ctx.session_id}.json")
    with open(out, "w") as f:
        json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                   "nice": os.nice(0), "cpus": sorted(os.sched_getaffinity(0))}, f)


def slow_stop_session(ctx: SessionContext) -> None:
    """Works for $TAILSPEC_DEMO_STEP_SLEEP_S seconds before its first lease check (tests of the stop backstop:
    a session that is slow to see its revocation)."""
    time.sleep(float(os.environ.get(SLEEP_ENV, "1.0")))
    ctx.should_continue()
