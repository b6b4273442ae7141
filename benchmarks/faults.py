"""Fault drills: a short co-trained RL loop with SIGKILLs at random moments, and what each cost.

The demo's RL loop (co-trained, the demo's defaults) runs with a private redis-server persisting to an AOF
(`appendfsync everysec`) and two `tailspec scheduler run` processes (one leads, one stands by). A drill thread
waits for the first RL step to complete (its samples in the stream), then at random moments SIGKILLs, in a
shuffled order of the kinds asked for:
- `scheduler`: the leading scheduler process (the standby takes over; a fresh standby is started);
- `redis`: redis-server, restarted by the drill on the same port and directory after `--redis-down-s`;
- `session`: a drafter-training session, preferably while it writes a lineage head or a checkpoint (its
  temporary directory names the writer's pid), else mid-training;
- `worker`: a rollout worker while it decodes (the RL loop replaces it and redoes its share).
Per fault kind, every counter measured after every injection (`Drill._after`, one lease TTL after the fault, plus
one leader TTL for `scheduler` and `redis`):
- `gpus_still_lent` (`orphan_leases`): leases held for no live session (target 0);
- `corrupt_dirs` (`corrupt_dirs`): lineage-head and version directories that do not load (target 0);
- `samples_lost` (`samples_lost`): samples in the stream when the fault was injected (the trainer's client
  flushed first, so every sample submitted before it) and missing after recovery, less what the client's own
  trim of old policy versions removes (target 0); for `redis` also `samples_lost_beyond_everysec`, those that
  were in the stream a second before the kill (`everysec` may lose the last second's writes; target 0);
- RL steps hit by the fault that completed, and the time to recover (p50 / max): a new leader for `scheduler`,
  a fresh scheduler heartbeat after the restart for `redis`, the killed session's GPU free again for `session`,
  the step completed for `worker`.
`--plant` then runs each detector once more against a fault planted, after the drill and before the services
stop, through the state the detector reads (`plant_and_detect`): a half-written head directory in the lineage
root, a lease in Redis with no session behind it, a sample deleted from the stream. It reports
{counter: {planted, planted_detected, clean}}; a detector that misses its planted fault fails the drill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
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
    p.add_argument("--plant", action="store_true",
                   help="after the drill, plant one fault per detector (a half-written head directory, a lease with "
                        "no session, a sample deleted from the stream) and report whether each detector found it")


@dataclass
class Injection:
    kind: str
    at: float
    step: int | None  # the RL step running when it was injected
    detail: str = ""
    recover_s: float | None = None
    gpus_still_lent: int = 0
    corrupt_dirs: list[str] = field(default_factory=list)
    # the RL samples in the stream when the fault was injected (entry id -> policy version), and those that were
    # there a second earlier (durable under everysec; the same samples for every kind but `redis`)
    samples_before: dict[bytes, int] = field(default_factory=dict, repr=False)
    samples_durable: dict[bytes, int] = field(default_factory=dict, repr=False)
    samples_lost: int = 0
    samples_lost_beyond_everysec: int = 0
    dropped_before: int = 0  # the trainer's client's dropped samples when the fault was injected
    samples_dropped: int = 0  # samples the trainer's client dropped (and counted) from then until the check
    mid_write: bool | None = None  # session kills: whether it landed in a head/checkpoint write

    @property
    def samples_at_risk(self) -> int:
        """Samples written within the last second before the fault (a Redis kill under everysec may lose them)."""
        return len(self.samples_before.keys() - self.samples_durable.keys())


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

    def on_row(self, row) -> None:
        self.steps_done[row.step] = time.time()
        self.started.set()  # a step's samples are in the stream: every fault has samples to lose

    # -- the drill -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        if not self.started.wait(1800):
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

    def _new(self, kind: str, detail: str, step: int | None = None,
             durable: dict[bytes, int] | None = None) -> Injection:
        """An injection about to happen (or, for a session, just made), with the samples in the stream now and
        those known durable (`durable`, else the same)."""
        inj = Injection(kind, time.time(), self.current_step if step is None else step, detail)
        inj.samples_before = self._stream_now()
        inj.samples_durable = inj.samples_before if durable is None else durable
        inj.dropped_before = sum(self.demo.client.dropped.values())
        return inj

    def _stream_now(self) -> dict[bytes, int]:
        """The RL samples in the stream once the trainer's client wrote what was submitted (2 s at most)."""
        self.demo.client.flush(2.0)
        return stream_samples(self.r, self.demo.cluster)

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

        def new_leader() -> bool:
            ld = state.get(self.r, self._key("leader"), SchedulerLeader)
            return ld is not None and ld.pid != lead.pid

        inj.recover_s = self._wait(new_leader, inj.at)
        self._after(inj, self.cfg.scheduler.lease_ttl_s + self.cfg.scheduler.leader_ttl_s)
        return inj

    def _redis(self) -> Injection | None:
        srv = self.demo.services.redis_server
        durable = self._stream_now()
        time.sleep(1.1)  # what was in the stream before this is on disk (everysec); what comes after is at risk
        inj = self._new("redis", f"redis-server pid {srv.pid}, down {self.args.redis_down_s:g}s", durable=durable)
        srv.kill()
        time.sleep(self.args.redis_down_s)
        restarted = time.time()
        srv.restart()
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
        at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        # the stream is read right after the kill: reading it first would slow the hunt for a write in flight
        inj = self._new("session", f"pid {pid}" + (f" ({victim.session_id} on gpu {victim.gpu})" if victim else ""))
        inj.at, inj.mid_write = at, mid

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
                inj.recover_s = self._wait(lambda s=step: s in self.steps_done or self.finished.is_set(), inj.at,
                                           timeout=300)
                if step in self.steps_done:
                    inj.recover_s = self.steps_done[step] - inj.at
                self._after(inj, 0.0)
                return inj
            time.sleep(0.05)
        return None

    # -- checks ----------------------------------------------------------------------------------------------
    def _after(self, inj: Injection, ttl_s: float) -> None:
        """One TTL after the fault, every counter: leases held for no live session, head and version directories
        that do not load, samples in the stream at the fault and missing now."""
        wait = inj.at + ttl_s + 2 * self.cfg.scheduler.tick_s + 0.5 - time.time()
        if wait > 0:
            time.sleep(wait)
        inj.gpus_still_lent = self.orphan_leases()
        inj.corrupt_dirs = corrupt_dirs(Path(self.cfg.trainer.checkpoint_dir))
        now = self._stream_now()
        keep = self.demo.client.samples_keep_versions
        inj.samples_lost = samples_lost(inj.samples_before, now, keep)
        inj.samples_lost_beyond_everysec = samples_lost(inj.samples_durable, now, keep)
        inj.samples_dropped = sum(self.demo.client.dropped.values()) - inj.dropped_before

    def orphan_leases(self) -> int:
        return orphan_leases(self.r, self.demo.cluster)

    def _sessions(self) -> list[SessionInfo]:
        return session_records(self.r, self.demo.cluster)

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

    def _wait(self, ok, since: float, timeout: float = 60.0) -> float | None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if ok():
                    return time.time() - since
            except Exception:  # noqa: BLE001, S110 - Redis still coming back
                pass
            time.sleep(0.02)
        return None


