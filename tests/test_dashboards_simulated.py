"""/metrics scraped while the scheduler's scripted long-tail rollout runs with lending: the real
scheduler loop, the real client, real session processes and Redis; only the GPUs are simulated."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tailspec.core.config import load_config
from tailspec.dashboards.server import start_exporter

pytest.importorskip("tailspec.scheduler.scripted_rollout")

CLUSTER = "sim"
# Worker 0 holds the long tail (250 tokens = 2.5 s); workers 1-3 drain after 60 tokens and are lent
# long enough for their session processes to start, train and record their stop latency. Every state
# but `drained` (≈ the idle window) lasts ≥ 0.6 s, so scrapes every 50 ms see it even on a busy machine.
LENGTHS = [250, 60] + [60, 60] * 3
TRAIN_S = 1.0


class SchedulerRun:
    """The single-node scheduler (telemetry monitor + decision loop) on a thread, stopped on exit."""

    def __init__(self, redis_url: str):
        from tailspec.scheduler.service import run_local

        self.cfg = load_config(None, [
            f"cluster.name={CLUSTER}", "scheduler.telemetry=simulated", "scheduler.simulated_gpus=4",
            "scheduler.session_entry=tailspec.scheduler.busy_sessions:busy_session",
        ], environ={})
        self.stop = threading.Event()
        self.thread = threading.Thread(target=run_local, args=(self.cfg, self.stop, redis_url), daemon=True)

    def __enter__(self) -> SchedulerRun:  # noqa: PYI034 (py3.10: no typing.Self)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=15)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow
def test_metrics_move_during_a_simulated_rollout_with_lending(redis_url, redis_client):
    from tailspec.scheduler.scripted_rollout import run_scripted_rollout

    exporter = start_exporter(redis_url, CLUSTER)
    scrapes: list[tuple[float, dict]] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            scrapes.append((time.time(), scrape(exporter.url)))
            time.sleep(0.05)

    try:
        with SchedulerRun(redis_url):
            th = threading.Thread(target=scraper, daemon=True)
            th.start()
            result = run_scripted_rollout(redis_url, workers=4, steps=2, requests_per_worker=2, lengths=LENGTHS,
                                           token_time_s=0.01, train_s=TRAIN_S, cluster=CLUSTER)
            time.sleep(1.5)  # revoked sessions stop, the last GPUs are reclaimed
            done.set()
            th.join(timeout=10)
        final = scrape(exporter.url)  # the scheduler and its sessions have stopped: nothing moves now
    finally:
        exporter.stop()

    assert len(scrapes) > 20
    # Each GPU's sequence of states as /metrics showed them (exactly one state is 1 per GPU).
    seq: dict[str, list[str]] = defaultdict(list)
    for _, m in scrapes:
        on = defaultdict(list)
        for (name, labels), v in m.items():
            if name == "tailspec_gpu_state" and v == 1.0:
                d = dict(labels)
                on[d["gpu"]].append(d["state"])
        for gpu, states in on.items():
            assert len(states) == 1, (gpu, states)
            if not seq[gpu] or seq[gpu][-1] != states[0]:
                seq[gpu].append(states[0])

    def went(s: list[str], *path: str) -> bool:  # `path` is a subsequence of s
        it = iter(s)
        return all(p in it for p in path)

    # The short workers' GPUs are lent, come back to generate in the next step and are lent again;
    # at least one was seen going drained → lent → generating (a drain is short: a scrape may miss it).
    for gpu in ("1", "2", "3"):
        assert went(seq[gpu], "generating", "lent", "generating", "lent"), (gpu, " ".join(seq[gpu]))
    assert any(went(seq[g], "drained", "lent", "generating") for g in ("1", "2", "3")), dict(seq)
    assert "lent" not in seq["0"], seq["0"]  # the long tail's own GPU is never lent

    # Counters only grow; lent (reclaimed) GPU-seconds grow while a GPU is lent.
    totals = sorted({name for _, m in scrapes for (name, _) in m if name.endswith("_total")})
    for name in totals:
        values = [m[(name, ())] for _, m in scrapes if (name, ()) in m]
        assert values == sorted(values), name
    lent = [m[("tailspec_lent_gpu_seconds_total", ())] for _, m in scrapes]
    n_lent = [m[("tailspec_gpus", (("state", "lent"),))] for _, m in scrapes]
    grew_while_lent = sum(1 for i in range(1, len(lent)) if n_lent[i - 1] > 0 and n_lent[i] > 0 and lent[i] > lent[i - 1])
    assert grew_while_lent >= 3
    assert lent[0] < lent[-1]

    idle = final[("tailspec_idle_gpu_seconds_total", ())]
    # Ground truth from the simulation: the idle GPU time the tail left (phase end − drain, summed).
    # The scheduler measures it from its own ticks, so allow slack for detection and tick timing.
    assert 0.5 * result.idle_gpu_seconds <= idle <= 1.2 * result.idle_gpu_seconds + 0.5, (idle, result.idle_gpu_seconds)
    lent_total = final[("tailspec_lent_gpu_seconds_total", ())]
    assert lent[-1] <= lent_total <= idle
    assert final[("tailspec_reclaimed_share_ratio", ())] == pytest.approx(lent_total / idle)
    assert final[("tailspec_sessions_started_total", ())] >= 3
    assert final[("tailspec_sessions_preempted_total", ())] >= 1
    # The stop-latency histogram holds exactly the latencies the sessions recorded. (A session whose
    # process was still starting when revoked records none: on a busy machine that can be all of them,
    # so the count is compared, not required to be positive; test_dashboards_exporter covers values.)
    from tailspec.core import state

    ids = [m.decode() for m in redis_client.smembers(state.key(CLUSTER, "sessions"))]
    infos = [state.get(redis_client, state.key(CLUSTER, "session", session_id=i), state.SessionInfo) for i in ids]
    latencies = [i.stop_latency_s for i in infos if i is not None and i.stop_latency_s is not None]
    assert final[("tailspec_session_stop_latency_seconds_count", ())] == len(latencies)
    assert final[("tailspec_session_stop_latency_seconds_sum", ())] == pytest.approx(sum(latencies))
    sims = {dict(lbl)["simulated"] for (n, lbl) in final if n == "tailspec_gpu_utilization_ratio"}
    assert sims == {"true"}  # simulated GPUs are labelled so
