"""A simulated GPU's share of a core: a cgroup whose CFS bandwidth quota is that share.

A simulated GPU stands for a whole device, so its compute must be its own (scheduler/placement.py). With at least
one core per GPU, affinity does it. With more GPUs than cores, two GPUs pinned to one core would share it as the
kernel pleases, and a session lent on one would take the other's time; a CPU quota gives each exactly its share,
busy or not, as a device is: a cgroup per GPU, `cpu.cfs_quota_us / cpu.cfs_period_us` (cgroup v1) or `cpu.max`
(v2) set to the share, holding the GPU's rollout worker and any session lent on it. The period is short (10 ms)
so a throttled decode step waits milliseconds, not a tenth of a second.

Creating a cgroup needs a writable cpu controller (root, or a delegated subtree); `root()` probes for one once
and says why not, and placement runs fewer GPUs where there is none.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CGROUP_ENV = "TAILSPEC_CGROUP"  # the cgroup directory a session process joins (a GPU with a quota)
PERIOD_US = 10_000
_CANDIDATES = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup")
_probed: tuple[Path | None, str] | None = None


def _is_v2(d: Path) -> bool:
    return (d / "cpu.max").exists()


def _set_quota(d: Path, share: float) -> None:
    quota = max(1000, int(PERIOD_US * share))
    if _is_v2(d):
        (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (d / "cpu.cfs_quota_us").write_text(str(quota))


def root() -> tuple[Path | None, str]:
    """(the writable cpu-controller hierarchy, "") or (None, why not). Probed once per process: a cgroup is
    created, given a quota and removed."""
    global _probed
    if _probed is None:
        _probed = _probe()
    return _probed


def _own(mount: str) -> Path:
    """This process's own cgroup in the hierarchy mounted at `mount` (/proc/self/cgroup): quotas are made below it,
    never beside it, so a run inside a container's CPU limit stays inside it."""
    v2 = mount.endswith("/cgroup")  # the unified hierarchy: its line names no controller ("0::/path")
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if (ctrls == "") if v2 else ("cpu" in ctrls.split(",")):
                return Path(mount) / path.lstrip("/")
    except (OSError, ValueError):
        pass
    return Path(mount)


def _probe() -> tuple[Path | None, str]:
    why = "no cgroup cpu controller mounted"
    for c in _CANDIDATES:
        base = _own(c)
        if not (base / "cgroup.procs").exists() or not ((base / "cpu.cfs_quota_us").exists()
                                                        or (base / "cgroup.subtree_control").exists()):
            continue
        probe = base / f"tailspec-probe-{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            try:
                _set_quota(probe, 0.5)
            finally:
                probe.rmdir()
            return base, ""
        except OSError as e:
            why = f"cannot create a CPU quota under {base}: {e.strerror or e}"
    return None, why


def name_for(cluster: str, gpu: int) -> str:
    """The cgroup's name for a cluster's simulated GPU (one cgroup per GPU and cluster: runs side by side never
    share one)."""
    return f"tailspec-{re.sub(r'[^A-Za-z0-9_.-]', '_', cluster)[:80]}-gpu{gpu}"


def create(name: str, share: float) -> str:
    """A cgroup (made if missing) limited to `share` of one core; its directory."""
    base, why = root()
    if base is None:
        raise OSError(f"CPU quota unavailable: {why}")
    if not 0 < share <= 64:
        raise ValueError(f"share must be in (0, 64] cores, got {share}")
    d = base / name
    d.mkdir(exist_ok=True)
    _set_quota(d, share)
    return str(d)


_joined: str | None = None  # the quota this process joined itself (leave() is a no-op otherwise)


def join(path: str, pid: int = 0) -> None:
    """Move process `pid` (0: this one), every thread of it, into the cgroup at `path`; children it starts later
    are born there."""
    global _joined
    Path(path, "cgroup.procs").write_text(str(pid or os.getpid()))
    if not pid or pid == os.getpid():
        _joined = path


def leave(pid: int = 0) -> None:
    """Back to the cgroup the quotas were made under (no quota). For this process: only if it joined one."""
    global _joined
    if (not pid or pid == os.getpid()) and _joined is None:
        return
    base, _ = root()
    if base is not None:
        Path(base, "cgroup.procs").write_text(str(pid or os.getpid()))
    if not pid or pid == os.getpid():
        _joined = None


def remove(path: str) -> None:
    """Move whatever is still in the cgroup to the root, then delete it (best effort: a process that ends meanwhile
    is fine)."""
    d = Path(path)
    if not d.exists():
        return
    try:
        for pid in (d / "cgroup.procs").read_text().split():
            try:
                leave(int(pid))
            except OSError:
                pass
        d.rmdir()
    except OSError:
        pass


def join_from_env() -> str | None:
    """Join $TAILSPEC_CGROUP when it is set (a session lent on a simulated GPU with a quota); its path, or None."""
    path = os.environ.get(CGROUP_ENV, "").strip()
    if not path:
        return None
    join(path)
    return path