# -- the detectors: what each counter reads --------------------------------------------------------------------
def stream_samples(r: Any, cluster: str) -> dict[bytes, int]:
    """The RL loop's samples in the cluster's sample stream: entry id -> policy version (the bootstrap's seeds,
    group ids `boot:*`, and entries that do not decode are left out)."""
    out = {}
    for entry_id, fields in r.xrange(state.key(cluster, "samples")):
        try:
            data = json.loads(fields[b"data"])
            version = int(data["policy_version"])
        except (KeyError, ValueError, TypeError):
            continue
        if not str(data.get("group_id") or "").startswith("boot:"):
            out[entry_id] = version
    return out


def samples_lost(before: Mapping[bytes, int], after: Mapping[bytes, int], keep_versions: int) -> int:
    """Samples of `before` (entry id -> policy version) missing from `after`, less those the trainer's client trims
    on purpose: the stream keeps the samples of the newest `keep_versions` policy versions written
    (scheduler/client_writer.py), so a sample of an older version may be gone by design."""
    kept = set(sorted(set(before.values()) | set(after.values()))[-keep_versions:])
    return sum(1 for entry_id, version in before.items() if version in kept and entry_id not in after)


def session_records(r: Any, cluster: str) -> list[SessionInfo]:
    """Every session record that decodes."""
    out = []
    for k in r.scan_iter(match=state.key(cluster, "session", session_id="*")):
        try:
            s = state.get(r, k.decode(), SessionInfo)
        except state.StateError:
            continue
        if s is not None:
            out.append(s)
    return out


