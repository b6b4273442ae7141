"""Fault drills: a short co-trained RL loop with SIGKILLs at random moments, and what each cost.

The demo's RL loop (co-trained, the demo's defaults) runs with a private redis-server persisting to an AOF
(`appendfsync everysec`) and two `tailspec scheduler run` processes (one leads, one stands by). A drill thread
waits for the first rollout, then at random moments SIGKILLs, round-robin over the kinds asked for:
- `scheduler`: the leading scheduler process (the standby takes over; a fresh standby is started);
- `redis`: redis-server, restarted by the drill on the same port and directory after `--redis-down-s`;
- `session`: a drafter-training session, preferably while it writes a lineage head or a checkpoint (its
  temporary directory names the writer's pid), else mid-training;
- `worker`: a rollout worker while it decodes (the RL loop replaces it and redoes its share).
Per fault kind it reports: injections; GPUs still lent, after one lease TTL (plus one leader TTL for a
scheduler), to a session that is no longer running (target 0); corrupt lineage-head / version directories
found after the fault's recovery (target 0); acknowledged samples missing from the stream after a Redis
restart (target 0 beyond what `everysec` may lose: the writes of the last second before the kill); RL steps
hit by the fault that completed; time to recover (p50 / max): a new leader for `scheduler`, a fresh
scheduler heartbeat after the restart for `redis`, the killed session's GPU free again for `session`, the step
completed for `worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailspec.benchmarks.machine import machine
from tailspec.core import state
from tailspec.core.state import Lease, Progress, SchedulerLeader, SessionInfo

from tailspec.commands.args import config_from_args
from tailspec.demo.options import DemoOptions

KINDS = ("scheduler", "redis", "session", "worker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    p.add_argument("--steps", type=int, default=40,
                   help="at most this many RL steps (default 40); the run ends one step after the last drill")
    p.add_argument("--workers", type=int, default=d.workers, help=f"simulated GPUs (default {d.workers})")
    p.add_argument("--policy", default=d.policy, help=f"policy preset or directory (default {d.policy})")
    p.add_argument("--prompts", type=int, default=d.prompts_per_step)
    p.add_argument("--group", type=int, default=d.group_size)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated (default all: {KINDS})")
    p.add_argument("--per-kind", type=int, default=2, help="injections per kind (default 2)")
    p.add_argument("--gap", type=float, nargs=2, default=(1.5, 4.0), metavar=("MIN", "MAX"),
                   help="seconds between one fault's recovery and the next injection, drawn uniformly")
    p.add_argument("--redis-down-s", type=float, default=1.0, help="how long redis-server stays down (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap-samples", type=int, default=d.bootstrap_samples,
                   help=f"samples of the first drafter's offline training (default {d.bootstrap_samples}, cached)")
    p.add_argument("--bootstrap-seconds", type=float, default=d.bootstrap_seconds,
                   help=f"its time budget (default {d.bootstrap_seconds:g})")
    p.add_argument("--deal", default=d.deal, choices=["chunk", "round_robin", "by_length"],
                   help=f"how requests are dealt to workers (default {d.deal})")
    p.add_argument("--out", metavar="DIR", help="keep the run directory here (default: a temp dir)")


@dataclass
class Injection:
    kind: str
    at: float
    step: int | None  # the RL step running when it was injected
    detail: str = ""
    recover_s: float | None = None
    gpus_still_lent: int = 0
    corrupt_dirs: list[str] = field(default_factory=list)
    samples_lost: int = 0
    samples_at_risk: int = 0  # acknowledged within the last second before a Redis kill (everysec may lose them)
    mid_write: bool | None = None  # session kills: whether it landed in a head/checkpoint write


class Drill:
    """The drill thread's state and its view of the run (Redis, processes, directories)."""

    def __init__(self, demo: Any, args: argparse.Namespace, kinds: list[str]):
        self.demo, self.args = demo, args
        self.rng = random.Random(args.seed)
        self.plan = [k for _ in range(args.per_kind) for k in kinds]
        self.rng.shuffle(self.plan)
        self.injections: list[Injection] = []
        self.steps_done: dict[int, float] = {}  # step -> time it completed
        self.current_step: int | None = None
        self.started = threading.Event()
        self.finished = threading.Event()
        self.done_at_step: int | None = None  # the step running when the last drill ended
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="fault-drill", daemon=True)

    # -- the run's hooks -----------------------------------------------------------------------------------
    def on_progress(self, step, _results) -> None:
        if isinstance(step, int):
            self.current_step = step
            self.started.set()

    def on_row(self, row) -> None:
        self.steps_done[row.step] = time.time()

    # -- the drill -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        if not self.started.wait(600):
            return
        for kind in self.plan:
            if self.finished.wait(self.rng.uniform(*self.args.gap)):
                return
            try:
                inj = getattr(self, f"_{kind}")()
            except Exception as e:  # noqa: BLE001 - a drill that cannot inject is reported, the run goes on
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")
                continue
            if inj is not None:
                self.injections.append(inj)
        self.done_at_step = self.current_step if self.current_step is not None else 0

    def should_stop(self) -> bool:
        """The run may end once every drill is done and the step it ended in has completed."""
        return self.done_at_step is not None and max(self.steps_done, default=-1) >= self.done_at_step

    @property
    def r(self):
        return self.demo.r

    @property
    def cfg(self):
        return self.demo.cfg

    def _key(self, name: str, **f) -> str:
        return state.key(self.demo.cluster, name, **f)

    def _new(self, kind: str, detail: str, step: int | None = None) -> Injection:
        return Injection(kind, time.time(), self.current_step if step is None else step, detail)

    def _scheduler(self) -> Injection | None:
        svc = self.demo.services
        lead = state.get(self.r, self._key("leader"), SchedulerLeader)
        if lead is None:
            return None
        victim = next((i for i, p in enumerate(svc.sched_procs) if p.pid == lead.pid and p.poll() is None), None)
        if victim is None:
            return None
        inj = self._new("scheduler", f"leader pid {lead.pid} (epoch {lead.epoch})")
        os.kill(lead.pid, signal.SIGKILL)
        svc.sched_procs[victim].wait(10)
        svc.sched_procs[victim] = svc.start_scheduler(victim)  # a fresh standby, so two serve again
        inj.recover_s = self._wait(lambda: (lambda ld: ld is not None and ld.pid != lead.pid)(
            state.get(self.r, self._key("leader"), SchedulerLeader)), inj.at)
        self._after(inj, self.cfg.scheduler.lease_ttl_s + self.cfg.scheduler.leader_ttl_s)
        return inj

    def _redis(self) -> Injection | None:
        srv = self.demo.services.redis_server
        inj = self._new("redis", f"redis-server pid {srv.pid}, down {self.args.redis_down_s:g}s")
        acked_early = self.demo.client.sent["samples"]
        time.sleep(1.1)  # what was acknowledged before this is on disk (everysec); what comes after is at risk
        acked = self.demo.client.sent["samples"]
        inj.samples_at_risk = acked - acked_early
        srv.kill()
        time.sleep(self.args.redis_down_s)
        restarted = time.time()
        srv.restart()
        inj.samples_lost = max(0, acked - self._rl_samples())  # read before the client's next write lands
        inj.recover_s = self._wait(lambda: _float(self.r.get(self._key("scheduler_heartbeat"))) > restarted, inj.at)
        self._after(inj, self.cfg.scheduler.lease_ttl_s + self.cfg.scheduler.leader_ttl_s)
        return inj

    def _session(self) -> Injection | None:
        deadline = time.time() + 60.0
        pid, mid, sessions = None, False, []
        while time.time() < deadline and pid is None and not self.finished.is_set():
            pid = self._writer_pid()  # a writer of a head or checkpoint: its temp dir names it
            mid = pid is not None
            sessions = self._sessions()
            running = [s for s in sessions if s.status == "running" and s.pid and _alive(s.pid)]
            if pid is None and running and self.rng.random() < 0.02:  # else mid-training, now and then
                pid = self.rng.choice(running).pid
            if pid is None:
                time.sleep(0.02)
        if pid is None:
            return None
        victim = next((s for s in sessions if s.pid == pid), None)
        inj = self._new("session", f"pid {pid}" + (f" ({victim.session_id} on gpu {victim.gpu})" if victim else ""))
        inj.mid_write = mid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None

        def gpu_free() -> bool:
            if victim is None:
                return True
            lease = state.get(self.r, self._key("lease", node=victim.node, gpu=victim.gpu), Lease)
            return lease is None or lease.token != victim.lease_token

        inj.recover_s = self._wait(gpu_free, inj.at)
        self._after(inj, self.cfg.scheduler.lease_ttl_s)
        return inj

    def _worker(self) -> Injection | None:
        svc = self.demo.services
        deadline = time.time() + 60.0
        while time.time() < deadline and not self.finished.is_set():  # a worker that is decoding
            busy = [(w, step) for w, p in enumerate(svc.procs)
                    if p.poll() is None and (step := self._active(f"w{w}")) is not None]
            if busy:
                w, step = self.rng.choice(busy)
                inj = self._new("worker", f"w{w} pid {svc.procs[w].pid} at step {step}", step)
                svc.procs[w].kill()
                inj.recover_s = self._wait(lambda: step in self.steps_done or self.finished.is_set(), inj.at,
                                           timeout=300)
                if step in self.steps_done:
                    inj.recover_s = self.steps_done[step] - inj.at
                self._after(inj, 0.0)
                return inj
            time.sleep(0.05)
        return None

    # -- checks ----------------------------------------------------------------------------------------------
    def _after(self, inj: Injection, ttl_s: float) -> None:
        """One TTL after the fault: leases held for sessions that no longer run; then every head and version
        directory is loaded."""
        wait = inj.at + ttl_s + 2 * self.cfg.scheduler.tick_s + 0.5 - time.time()
        if wait > 0:
            time.sleep(wait)
        inj.gpus_still_lent = self.orphan_leases()
        inj.corrupt_dirs = corrupt_dirs(Path(self.cfg.trainer.checkpoint_dir))

    def orphan_leases(self) -> int:
        by_lease = {(s.node, s.gpu, s.lease_token): s for s in self._sessions()}
        n = 0
        for k in self.r.scan_iter(match=self._key("lease", node="*", gpu="*")):
            lease = state.get(self.r, k.decode(), Lease)
            s = by_lease.get((lease.node, lease.gpu, lease.token)) if lease is not None else None
            if s is not None and (s.status in ("stopped", "failed") or (s.pid is not None and not _alive(s.pid))):
                n += 1
        return n

    def _sessions(self) -> list:
        out = []
        for k in self.r.scan_iter(match=self._key("session", session_id="*")):
            try:
                s = state.get(self.r, k.decode(), SessionInfo)
            except state.StateError:
                continue
            if s is not None:
                out.append(s)
        return out

    def _active(self, worker: str) -> int | None:
        """The RL step `worker` is decoding now, or None."""

        try:
            p = state.get(self.r, self._key("progress", worker=worker), Progress)
        except state.StateError:
            return None
        return p.step if p is not None and p.phase == "rollout" and p.active > 0 else None

    def _writer_pid(self) -> int | None:
        root = Path(self.cfg.trainer.checkpoint_dir)
        for d in (root / "lineage", root / "checkpoints", root / "versions"):
            for t in d.glob(".*.tmp.*") if d.is_dir() else []:
                parts = t.name.split(".")
                if len(parts) >= 3 and parts[-2].isdigit() and _alive(int(parts[-2])):
                    return int(parts[-2])
        return None

    def _rl_samples(self) -> int:
        """Samples of the RL loop in the stream (the bootstrap's seeds, group ids `boot:*`, left out)."""
        n = 0
        for _, fields in self.r.xrange(self._key("samples")):
            try:
                gid = json.loads(fields[b"data"]).get("group_id") or ""
            except (KeyError, ValueError):
                continue
            n += not gid.startswith("boot:")
        return n

    def _wait(self, ok, since: float, timeout: float = 60.0) -> float | None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if ok():
                    return time.time() - since
            except Exception:  # noqa: BLE001 - Redis still coming back
                pass
            time.sleep(0.02)
        return None


