"""Simulated GPUs own CPU cores: the split, the pinning of workers and of sessions lent on a GPU."""

import json
import os
import subprocess
import sys
import time

import pytest
from tailspec.scheduler import cpu_quota, placement
from tailspec.scheduler.dispatch import LocalDispatcher
from tailspec.scheduler.session_process import SessionContext


def test_split_gives_each_gpu_an_equal_contiguous_share():
    assert placement.split(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert placement.split(4, [0, 1, 2, 3]) == [[0], [1], [2], [3]]
    assert placement.split(2, [4, 5, 6]) == [[4], [5]]  # the odd core stays the host's
    shares = placement.split(3, list(range(8)))
    assert all(len(s) == 2 for s in shares) and len({c for s in shares for c in s}) == 6  # disjoint


def test_split_refuses_more_gpus_than_cores_and_fit_says_how_many():
    with pytest.raises(ValueError, match="cannot each own a core.*at most 2"):
        placement.split(4, [0, 1])
    assert placement.gpus_that_fit(4, [0, 1]) == 2
    assert placement.gpus_that_fit(1, [0, 1]) == 1
    assert placement.gpus_that_fit(4, [0, 1], quota=True) == 4
    assert placement.gpus_that_fit(8, [0, 1], quota=True) == 2 * placement.MAX_GPUS_PER_CORE


def test_shares_put_two_gpus_on_a_core_under_a_quota_only():
    S = placement.Share
    assert placement.shares(2, [0, 1], quota=True) == [S([0]), S([1])]  # enough cores: no quota
    # two to a core, each at half of what the host's share leaves
    assert placement.HOST_SHARE == 0.1
    assert placement.shares(4, [0, 1], quota=True) == [S([0], 0.45), S([0], 0.45), S([1], 0.45), S([1], 0.45)]
    assert placement.shares(3, [0, 1], quota=True) == [S([0], 0.45), S([0], 0.45), S([1], 0.45)]
    with pytest.raises(ValueError, match="cannot each own a core"):
        placement.shares(4, [0, 1])
    with pytest.raises(ValueError, match="at most 2 share a core.*run at most 4"):
        placement.shares(5, [0, 1], quota=True)


def test_parse_cpus_names_the_bad_entry():
    assert placement.parse_cpus("0, 2,5") == [0, 2, 5]
    with pytest.raises(ValueError, match="'x' is not a core number"):
        placement.parse_cpus("0,x")


def test_demo_worker_pins_itself_to_its_gpus_cores():
    core = placement.host_cpus()[-1]
    code = ("import os, sys; from tailspec.scheduler.placement import parse_cpus, pin; import torch; "
            f"pin(parse_cpus('{core}')); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"[{core}]", "1"]


def test_place_workers_runs_fewer_simulated_gpus_than_asked_on_a_small_machine(monkeypatch):
    import torch
    from tailspec.core.config import load_config

    from tailspec.demo.services import place_workers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(placement, "host_cpus", lambda: [0, 1])
    monkeypatch.setattr(cpu_quota, "root", lambda: (None, "no cgroup cpu controller mounted"))
    p = place_workers(4, load_config(environ={}))
    assert (p.workers, p.cpus, p.quota) == (2, [[0], [1]], None)
    assert "4 asked" in p.note and "2 cores" in p.note and "no CPU quota" in p.note
    monkeypatch.setattr(cpu_quota, "root", lambda: ("/a/writable/hierarchy", ""))
    q = place_workers(4, load_config(environ={}))
    assert (q.workers, q.cpus, q.quota) == (4, [[0], [0], [1], [1]], [0.45] * 4) and "0.45 of a core" in q.note
    shared = place_workers(4, load_config(overrides=["scheduler.simulated_gpu_cpus=shared"], environ={}))
    assert (shared.workers, shared.cpus) == (4, None)


def _ctx(redis_url, sid, gpu):
    return SessionContext(session_id=sid, node="n0", gpu=gpu, lease_token=1, redis_url=redis_url, cluster="p",
                          require_heartbeat=False)


def _probe_dispatcher(tmp_path, warm, gpu_cpus=None) -> LocalDispatcher:
    return LocalDispatcher("tailspec.scheduler.busy_sessions:env_probe_session", log_dir=str(tmp_path), warm=warm,
                           gpu_cpus=gpu_cpus, extra_env={"TAILSPEC_PROBE_DIR": str(tmp_path)})


def _probe_when_ended(d: LocalDispatcher, tmp_path, sid: str) -> dict:
    """Wait for the started session `sid` to end cleanly; what its env_probe_session recorded."""
    deadline = time.time() + 60
    while sid not in d.poll() and time.time() < deadline:
        time.sleep(0.05)
    assert d.ended.get(sid) == 0
    return json.loads((tmp_path / f"probe-{sid}.json").read_text())


@pytest.mark.parametrize("warm", [1, 0])
def test_a_session_lent_on_a_simulated_gpu_runs_on_that_gpus_cores(tmp_path, redis_url, warm):
    host = placement.host_cpus()
    gpu_cpus = {0: host[:1], 1: host[-1:]}
    d = _probe_dispatcher(tmp_path, warm, gpu_cpus)
    sid = f"s-pin-{warm}"
    try:
        d.start(_ctx(redis_url, sid, gpu=1))
        assert _probe_when_ended(d, tmp_path, sid)["cpus"] == gpu_cpus[1]
        with pytest.raises(ValueError, match="GPU 5 owns no cores"):
            d.start(_ctx(redis_url, "s-nowhere", gpu=5))
    finally:
        d.shutdown()


def test_service_splits_only_simulated_gpus_that_fit(monkeypatch):
    from tailspec.core.config import load_config
    from tailspec.scheduler.placement import simulated_gpu_placement

    def simulated_gpu_cpus(cfg):
        return simulated_gpu_placement(cfg)[0]

    monkeypatch.setattr(placement, "host_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cpu_quota, "root", lambda: (None, "no cgroup cpu controller mounted"))
    cfg = load_config(overrides=["scheduler.simulated_gpus=2"], environ={})
    assert simulated_gpu_cpus(cfg) == {0: [0, 1], 1: [2, 3]}
    cfg = load_config(overrides=["scheduler.simulated_gpus=8"], environ={})
    assert simulated_gpu_cpus(cfg) is None  # more GPUs than cores: shared, with a warning
    cfg = load_config(overrides=["scheduler.simulated_gpus=2", "scheduler.simulated_gpu_cpus=shared"], environ={})
    assert simulated_gpu_cpus(cfg) is None


def test_a_warm_replacement_imports_on_the_lent_gpus_cores(tmp_path, redis_url):
    """When the pool must start a process during a run (one of its processes died), the replacement imports
    on the cores of the GPU just lent, at nice 10 (its imports never run where another GPU's tail decodes),
    and is moved to whichever GPU it is assigned next."""
    host = placement.host_cpus()
    gpu_cpus = {0: host[:1], 1: host[-1:]}
    d = _probe_dispatcher(tmp_path, 1, gpu_cpus)
    try:
        d._warm[0][0].kill()  # the pool's only process dies
        d._warm[0][0].wait()
        d.start(_ctx(redis_url, "s-a", gpu=1))  # a cold start, and a replacement for the pool
        replacement = d._warm[0][0]
        deadline = time.time() + 30
        while os.sched_getaffinity(replacement.pid) != set(gpu_cpus[1]) and time.time() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(replacement.pid) == set(gpu_cpus[1])
        d.start(_ctx(redis_url, "s-b", gpu=0))
        assert d.pid("s-b") == replacement.pid
        probe = _probe_when_ended(d, tmp_path, "s-b")
        assert probe["cpus"] == gpu_cpus[0]
        assert probe["nice"] == min(19, os.nice(0) + 10)  # imported at nice 10 beside the lent GPU's session
    finally:
        d.shutdown()


def test_a_warm_process_serves_one_session_after_another(tmp_path, redis_url):
    """Lends are short and frequent: a warm process returns to the pool when its session ends and runs the
    next one without importing again (same pid), re-pinned to the new GPU's cores."""
    host = placement.host_cpus()
    gpu_cpus = {0: host[:1], 1: host[-1:]}
    d = _probe_dispatcher(tmp_path, 1, gpu_cpus)
    try:
        first = d._warm[0][0].pid
        probes = []
        for i, gpu in enumerate((0, 1, 0)):
            d.start(_ctx(redis_url, f"s-{i}", gpu=gpu))
            probes.append(_probe_when_ended(d, tmp_path, f"s-{i}"))
        assert [p["cpus"] for p in probes] == [gpu_cpus[0], gpu_cpus[1], gpu_cpus[0]]
        assert probes[0]["pid"] == first and probes[2]["pid"] in {p["pid"] for p in probes[:2]}  # reused
        pids = {p["pid"] for p in probes}
    finally:
        d.shutdown()
    for pid in pids:  # no process outlives the dispatcher
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_on_real_gpus_a_warm_process_serves_only_the_gpu_it_initialised(tmp_path, redis_url):
    d = _probe_dispatcher(tmp_path, 1)
    try:
        pids = []
        for i, gpu in enumerate((0, 1, 0)):
            d.start(_ctx(redis_url, f"r-{i}", gpu=gpu))
            probe = _probe_when_ended(d, tmp_path, f"r-{i}")
            assert probe["CUDA_VISIBLE_DEVICES"] == str(gpu)
            pids.append(probe["pid"])
        assert pids[1] != pids[0] and pids[2] == pids[0]  # GPU 1 got another process; GPU 0 its own back
    finally:
        d.shutdown()


needs_quota = pytest.mark.skipif(cpu_quota.root()[0] is None, reason=f"no CPU quota here: {cpu_quota.root()[1]}")


@needs_quota
def test_a_quota_holds_a_busy_process_to_its_share_of_a_core(tmp_path):
    """Two busy processes pinned to one core, each in its own half-core quota, each get about half of it; the
    cgroups are gone after remove(). The figure the CPU quota exists for: a simulated GPU's compute is its own."""
    core = placement.host_cpus()[-1]
    paths = [cpu_quota.create(cpu_quota.name_for(f"qtest-{os.getpid()}", g), 0.5) for g in range(2)]
    code = ("import os, sys, time; from tailspec.scheduler import cpu_quota; cpu_quota.join(sys.argv[1]); "
            f"os.sched_setaffinity(0, [{core}]); t0 = time.time(); c0 = time.process_time()\n"
            "while time.time() - t0 < 1.5: pass\n"
            "print((time.process_time() - c0) / (time.time() - t0))")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, p], stdout=subprocess.PIPE, text=True) for p in paths]
        got = [float(p.communicate(timeout=60)[0]) for p in procs]
        assert all(0.35 < g < 0.6 for g in got), got
    finally:
        for p in paths:
            cpu_quota.remove(p)
    assert not any(os.path.exists(p) for p in paths)


