"""A warm session process's wait for its next lend, and what it does meanwhile.

The warm loop (scheduler/session_process.py: `warm_main`) reads one assignment per line on stdin. Between
lends it calls the session entry's `prestage()` (the `SessionEntry` protocol), which reads ahead what the next
lend will start from (the roof's entry reads the newest policy and the lineage head: tailspec/warm.py); a plain
function entry reads nothing ahead and is given no hook. That is host work, so it runs only after the process
has left the last GPU's cores and quota (`leave`), and only where the last placement left the host a share of
its own: a CPU quota ($TAILSPEC_CGROUP: each core keeps the host's share beside its simulated GPUs) or no
placement ($TAILSPEC_CPUS unset: real GPUs, the node's CPUs are the host's). A simulated GPU that owns whole
cores leaves no such share, so nothing is read ahead there.

The host's share is not a quota: outside the GPUs' cgroups a task at the default niceness weighs as much as a whole
GPU's cgroup, and a read-ahead at the niceness of its caller at the start of a rollout (every warm process reads
the policy that step published) would take its time from the rollout workers decoding beside it. So the read-ahead
runs on a thread of its own at PRESTAGE_NICE (core/niceness.py), where it takes what the workers leave; the main
thread, which serves the next lend, keeps its niceness (an unprivileged thread cannot lower it again).
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable

from tailspec.core.niceness import at_niceness
from tailspec.scheduler.cpu_quota import CGROUP_ENV
from tailspec.scheduler.placement import CPUS_ENV

PRESTAGE_EVERY_S = 0.25  # how often an idle warm process looks for something new to read ahead
MAX_FAILURES = 20  # a head collected while it was read fails once; a hook that always fails is given up
PRESTAGE_NICE = 19  # the read-ahead thread's niceness: CPU the rollout workers leave, not theirs


class WarmWait:
    def __init__(self, prestage: Callable[[], object] | None, leave: Callable[[], None], fd: int | None = None):
        self.hook = prestage  # the entry's read-ahead; None: nothing to read ahead, the wait only reads stdin
        self.leave = leave
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.buf = b""
        self.served = False  # a lend's placement is known only after the first
        self.left = False  # left the last GPU's cores since the last lend
        self.cpu_s = 0.0  # CPU seconds spent reading ahead since the last lend
        self.failures = 0  # in a row; the first is said, and reading ahead stops after MAX_FAILURES

    def may_prestage(self) -> bool:
        return (self.hook is not None and self.served and self.failures < MAX_FAILURES
                and (CGROUP_ENV in os.environ or CPUS_ENV not in os.environ))

    def next_line(self) -> str:
        """The next assignment line ("" at EOF), reading ahead every PRESTAGE_EVERY_S while none comes."""
        while b"\n" not in self.buf:
            if self.may_prestage() and not select.select([self.fd], [], [], PRESTAGE_EVERY_S)[0]:
                self._prestage()
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                out, self.buf = self.buf.decode(), b""
                return out
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        if self.cpu_s >= 1e-3:  # the host work reading ahead cost since the last lend, in the session log
            print(f"tailspec warm session: read ahead in {self.cpu_s * 1e3:.0f} ms of CPU since the last lend",
                  file=sys.stderr, flush=True)
        self.served, self.left, self.cpu_s = True, False, 0.0
        return line.decode() + "\n"

    def _prestage(self) -> None:
        if not self.left:
            self.leave()
            self.left = True
        t0 = time.process_time()
        try:
            at_niceness(self.hook, PRESTAGE_NICE, "tailspec-read-ahead")
            self.failures = 0
        except Exception as e:  # noqa: BLE001  best effort: a lend reads what it needs itself
            self.failures += 1
            if self.failures in (1, MAX_FAILURES):
                print(f"tailspec warm session: reading ahead failed ({type(e).__name__}: {str(e)[:200]})"
                      + (", given up" if self.failures == MAX_FAILURES else ""), file=sys.stderr, flush=True)
        self.cpu_s += time.process_time() - t0
