"""Prometheus exporter: scrape /metrics over HTTP from a real server while the state changes."""

from __future__ import annotations

import math
import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tailspec.dashboards.exporter import METRICS, STOP_LATENCY_BUCKETS, exposed_names
from tailspec.dashboards.server import start_exporter
from test_dashboards_writer import StateWriter


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def gpu_state(m, gpu: int) -> str:
    on = [dict(lbl)["state"] for (name, lbl), v in m.items()
          if name == "tailspec_gpu_state" and dict(lbl)["gpu"] == str(gpu) and v == 1.0]
    assert len(on) == 1, on  # exactly one state is 1 per GPU
    return on[0]


@pytest.fixture
def exporter(redis_url):
    srv = start_exporter(redis_url, "t")
    yield srv
    srv.stop()


def test_values_move_through_a_lending_cycle(redis_client, exporter):
    w = StateWriter(redis_client)
    w.phase("rollout", step=1)
    w.cycle(0, "generating")
    w.cycle(1, "generating")
    m = scrape(exporter.url)
    assert gpu_state(m, 0) == "generating" and m[("tailspec_lent_gpu_seconds_total", ())] == 0.0
    assert m[("tailspec_gpu_utilization_ratio", (("gpu", "0"), ("node", "node0"), ("simulated", "true"),
                                                 ("worker", "w0")))] == pytest.approx(0.95)

    w.cycle(0, "drained", dt=1.5)
    m = scrape(exporter.url)
    assert gpu_state(m, 0) == "drained" and gpu_state(m, 1) == "generating"
    assert m[("tailspec_idle_gpu_seconds_total", ())] == 1.5
    assert m[("tailspec_gpus", (("state", "drained"),))] == 1.0

    lent_seen = []
    w.cycle(0, "lent", session_id="s1", dt=0.5)
    for _ in range(3):
        w.cycle(0, "train", session_id="s1", dt=0.5)
        m = scrape(exporter.url)
        assert gpu_state(m, 0) == "lent"
        lent_seen.append(m[("tailspec_lent_gpu_seconds_total", ())])
    assert lent_seen == [1.0, 1.5, 2.0]  # reclaimed GPU-seconds grow while the GPU is lent
    assert m[("tailspec_idle_gpu_seconds_total", ())] == 1.5 + 2.0
    assert m[("tailspec_reclaimed_share_ratio", ())] == pytest.approx(2.0 / 3.5)
    assert m[("tailspec_sessions", (("status", "running"),))] == 1.0
    gpu0 = (("gpu", "0"), ("node", "node0"), ("worker", "w0"))
    assert m[("tailspec_drafter_training_steps", gpu0)] == 35.0  # 5 + 3 × 10
    assert m[("tailspec_drafter_training_loss", gpu0)] == pytest.approx(2.5 * 0.8**3)

    w.cycle(0, "reclaiming", session_id="s1")
    assert gpu_state(scrape(exporter.url), 0) == "reclaiming"
    w.cycle(0, "reclaimed", session_id="s1")
    m = scrape(exporter.url)
    assert gpu_state(m, 0) == "generating"
    assert m[("tailspec_lent_gpu_seconds_total", ())] == 2.0  # no longer grows once reclaimed
    assert m[("tailspec_sessions_started_total", ())] == 1.0
    assert m[("tailspec_sessions_stopped_total", ())] == 1.0
    assert m[("tailspec_sessions_preempted_total", ())] == 1.0
    assert m[("tailspec_sessions_declined_total", ())] == 0.0
    assert m[("tailspec_session_stop_latency_seconds_count", ())] == 1.0
    w.add("sessions_declined", 1)  # what the scheduler counts when a session's footprint did not fit
    assert scrape(exporter.url)[("tailspec_sessions_declined_total", ())] == 1.0
    assert m[("tailspec_drafter_guard_trips_total", ())] == 0.0
    from tailspec.rollout.health_guard import Verdict, record_verdict

    def verdict(tripped: bool, version: int) -> Verdict:
        return Verdict(tripped=tripped, version=version, event="policy_sync", live=1.0 if tripped else 2.4,
                       validated=2.5, steps=16, reason="live 1.00 <= floor 1.05" if tripped else "")

    # what rollout workers publish when their drafter health guard judges a window
    record_verdict(redis_client, w.cluster, "w0", verdict(True, 3))
    record_verdict(redis_client, w.cluster, "w1", verdict(True, 3))
    record_verdict(redis_client, w.cluster, "w2", verdict(False, 3))
    m = scrape(exporter.url)
    assert m[("tailspec_drafter_guard_trips_total", ())] == 2.0
    assert m[("tailspec_drafter_guard_speculation_off", ())] == 2.0
    record_verdict(redis_client, w.cluster, "w0", verdict(False, 4))  # a good version loaded on w0
    m = scrape(exporter.url)
    assert m[("tailspec_drafter_guard_trips_total", ())] == 2.0  # a counter: trips stay counted
    assert m[("tailspec_drafter_guard_speculation_off", ())] == 1.0