@needs_quota
def test_the_scheduler_gives_gpus_sharing_a_core_a_quota_each(monkeypatch):
    from tailspec.core.config import load_config
    from tailspec.scheduler.placement import simulated_gpu_placement

    monkeypatch.setattr(placement, "host_cpus", lambda: [0, 1])
    cfg = load_config(overrides=["scheduler.simulated_gpus=4", f"cluster.name=qsvc{os.getpid()}"], environ={})
    cpus, groups = simulated_gpu_placement(cfg)
    assert cpus == {0: [0], 1: [0], 2: [1], 3: [1]}
    try:
        assert sorted(groups) == [0, 1, 2, 3] and len(set(groups.values())) == 4
        for g, path in groups.items():
            assert path.endswith(cpu_quota.name_for(cfg.cluster.name, g))
            quota = open(os.path.join(path, "cpu.cfs_quota_us")).read().strip() if os.path.exists(
                os.path.join(path, "cpu.cfs_quota_us")) else open(os.path.join(path, "cpu.max")).read().split()[0]
            assert int(quota) == round(cpu_quota.PERIOD_US * (1 - placement.HOST_SHARE) / 2)
        cfg2 = load_config(overrides=["scheduler.simulated_gpus=2"], environ={})
        assert simulated_gpu_placement(cfg2) == ({0: [0], 1: [1]}, None)  # a core each: no quota
    finally:
        for path in (groups or {}).values():
            cpu_quota.remove(path)
