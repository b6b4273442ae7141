"""The web dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright
with executable_path) opens the page while a simulated run lends GPUs, waits for the timeline to
render, checks that the GPUs and states on the page match /api/state, and saves a screenshot."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request

import pytest
from tailspec.dashboards.server import start_dashboard
from test_dashboards_writer import WriterRun

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


def test_page_matches_api_during_a_simulated_run(redis_client, redis_url, page_factory, test_output_dir):
    open_page, problems = page_factory
    srv = start_dashboard(redis_url, "t")
    try:
        with WriterRun(redis_client, n_gpus=4):
            page = open_page(srv.url + "/?refresh=250")
            page.wait_for_selector("#timeline[data-rendered='4'] g.lane", timeout=20_000)
            page.wait_for_selector("#timeline rect.seg-lent", timeout=20_000)  # a lent GPU shows as training

            # Compare the page with /api/state read before (A) and after (B) a page refresh that
            # started after A: a GPU whose (state, since) is the same in A and B did not change in
            # between, so the page must show exactly that state for it.
            checked: dict[str, int] = {}
            states_checked: set[str] = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                a = api_states(srv.url)
                t0 = page.evaluate(PAGE_VIEW)["ticks"]
                page.wait_for_function("n => Number(document.body.dataset.ticks) >= n", arg=t0 + 2,
                                       timeout=10_000)
                view = page.evaluate(PAGE_VIEW)
                b = api_states(srv.url)
                assert set(view["rows"]) == set(a) == set(b) == set(view["lanes"]) == \
                    {"node0:0", "node0:1", "node0:2", "node0:3"}
                for gid, (st, since) in a.items():
                    if b[gid] != (st, since):
                        continue
                    assert view["rows"][gid] == st, (gid, view["rows"], a)
                    assert view["lanes"][gid] == st, (gid, view["lanes"], a)
                    checked[gid] = checked.get(gid, 0) + 1
                    states_checked.add(st)
                if min(checked.get(g, 0) for g in a) >= 2 and {"generating", "lent"} <= states_checked:
                    break
            assert min(checked.values()) >= 2 and len(checked) == 4, checked
            assert {"generating", "lent"} <= states_checked, states_checked
            assert view["simulatedBadge"] and view["lentRects"] > 0
            assert page.locator("#chart-util canvas").count() >= 1  # uPlot drew the utilization chart
            assert page.locator("#session-table tbody tr[data-session-id]").count() >= 1
            # the 1-minute window shows the lending cycles of the run in the screenshot
            page.select_option("#window", "60")
            t0 = page.evaluate(PAGE_VIEW)["ticks"]
            page.wait_for_function("n => Number(document.body.dataset.ticks) >= n", arg=t0 + 2, timeout=10_000)
            page.screenshot(path=str(test_output_dir / "dashboard.png"), full_page=True)
        assert not problems, problems  # no script errors, no blocked (CSP) or failed requests
    finally:
        srv.stop()