def orphan_leases(r: Any, cluster: str, now: float | None = None) -> int:
    """Leases held for no live session: its record says stopped or failed, its process is gone, or, one lease TTL
    after the grant, no record names the lease at all (the scheduler writes a lend's record in the tick that
    grants it)."""
    now = time.time() if now is None else now
    by_lease = {(s.node, s.gpu, s.lease_token): s for s in session_records(r, cluster)}
    n = 0
    for k in r.scan_iter(match=state.key(cluster, "lease", node="*", gpu="*")):
        try:
            lease = state.get(r, k.decode(), Lease)
        except state.StateError:
            continue
        if lease is not None and _orphaned(lease, by_lease.get((lease.node, lease.gpu, lease.token)), now):
            n += 1
    return n


def _orphaned(lease: Lease, s: SessionInfo | None, now: float) -> bool:
    if s is None:
        return now - lease.granted_at > lease.ttl_s
    return s.status in ("stopped", "failed") or (s.pid is not None and not _alive(s.pid))


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


# -- planted faults: one per detector, through the state it reads -----------------------------------------------
PLANTED = "plant"  # the writer, holder and session named in every planted fault


def plant_corrupt_head(root: Path) -> Path:
    """A half-written lineage head under the checkpoint root `root`: the newest head's files copied under a new
    number with every safetensors file cut to half its length, or a directory with only an empty config file
    where the lineage has no head to copy. Returns the directory."""
    lineage = root / "lineage"
    lineage.mkdir(parents=True, exist_ok=True)
    heads = sorted(d for d in lineage.glob("head-*") if d.is_dir())
    numbers = [int(m.group(1)) for d in heads if (m := re.match(r"head-(\d+)-", d.name))]
    dst = lineage / f"head-{max(numbers, default=0) + 1000:08d}-{PLANTED}-1"
    try:
        shutil.copytree(heads[-1], dst)
    except (IndexError, OSError):  # no head, or it was collected while being copied
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        (dst / "config.json").write_text("{}")
    for f in dst.glob("*.safetensors"):
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    return dst


def plant_orphan_lease(r: Any, cluster: str, node: str, ttl_s: float, hold_s: float = 30.0) -> str:
    """A lease no session holds: a fresh fencing token on the first GPU of `node` with no lease on it, granted two
    TTLs ago, with no session record; its key expires after `hold_s`. Returns the key."""
    for gpu in range(1024):
        key = state.key(cluster, "lease", node=node, gpu=gpu)
        token = int(r.incr(state.key(cluster, "fence")))
        lease = Lease(node=node, gpu=gpu, token=token, holder=PLANTED, granted_at=time.time() - 2 * ttl_s,
                      ttl_s=ttl_s)
        if r.set(key, state.encode(lease), nx=True, px=int(hold_s * 1000)):
            return key
    raise RuntimeError(f"no GPU of node {node} without a lease to plant one on")


def plant_dropped_sample(r: Any, cluster: str, ids: Mapping[bytes, int] | None = None) -> int:
    """Delete the newest RL sample of `ids` (default: of the stream now) from the stream, as a write lost after it
    was acknowledged would leave it. Returns how many were deleted (0: there was none)."""
    ids = stream_samples(r, cluster) if ids is None else ids
    if not ids:
        return 0
    newest = max(ids, key=lambda i: tuple(int(x) for x in i.split(b"-")))
    return int(r.xdel(state.key(cluster, "samples"), newest))


def plant_and_detect(r: Any, cluster: str, node: str, root: Path, ttl_s: float,
                     keep_versions: int) -> dict[str, dict[str, int]]:
    """Each detector on the state as it is (`clean`), then on it with one fault planted: {counter: {planted,
    planted_detected, clean}}. The planted lease and head directory are removed afterwards; the deleted sample
    stays deleted."""
    return {"corrupt_dirs": _plant_head(root), "gpus_still_lent": _plant_lease(r, cluster, node, ttl_s),
            "samples_lost": _plant_sample(r, cluster, keep_versions)}


