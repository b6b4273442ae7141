"""The GPU-memory handshake: a drained GPU is lent only after its worker reported its memory released and only
when its free memory covers what sessions need; a session that does not fit declines before loading anything,
gives its lease back, and the GPU is free again at the scheduler's next tick."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from tailspec.core import state
from tailspec.core.config import TailspecConfig, TrainerConfig
from tailspec.core.state import GpuState, GpuStatus, GpuTelemetry, PhaseInfo, Progress, SessionInfo
from tailspec.scheduler.idle import IdleDetector

GIB = 1 << 30


def _prog(w: int, active: int, ts: float, released: bool | None = None, free: int | None = None) -> Progress:
    return Progress(worker=f"w{w}", node="n0", gpus=[w], active=active, finished=8 - active, phase="rollout",
                    step=1, ts=ts, mem_released=released, free_mem=free)


def _tel(g: int, ts: float, used: int = 2 * GIB, total: int = 80 * GIB) -> GpuTelemetry:
    return GpuTelemetry(node="n0", gpu=g, util=1.0, mem_used=used, mem_total=total, simulated=True, ts=ts)


def _lends(det: IdleDetector, progress: dict, tel: dict, t0: float = 0.0) -> list[str]:
    phase = PhaseInfo(phase="rollout", step=1, started_at=t0)
    got = []
    for i in range(20):  # 2 s of ticks: far past the idle window
        now = t0 + 0.1 * i
        got += [f"{a.node}:{a.gpu}" for a in det.tick(now, phase, progress, tel) if a.kind == "lend"]
    return got


def test_no_lend_before_the_release_report():
    det = IdleDetector(window_s=0.2, startup_s=0.0)
    tail = _prog(1, 3, 0.0)  # the long tail keeps the phase going
    # worker 0 finished but still holds its memory (it said so): never lent
    progress = {"w0": _prog(0, 0, 0.0, released=False), "w1": tail}
    tel = {("n0", 0): _tel(0, 0.05), ("n0", 1): _tel(1, 0.05)}
    assert _lends(det, progress, tel) == []
    # it reports the release: lent at the next window
    progress["w0"] = _prog(0, 0, 2.0, released=True)
    tel = {("n0", 0): _tel(0, 2.05), ("n0", 1): _tel(1, 2.05)}
    assert _lends(det, progress, tel, t0=2.0)[:1] == ["n0:0"]


def test_require_release_holds_workers_that_never_report():
    progress = {"w0": _prog(0, 0, 0.0), "w1": _prog(1, 3, 0.0)}
    tel = {("n0", 0): _tel(0, 0.05), ("n0", 1): _tel(1, 0.05)}
    assert _lends(IdleDetector(window_s=0.2, startup_s=0.0, require_release=True), progress, tel) == []
    assert _lends(IdleDetector(window_s=0.2, startup_s=0.0), progress, tel)[:1] == ["n0:0"]  # legacy workers


def test_lend_takes_reported_free_memory_into_account():
    tail = _prog(1, 3, 0.0)
    tel = {("n0", 0): _tel(0, 0.05, used=70 * GIB), ("n0", 1): _tel(1, 0.05)}
    det = IdleDetector(window_s=0.2, startup_s=0.0, min_free_bytes=16 * GIB)
    progress = {"w0": _prog(0, 0, 0.0, released=True), "w1": tail}
    assert det.memory_hold(progress["w0"], tel[("n0", 0)]) == "10.00 GiB free < 16.00 GiB needed"
    assert _lends(det, progress, tel) == []  # telemetry: 10 GiB free
    tel[("n0", 0)] = _tel(0, 0.05, used=2 * GIB)
    progress["w0"] = _prog(0, 0, 0.0, released=True, free=4 * GIB)  # the worker measured less: the smaller wins
    assert _lends(det, progress, tel) == []
    progress["w0"] = _prog(0, 0, 0.0, released=True, free=60 * GIB)
    assert _lends(det, progress, tel)[:1] == ["n0:0"]
    # a session reported a larger footprint: the bar rises to it
    det2 = IdleDetector(window_s=0.2, startup_s=0.0)
    det2.learn_need(70 * GIB)
    assert _lends(det2, progress, tel) == []


def test_footprint_reads_headers_and_counts_what_training_holds():
    from tailspec.drafter_trainer.footprint import checkpoint_params, session_footprint

    from tailspec.tasks.policy import get_policy, load_policy

    path = get_policy("micro", progress=False)
    model, _ = load_policy(path)
    assert checkpoint_params(path) == sum(p.numel() for p in model.parameters())
    cfg = TrainerConfig(batch_size=4, max_seq_len=128)
    fp = session_footprint(path, cfg, torch.float32)
    assert fp.teacher == 4 * checkpoint_params(path)
    assert fp.drafter > 0 and fp.activations > 0
    assert fp.total > fp.teacher + fp.drafter + fp.activations  # the margin
    bigger = session_footprint(path, TrainerConfig(batch_size=8, max_seq_len=128), torch.float32)
    assert bigger.activations == 2 * fp.activations
    assert session_footprint(path, cfg, torch.bfloat16).teacher == fp.teacher // 2


def test_footprint_is_remembered_per_policy_shape_and_recomputed_when_it_changes(tmp_path):
    import shutil

    from tailspec.drafter_trainer import footprint

    from tailspec.tasks.policy import get_policy

    src = get_policy("micro", progress=False)
    cfg = TrainerConfig(batch_size=4, max_seq_len=128)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    shutil.copytree(src, v1)
    shutil.copytree(src, v2)
    first = footprint.session_footprint(v1, cfg)
    assert footprint.session_footprint(v2, cfg) is first  # the next version's directory: the same shapes
    assert footprint._footprint(v2, cfg, torch.float32, 0.2) == first  # what computing it gives
    # another shape: a wider model's config and weights are not served the remembered figure
    conf = json.loads((v2 / "config.json").read_text())
    conf["intermediate_size"] *= 2
    (v2 / "config.json").write_text(json.dumps(conf))
    from transformers import AutoConfig, AutoModelForCausalLM

    from tailspec.tasks.policy import load_policy

    wider = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(v2)))
    wider.save_pretrained(v2)
    assert load_policy(v2)[0].config.intermediate_size == conf["intermediate_size"]
    again = footprint.session_footprint(v2, cfg)
    assert again is not first and again.teacher > first.teacher
    assert again == footprint._footprint(v2, cfg, torch.float32, 0.2)


def test_footprint_rejects_a_directory_without_weights(tmp_path):
    from tailspec.drafter_trainer.footprint import checkpoint_params

    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_params(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="truncated header"):
        checkpoint_params(tmp_path)


class _FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, free: int | None):
        self.free, self.calls = free, []

    def nvmlInit(self):
        if self.free is None:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls.append(i)
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(free=self.free, used=0, total=self.free)


def test_free_memory_from_nvml_or_the_simulation(redis_client):
    from tailspec.scheduler.telemetry import SimulatedTelemetry, free_memory

    nv = _FakeNvml(5 * GIB)
    assert free_memory(redis_client, "fm", "n0", 3, nvml=nv) == (5 * GIB, "nvml") and nv.calls == [3]
    free, why = free_memory(redis_client, "fm", "n0", 3, nvml=_FakeNvml(None))
    assert free is None and "Driver Not Loaded" in why
    # a simulated GPU: the configured size less what its worker holds (a released worker keeps 1/80)
    sim = SimulatedTelemetry("n0", redis_client, "fm", num_gpus=1, mem_total=8 * GIB)
    for s in sim.sample():
        state.put(redis_client, state.key("fm", "telemetry", node="n0", gpu=0), s)
    assert free_memory(redis_client, "fm", "n0", 0, simulated_mem=8 * GIB) == (8 * GIB, "simulated")
    redis_client.sadd(state.key("fm", "workers"), "w0")
    state.put(redis_client, state.key("fm", "progress", worker="w0"), _prog(0, 2, time.time()))
    assert free_memory(redis_client, "fm", "n0", 0, simulated_mem=8 * GIB)[0] == 8 * GIB - 3 * GIB - 2 * GIB // 40
    state.put(redis_client, state.key("fm", "progress", worker="w0"), _prog(0, 0, time.time(), released=True))
    assert free_memory(redis_client, "fm", "n0", 0, simulated_mem=8 * GIB)[0] == 8 * GIB - 8 * GIB // 80


def test_a_session_that_does_not_fit_declines_and_the_gpu_is_free_at_the_next_tick(redis_url, redis_client,
                                                                                     tmp_path):
    """Real scheduler, real session process (the default entry), simulated GPUs of 4 MiB: the micro policy's
    session needs more, so it declines before loading; its lease is gone at once, the GPU leaves LENT at the
    scheduler's first tick after the process ended, and it is not lent again while its free memory is below
    what the session computed."""
    from tailspec.scheduler.client import TailspecClient
    from tailspec.scheduler.dispatch import LocalDispatcher
    from tailspec.scheduler.monitor import TelemetryMonitor
    from tailspec.scheduler.service import Scheduler
    from tailspec.scheduler.telemetry import SimulatedTelemetry

    from tailspec.tasks.policy import get_policy
    from tailspec.top import gather, render_text

    cl = "decline"
    policy = get_policy("micro", progress=False)
    cfg = TailspecConfig.model_validate({
        "cluster": {"name": cl, "redis_url": redis_url},
        "scheduler": {"telemetry": "simulated", "simulated_gpus": 2, "simulated_gpu_mem_gib": 4 / 1024,
                      "idle_window_s": 0.05, "session_startup_s": 0.0, "lease_ttl_s": 20.0,
                      "simulated_gpu_cpus": "shared"},
        "trainer": {"checkpoint_dir": str(tmp_path / "drafter")},
    })
    mon = TelemetryMonitor(SimulatedTelemetry("node0", redis_client, cl, 2, mem_total=4 << 20), redis_client, cl)
    disp = LocalDispatcher(cfg.scheduler.session_entry, log_dir=str(tmp_path / "logs"))
    sched = Scheduler(cfg, redis_client, disp, redis_url=redis_url)
    c = TailspecClient(redis_url, cluster=cl)
    try:
        c.set_phase("rollout", 1, policy_version=1, policy_path=str(policy))
        c.report_progress("w1", [1], active=3, finished=1, step=1)  # the tail
        c.report_progress("w0", [0], active=0, finished=4, step=1, mem_released=False)
        assert c.flush(5)

        def tick():
            c.report_progress("w1", [1], active=3, finished=1, step=1)  # keep-alive
            mon.sample_once()
            return sched.tick()

        for _ in range(10):  # drained and idle, but its memory is held: no lend
            assert not [a for a in tick() if a.kind == "lend"]
            time.sleep(0.02)
        c.report_progress("w0", [0], active=0, finished=4, step=1, mem_released=True)
        assert c.flush(5)
        sid = None
        for _ in range(100):
            lent = [a for a in tick() if a.kind == "lend"]
            if lent:
                assert (lent[0].node, lent[0].gpu) == ("node0", 0)
                sid = sched.detector.machine("node0", 0).session_id
                break
            time.sleep(0.02)
        assert sid is not None, "GPU 0 was not lent after the release report"
        # Tick until the session process has ended; the tick right after must give the GPU back.
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the session did not end"
            ended = sid in disp.poll()
            actions = tick()
            back = [a for a in actions if a.kind == "reclaimed" and a.session_id == sid]
            if back:
                # The tick polls the dispatcher itself: the process may have exited between our poll and the
                # tick, and then this tick is the first after the end. Never while it still runs, though.
                assert sid not in disp.procs, "the GPU was given back while its session process was still running"
                assert back[0].reason == "session ended", back[0]
                break
            assert not ended, "the GPU was not given back at the first tick after the session ended"
            time.sleep(0.05)
        st = state.get(redis_client, state.key(cl, "gpu_status", node="node0", gpu=0), GpuStatus)
        assert st is not None and st.state != GpuState.LENT
        assert redis_client.get(state.key(cl, "lease", node="node0", gpu=0)) is None
        info = state.get(redis_client, state.key(cl, "session", session_id=sid), SessionInfo)
        assert info is not None and info.declined and info.status == "stopped", info
        assert info.stop_reason.startswith("declined: needs ") and "(simulated)" in info.stop_reason
        assert info.mem_needed > info.mem_free and info.step == 0 and info.tokens == 0
        # nothing was loaded or written: no lineage head, no drafter directory
        assert redis_client.get(state.key(cl, "lineage_head")) is None
        assert not (tmp_path / "drafter").exists()
        # learned: not lent again while less is free than the session needs
        assert sched.detector.mem_needed == info.mem_needed
        for _ in range(10):
            assert not [a for a in tick() if a.kind == "lend"]
            time.sleep(0.02)
        text = render_text(gather(redis_client, cl), cl)
        assert "declined 1" in text and f"last declined: node0:gpu0 {sid}: declined: needs" in text, text
    finally:
        c.close()
        sched.shutdown()