def corrupt_dirs(root: Path) -> list[str]:
    """Lineage heads and drafter versions under `root` that do not load whole (hidden temporaries are not
    directories anyone reads, and are left out)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.checkpoint import load_checkpoint
    from tailspec.drafter_trainer.model import Eagle3Module

    bad = []
    for d in sorted((root / "lineage").glob("head-*")):
        try:
            load_checkpoint(d)
        except Exception as e:  # noqa: BLE001 - any failure to load is corruption here
            bad.append(f"{d.name}: {type(e).__name__}")
    for d in sorted((root / "versions").glob("v[0-9]*")):
        try:
            Eagle3Module.load(d)
            if (d / "version.json").exists():
                json.loads((d / "version.json").read_text())
        except Exception as e:  # noqa: BLE001
            bad.append(f"{d.name}: {type(e).__name__}")
    return bad


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _float(raw) -> float:
    try:
        return float(raw) if raw is not None else 0.0
    except ValueError:
        return 0.0


def summarize(injections: list[Injection], kinds: list[str], steps_done: dict[int, float]) -> dict:
    out = {}
    for kind in kinds:
        mine = [i for i in injections if i.kind == kind]
        rec = [i.recover_s for i in mine if i.recover_s is not None]
        hit = {i.step for i in mine if i.step is not None}
        row = {
            "injections": len(mine),
            "gpus_still_lent": sum(i.gpus_still_lent for i in mine),
            "corrupt_dirs": len({d for i in mine for d in i.corrupt_dirs}),
            "samples_lost": sum(i.samples_lost for i in mine),
            # the target: lost beyond what appendfsync everysec allows (the last second's acknowledged writes)
            "samples_lost_beyond_everysec": sum(max(0, i.samples_lost - i.samples_at_risk) for i in mine),
            "steps_hit": len(hit),
            "steps_completed": sum(1 for s in hit if s in steps_done),
            "recover_s_p50": round(statistics.median(rec), 3) if rec else None,
            "recover_s_max": round(max(rec), 3) if rec else None,
            "not_recovered": sum(1 for i in mine if i.recover_s is None),
        }
        if kind == "session":
            row["mid_write"] = sum(1 for i in mine if i.mid_write)
        out[kind] = row
    return out


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.demo.run import DemoOptions

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise SystemExit(f"tailspec bench faults: unknown fault kind(s) {unknown}; choose from {KINDS}")
    if args.per_kind < 1 or args.steps < 2:
        raise SystemExit("tailspec bench faults: --per-kind must be >= 1 and --steps >= 2")
    out = sys.stderr if args.json else sys.stdout
    cfg = config_from_args(args)
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="tailspec-bench-faults-")
    opts = DemoOptions(steps=args.steps, workers=args.workers, mode="cotrained", seed=args.seed, policy=args.policy,
                       prompts_per_step=args.prompts, group_size=args.group, deal=args.deal,
                       bootstrap_samples=args.bootstrap_samples, bootstrap_seconds=args.bootstrap_seconds,
                       run_dir=Path(args.out or tmp.name) / "run", dashboard=False, export=False, plots=False,
                       live=False, redis_aof=True, schedulers=2,
                       max_worker_restarts=args.per_kind * kinds.count("worker") + 1)
    holder: dict[str, Any] = {}  # the drill, and the last checks made before the services stop
    demo = _drilled_demo(opts, cfg, args, kinds, holder)
    print(f"faults: {args.steps} steps, {', '.join(kinds)} x {args.per_kind}; {demo.placement.note}", file=out)
    t0 = time.time()
    rows, error = [], None

    def on_row(r):
        holder["drill"].on_row(r)
        rows.append(r)
        print(f"  step {r.step}: {r.step_time_s:.1f}s reward {r.mean_reward:.2f} lent {r.lent_gpu_seconds:.1f}",
              file=out)

    try:
        demo.run(on_row=on_row, on_progress=lambda s, res: holder["drill"].on_progress(s, res))
    except Exception as e:  # noqa: BLE001 - a step that failed is a figure of the drill, reported below
        error = f"{type(e).__name__}: {e}"
        print(f"  the RL loop stopped: {error}", file=out)
    drill = holder["drill"]
    for i in drill.injections:
        print(f"  {i.kind:9s} at step {i.step}: {i.detail}; recovered in "
              f"{'-' if i.recover_s is None else f'{i.recover_s:.2f}s'}, still lent {i.gpus_still_lent}, "
              f"corrupt {len(i.corrupt_dirs)}, samples lost {i.samples_lost}", file=out)
    for e in drill.errors:
        print(f"  drill error: {e}", file=out)
    faults = summarize(drill.injections, kinds, drill.steps_done)
    result = {
        "machine": machine(), "steps": args.steps, "steps_completed": len(rows), "run_error": error,
        "wall_s": round(time.time() - t0, 1), "faults": faults, "drill_errors": drill.errors,
        "gpus_still_lent_at_end": holder.get("final_orphans"), "corrupt_dirs_at_end": holder.get("final_corrupt"),
        "worker_restarts": demo.worker_restarts, "redis_persistence": "aof appendfsync everysec",
        "lease_ttl_s": demo.cfg.scheduler.lease_ttl_s if demo.cfg else None,
        "leader_ttl_s": demo.cfg.scheduler.leader_ttl_s if demo.cfg else None,
    }
    print(json.dumps(faults, indent=1), file=out)
    if tmp is not None:
        tmp.cleanup()
    return result


def _drilled_demo(opts, cfg, args: argparse.Namespace, kinds: list[str], holder: dict):
    """The demo with the drill started as its services come up and its last checks made before they stop."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.demo.run import Demo

    class DrilledDemo(Demo):
        def start_services(self) -> None:
            super().start_services()
            holder["drill"] = Drill(self, args, kinds)
            holder["drill"].thread.start()

        def stop_services(self) -> None:  # the last checks need the services up
            d = holder.get("drill")
            if d is not None:
                d.finished.set()
                d.thread.join(timeout=120)
                holder["final_orphans"] = d.orphan_leases()
                holder["final_corrupt"] = corrupt_dirs(Path(self.cfg.trainer.checkpoint_dir))
            super().stop_services()

    demo = DrilledDemo(opts, cfg)
    demo.should_stop = lambda: "drill" in holder and holder["drill"].should_stop()
    return demo

