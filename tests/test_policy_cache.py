"""Processes that start together on a cold policy cache (torchrun's ranks in the TRL example, a demo's workers)
build the policy once: the others wait for the first and load what it wrote."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import tailspec.tasks.policy as P

build = P._build_policy


def counted(*a, **k):
    print("BUILT", flush=True)
    return build(*a, **k)


P._build_policy = counted
print("PATH", P.get_policy("micro", cache_dir=sys.argv[1], progress=False, eval_n=8), flush=True)
"""


def test_two_processes_on_a_cold_cache_build_the_policy_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("BUILT") for o in outs) == 1, outs
    paths = {line for o in outs for line in o.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1, outs
    assert (tmp_path / "policies").is_dir() or any(tmp_path.rglob("config.json"))
