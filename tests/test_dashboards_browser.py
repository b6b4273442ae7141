"""The web dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright
with executable_path) opens the page while a simulated run lends GPUs, waits for the timeline to
render, checks that the GPUs and states on the page match /api/state, and saves a screenshot.
The run is the scheduler's scripted long-tail rollout: real scheduler, client, sessions and Redis."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import urllib.request

import pytest
from tailspec.dashboards.server import start_dashboard
from test_dashboards_simulated import CLUSTER, SchedulerRun
from test_dashboards_writer import StateWriter

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium installed (Debian: apt-get install chromium; `make test` installs it)")


@pytest.fixture
def page_factory():
    exe = _browser()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[dev]')")
    profile = tempfile.mkdtemp(prefix="tailspec-chromium-")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=FLAGS, viewport={"width": 1400, "height": 1800})
        problems: list[str] = []

        def open_page(url: str):
            page = ctx.new_page()
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(url)
            return page

        try:
            yield open_page, problems
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


def api_states(url: str) -> dict[str, tuple[str, float | None]]:
    with urllib.request.urlopen(url + "/api/state", timeout=10) as r:
        st = json.loads(r.read())
    return {g["id"]: (g["state"], g["state_since"]) for g in st["gpus"]}


PAGE_VIEW = """() => ({
  ticks: Number(document.body.dataset.ticks || 0),
  rows: Object.fromEntries([...document.querySelectorAll('#gpu-table tbody tr[data-gpu-id]')]
                           .map(r => [r.dataset.gpuId, r.dataset.state])),
  lanes: Object.fromEntries([...document.querySelectorAll('#timeline g.lane')]
                            .map(g => [g.dataset.gpuId, g.dataset.state])),
  simulatedBadge: !document.getElementById('simulated-badge').hidden,
  lentRects: document.querySelectorAll('#timeline rect.seg-lent').length,
})"""


# Worker 0's tail is 2.5 s; the others generate for 0.8 s, then drain and are lent. The RL "train" phase
# lasts 1 s. Every state lasts long enough to be seen stable between two reads of /api/state.
LENGTHS = [250, 80] + [80, 80] * 3


def _figures_of_other_components(r) -> None:
    """Drafter versions and rollout figures come from the trainer and the rollout workers, which the
    scheduler's simulation does not run: the state writer fills them so every chart has data."""
    w = StateWriter(r, cluster=CLUSTER)
    for v, (acc, promoted) in enumerate([(1.6, True), (2.1, True), (2.0, False), (2.6, True)]):
        w.version(v, acc, None if v == 0 else 1.6, promoted)
    for step in range(1, 6):
        w.rollout("sim-worker0", step, tokens=9_000, seconds=6.0 - 0.4 * step, forwards=4_000 - 250 * step,
                  mix={"0": 10, "2": 20 + 5 * step, "4": 40}, baseline_tps=1_100.0, drafter_version=step // 2)


@pytest.mark.slow
def test_page_matches_api_during_a_simulated_run(redis_client, redis_url, page_factory, test_output_dir):
    from tailspec.scheduler.scripted_rollout import run_scripted_rollout

    open_page, problems = page_factory
    _figures_of_other_components(redis_client)
    srv = start_dashboard(redis_url, CLUSTER)
    stop_sim = threading.Event()
    sim = threading.Thread(target=lambda: run_scripted_rollout(
        redis_url, workers=4, steps=100, requests_per_worker=2, lengths=LENGTHS, token_time_s=0.01,
        train_s=1.0, cluster=CLUSTER, stop=stop_sim), daemon=True)
    try:
        with SchedulerRun(redis_url):
            sim.start()
            page = open_page(srv.url + "/?refresh=250")
            page.wait_for_selector("#timeline[data-rendered='4'] g.lane", timeout=20_000)
            page.wait_for_selector("#timeline rect.seg-lent", timeout=20_000)  # a lent GPU shows as training

            # Compare the page with /api/state read before (A) and after (B) a page refresh that
            # started after A: a GPU whose (state, since) is the same in A and B did not change in
            # between, so the page must show exactly that state for it.
            checked: dict[str, int] = {}
            seen: dict[str, list[str]] = {}  # per GPU, the states the page showed (when checked)

            def came_back() -> bool:  # some GPU shown lent, then generating again (reclaimed)
                return any("generating" in s[s.index("lent"):] for s in seen.values() if "lent" in s)

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                a = api_states(srv.url)
                t0 = page.evaluate(PAGE_VIEW)["ticks"]
                page.wait_for_function("n => Number(document.body.dataset.ticks) >= n", arg=t0 + 2,
                                       timeout=10_000)
                view = page.evaluate(PAGE_VIEW)
                b = api_states(srv.url)
                assert set(view["rows"]) == set(a) == set(b) == set(view["lanes"]) == \
                    {"node0:0", "node0:1", "node0:2", "node0:3"}, (view, a)
                for gid, (st, since) in a.items():
                    if b[gid] != (st, since):
                        continue
                    assert view["rows"][gid] == st, (gid, view["rows"], a)
                    assert view["lanes"][gid] == st, (gid, view["lanes"], a)
                    checked[gid] = checked.get(gid, 0) + 1
                    seen.setdefault(gid, []).append(st)
                if min(checked.get(g, 0) for g in a) >= 2 and came_back():
                    break
            assert min(checked.values()) >= 2 and len(checked) == 4, checked
            assert came_back(), seen
            assert view["simulatedBadge"] and view["lentRects"] > 0
            assert page.locator("#chart-util canvas").count() >= 1  # uPlot drew the utilization chart
            assert page.locator("#session-table tbody tr[data-session-id]").count() >= 1
            # the 1-minute window shows the lending cycles of the run in the screenshot
            page.select_option("#window", "60")
            t0 = page.evaluate(PAGE_VIEW)["ticks"]
            page.wait_for_function("n => Number(document.body.dataset.ticks) >= n", arg=t0 + 2, timeout=10_000)
            page.screenshot(path=str(test_output_dir / "dashboard.png"), full_page=True)
            stop_sim.set()
            sim.join(timeout=15)
        assert not problems, problems  # no script errors, no blocked (CSP) or failed requests
    finally:
        stop_sim.set()
        srv.stop()


@pytest.mark.slow
def test_guard_banner_names_the_workers_with_speculation_off(redis_client, redis_url, page_factory):
    """Two workers' guards trip (what rollout/health_guard.record_verdict publishes): the banner names both and
    the version; a healthy verdict on another version for one of them takes it off the banner; none left, gone."""
    from tailspec.rollout.health_guard import Verdict, record_verdict

    open_page, problems = page_factory
    w = StateWriter(redis_client, cluster=CLUSTER)
    w.populate()

    def verdict(tripped: bool, version: int) -> Verdict:
        return Verdict(tripped=tripped, version=version, event="policy_sync", live=1.01 if tripped else 2.4,
                       validated=2.6, steps=16, reason="live 1.01 <= floor 1.05" if tripped else "")

    srv = start_dashboard(redis_url, CLUSTER)
    try:
        page = open_page(srv.url + "/?refresh=250")
        page.wait_for_function("() => Number(document.body.dataset.ticks) >= 1", timeout=20_000)
        assert page.locator("#guard-banner").is_hidden()  # nothing tripped yet
        record_verdict(redis_client, CLUSTER, "rollout-1", verdict(True, 7))
        record_verdict(redis_client, CLUSTER, "rollout-0", verdict(True, 7))
        record_verdict(redis_client, CLUSTER, "rollout-2", verdict(False, 7))
        page.wait_for_function("() => document.getElementById('guard-banner').dataset.workers === "
                               "'rollout-0,rollout-1'", timeout=10_000)
        text = page.locator("#guard-banner").inner_text()
        assert page.locator("#guard-banner").is_visible()
        assert "speculation off on 2 rollout workers" in text and "v7 after policy_sync" in text, text
        assert "rollout-2" not in text
        record_verdict(redis_client, CLUSTER, "rollout-0", verdict(False, 8))  # a healthy version loaded there
        page.wait_for_function("() => document.getElementById('guard-banner').dataset.workers === 'rollout-1'",
                               timeout=10_000)
        record_verdict(redis_client, CLUSTER, "rollout-1", verdict(False, 8))
        page.wait_for_function("() => document.getElementById('guard-banner').hidden", timeout=10_000)
        assert not problems, problems
    finally:
        srv.stop()