def test_stop_latency_histogram_matches_an_independent_count(redis_client, exporter):
    w = StateWriter(redis_client)
    rng = random.Random(0)
    lat = [rng.expovariate(2.0) for _ in range(40)] + [0.25, 1.0]  # values on bucket edges count as ≤ le
    for i, x in enumerate(lat):
        w.session(f"s{i}", gpu=i % 4, status="stopped", stop_latency_s=x)
    w.session("running", gpu=0, status="running")  # no latency yet: not observed
    m = scrape(exporter.url)
    for le in STOP_LATENCY_BUCKETS:
        assert m[("tailspec_session_stop_latency_seconds_bucket", (("le", str(float(le))),))] == \
            sum(1 for x in lat if x <= le), le
    assert m[("tailspec_session_stop_latency_seconds_bucket", (("le", "+Inf"),))] == len(lat)
    assert m[("tailspec_session_stop_latency_seconds_count", ())] == len(lat)
    assert math.isclose(m[("tailspec_session_stop_latency_seconds_sum", ())], sum(lat))


def test_names_follow_prometheus_conventions(redis_client, exporter):
    StateWriter(redis_client).populate()
    m = scrape(exporter.url)
    names = {name for name, _ in m}
    assert names <= exposed_names()
    # a fully populated state exposes every family METRICS declares
    families = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                for n in names}
    assert families == set(METRICS)
    for name, (kind, _) in METRICS.items():
        assert name.startswith("tailspec_")
        if kind == "counter":
            assert name + "_total" in names
        assert not name.endswith(("_milliseconds", "_percent", "_kilobytes")), name  # base units only
    for name, labels in m:
        keys = {k for k, _ in labels}
        if name.startswith("tailspec_gpu_"):
            assert {"node", "gpu", "worker"} <= keys, name
        if name in ("tailspec_gpu_utilization_ratio", "tailspec_gpu_memory_used_bytes"):
            assert "simulated" in keys
    shares = [v for (n, _), v in m.items() if n.endswith("_ratio") and n != "tailspec_rollout_speedup_ratio"]
    assert len(shares) >= 4 and all(0 <= v <= 1 for v in shares)


def test_real_telemetry_is_labelled_not_simulated(redis_client, exporter):
    StateWriter(redis_client, simulated=False).cycle(0, "generating")
    m = scrape(exporter.url)
    sims = {dict(lbl)["simulated"] for (n, lbl) in m if n == "tailspec_gpu_utilization_ratio"}
    assert sims == {"false"}


def test_bad_payloads_are_counted_not_fatal(redis_client, exporter):
    w = StateWriter(redis_client)
    w.cycle(0, "generating")
    redis_client.set(w.k("gpu_status", node="node0", gpu=0), b"\x80\x04pickle")
    m1 = scrape(exporter.url)
    m2 = scrape(exporter.url)
    assert gpu_state(m1, 0) == "unknown"
    assert m1[("tailspec_exporter_bad_payloads_total", ())] == 1.0
    assert m2[("tailspec_exporter_bad_payloads_total", ())] == 2.0  # counted on every scrape that saw it


def test_redis_down_is_reported_not_an_error(redis_url):
    from tailspec.redis_server import free_port

    srv = start_exporter(f"redis://127.0.0.1:{free_port()}/0", "t")  # nothing listens there
    try:
        m = scrape(srv.url)
        assert m == {("tailspec_redis_up", ()): 0.0}
    finally:
        srv.stop()
