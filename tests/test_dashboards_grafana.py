"""The Grafana dashboard JSON parses, is importable as is, and queries only metrics /metrics exposes."""

from __future__ import annotations

import json
import re
import urllib.request
from importlib import resources

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tailspec.dashboards.exporter import METRICS
from tailspec.dashboards.server import start_exporter
from test_dashboards_writer import StateWriter

METRIC_RE = re.compile(r"\b(tailspec_[a-z0-9_]+)\b")
SELECTOR_RE = re.compile(r"\b(tailspec_[a-z0-9_]+)\{([^}]*)\}")
PROMQL_WORDS = {"label_values", "sum", "avg", "max", "min", "count", "by", "rate", "increase", "histogram_quantile", "or",
                "vector", "le", "node", "gpu", "phase", "promoted", "state", "simulated"}


def dashboard() -> dict:
    raw = (resources.files("tailspec.dashboards") / "grafana" / "tailspec.json").read_text()
    return json.loads(raw)


def all_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows nest their panels
    return out


@pytest.fixture
def scraped(redis_client, redis_url) -> dict[str, set[str]]:
    """{sample name: label names} of /metrics over a fully populated cluster state."""
    StateWriter(redis_client).populate()
    srv = start_exporter(redis_url, "t")
    try:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_grafana_json_is_an_importable_dashboard():
    d = dashboard()
    assert d["uid"] == "tailspec-overview" and d["title"] and isinstance(d["schemaVersion"], int)
    assert "id" not in d or d["id"] is None  # an id would clash on import into another Grafana
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_every_queried_metric_exists_in_metrics(scraped):
    panels = [p for p in all_panels(dashboard()) if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    used = set()
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        names = METRIC_RE.findall(e)
        assert names, f"query uses no tailspec metric: {e}"
        for n in names:
            assert n in scraped, f"{n} (in {e!r}) is not in /metrics"
            used.add(n)
        for n, matchers in SELECTOR_RE.findall(e):
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in scraped[n], f"{n} has no label {label!r} (in {e!r})"
        # no other metric names sneak in (e.g. DCGM's or a typo without the prefix)
        words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*[{(\[]", e)) - PROMQL_WORDS
        assert all(w.startswith("tailspec_") for w in words), (words, e)
    # one panel or more for every metric family the exporter declares
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert set(METRICS) <= families, set(METRICS) - families


def test_shipped_json_is_the_generated_one():
    from tailspec.dashboards.grafana_json import render

    shipped = (resources.files("tailspec.dashboards") / "grafana" / "tailspec.json").read_text()
    assert shipped == render(), "regenerate: python -m tailspec.dashboards.grafana_json > dashboards/grafana/tailspec.json"


def test_panels_do_not_overlap():
    cells = set()
    for p in all_panels(dashboard()):
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (cells & mine), p["title"]
        cells |= mine


def test_the_check_catches_a_missing_metric(scraped):
    assert "tailspec_gpu_utilization_percent" not in scraped  # a wrong name would fail the test above
