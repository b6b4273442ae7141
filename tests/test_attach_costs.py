"""bench attach's overhead breakdown (benchmarks/attach_costs.py): host CPU read from /proc, the trainer threads'
time by cause, what is left of the overhead."""

from __future__ import annotations

import subprocess
import sys
import time

from tailspec.benchmarks.attach_costs import HostCpu, breakdown, host_cpu, trainer_seconds


def test_host_cpu_counts_this_process_and_its_session_processes():
    before = host_cpu(None)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # this process's own work counts as the scheduler's
        pass
    # a child whose command line names the session process module counts as a session
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, "tailspec.scheduler.session_process"])
    try:
        deadline = time.monotonic() + 30
        while (got := host_cpu(None) - before).sessions < 0.25:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        assert got.scheduler >= 0.15 and got.redis == 0.0
    finally:
        child.kill()
        child.wait()


def test_breakdown_puts_the_trainer_threads_beside_the_overhead():
    summaries = [{"tailspec": {"seconds": {"publish": 0.4, "wait_reclaimed": 0.2}}},
                 {"tailspec": {"seconds": {"wait_reclaimed": 0.6, "progress": 0.1}}}]
    t = trainer_seconds(summaries)
    assert t["publish"] == 0.4 and t["wait_reclaimed"] == 0.6 and t["progress"] == 0.1 and t["flush"] == 0.0
    b = breakdown([0.5], [t], [HostCpu(0.4, 0.2, 2.0)], steps=2)
    assert b["trainer_thread_s"]["wait_reclaimed"] == 0.3
    assert abs(b["trainer_thread_total_s"] - 0.55) < 1e-9 and abs(b["unlocated_s"] - (0.5 - 0.55)) < 1e-9
    assert b["host_cpu_s"] == {"scheduler": 0.2, "redis": 0.1, "sessions": 1.0}