def _plant_head(root: Path) -> dict[str, int]:
    clean = corrupt_dirs(root)
    d = plant_corrupt_head(root)
    try:
        found = [x for x in corrupt_dirs(root) if x.split(":")[0] == d.name]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"planted": 1, "planted_detected": len(found), "clean": len(clean)}


def _plant_lease(r: Any, cluster: str, node: str, ttl_s: float) -> dict[str, int]:
    clean = orphan_leases(r, cluster)
    key = plant_orphan_lease(r, cluster, node, ttl_s)
    try:
        planted = orphan_leases(r, cluster)
    finally:
        r.delete(key)
    return {"planted": 1, "planted_detected": planted - clean, "clean": clean}


def _plant_sample(r: Any, cluster: str, keep_versions: int) -> dict[str, int]:
    before = stream_samples(r, cluster)
    clean = samples_lost(before, stream_samples(r, cluster), keep_versions)
    planted = plant_dropped_sample(r, cluster, before)
    detected = samples_lost(before, stream_samples(r, cluster), keep_versions) - clean
    return {"planted": planted, "planted_detected": detected, "clean": clean}


def plant_ok(plant: Mapping[str, Mapping[str, int]]) -> bool:
    """Every detector found every fault planted for it, and at least one was planted."""
    return bool(plant) and all(p["planted"] >= 1 and p["planted_detected"] == p["planted"] for p in plant.values())


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
            "samples_checked": sum(len(i.samples_before) for i in mine),
            "samples_lost": sum(i.samples_lost for i in mine),
            # the target: lost beyond what appendfsync everysec allows (the last second's acknowledged writes)
            "samples_lost_beyond_everysec": sum(i.samples_lost_beyond_everysec for i in mine),
            "samples_at_risk": sum(i.samples_at_risk for i in mine),
            "samples_dropped_by_client": sum(i.samples_dropped for i in mine),
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
              f"corrupt {len(i.corrupt_dirs)}, samples lost {i.samples_lost} of {len(i.samples_before)}", file=out)
    for e in drill.errors:
        print(f"  drill error: {e}", file=out)
    faults = summarize(drill.injections, kinds, drill.steps_done)
    result = {
        "machine": machine(), "steps": args.steps, "steps_completed": len(rows), "run_error": error,
        "wall_s": round(time.time() - t0, 1), "faults": faults, "drill_errors": drill.errors,
        "gpus_still_lent_at_end": holder.get("final_orphans"), "corrupt_dirs_at_end": holder.get("final_corrupt"),
        **({"plant": holder.get("plant"), "plant_ok": plant_ok(holder.get("plant") or {})} if args.plant else {}),
        "worker_restarts": demo.worker_restarts, "redis_persistence": "aof appendfsync everysec",
        "lease_ttl_s": demo.cfg.scheduler.lease_ttl_s if demo.cfg else None,
        "leader_ttl_s": demo.cfg.scheduler.leader_ttl_s if demo.cfg else None,
    }
    print(json.dumps(faults, indent=1), file=out)
    if args.plant:
        print(f"  planted faults: {json.dumps(holder.get('plant'))}", file=out)
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
            try:
                if holder.get("drill") is not None:
                    self.last_checks(holder["drill"])
            finally:
                super().stop_services()

        def last_checks(self, d: Drill) -> None:
            """The drill ended; what is left lent or corrupt at the end, then (`--plant`) the planted faults."""
            d.finished.set()
            d.thread.join(timeout=120)
            root = Path(self.cfg.trainer.checkpoint_dir)
            holder["final_orphans"] = d.orphan_leases()
            holder["final_corrupt"] = corrupt_dirs(root)
            if args.plant:  # after the last real checks: a planted fault never counts as the drill's
                holder["plant"] = plant_and_detect(self.r, self.cluster, self.cfg.cluster.node, root,
                                                   self.cfg.scheduler.lease_ttl_s, self.client.samples_keep_versions)

    demo = DrilledDemo(opts, cfg)
    demo.should_stop = lambda: "drill" in holder and holder["drill"].should_stop()
    return demo

