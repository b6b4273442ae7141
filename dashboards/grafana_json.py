"""Builds grafana/tailspec.json, the Grafana dashboard over the exporter's metrics.

The JSON file is what users import; this module is where it is edited. After a change:
    python -m tailspec.dashboards.grafana_json > dashboards/grafana/tailspec.json
(tests/test_dashboards_grafana.py checks the shipped file equals build() and that every metric a
panel queries exists in /metrics.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
NODE = 'node=~"$node"'
# scheduler state → (value on the state timeline, label, colour as on the web dashboard)
STATES = {"unknown": (0, "unknown", "#bab0ac"), "generating": (1, "generating", "#4e79a7"),
          "drained": (2, "idle (drained)", "#f28e2b"), "lent": (3, "training (lent)", "#59a14f"),
          "reclaiming": (4, "reclaiming", "#b07aa1")}


@dataclass
class Layout:
    """Places panels left to right on a 24-column grid, wrapping to a new line as needed."""

    panels: list[dict] = field(default_factory=list)
    x: int = 0
    y: int = 0
    line_h: int = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "id": self._next_id(), "collapsed": False,
                            "panels": [], "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.x, self.y, self.line_h = 0, self.y + self.line_h, 0

    def panel(self, kind: str, title: str, targets: list[tuple[str, str]], *, w: int = 8, h: int = 8,
              unit: str | None = None, desc: str | None = None, options: dict | None = None,
              mappings: list | None = None, custom: dict | None = None, overrides: list | None = None) -> None:
        if self.x + w > 24:
            self._newline()
        instant = kind in ("stat", "bargauge")
        defaults: dict[str, Any] = {}
        if unit:
            defaults["unit"] = unit
        if mappings:
            defaults["mappings"] = mappings
        if custom:
            defaults["custom"] = custom
        p = {
            "type": kind, "title": title, "id": self._next_id(), "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                         **({"instant": True} if instant else {})} for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": options or {},
        }
        if desc:
            p["description"] = desc
        self.panels.append(p)
        self.x += w
        self.line_h = max(self.line_h, h)


def _stat_mapping(values: dict[str, tuple[str, str]]) -> list:
    return [{"type": "value", "options": {k: {"text": t, "color": c} for k, (t, c) in values.items()}}]


def _gpu_panels(L: Layout) -> None:
    state_expr = " + ".join(f'{v} * sum by (node, gpu) (tailspec_gpu_state{{{NODE}, state="{s}"}})'
                            for s, (v, _, _) in STATES.items() if v)

    L.row("GPUs: where the time goes")
    L.panel("state-timeline", "GPU state (generating / idle / training)", [(state_expr, "{{node}}:{{gpu}}")],
            w=24, desc="Scheduler state of every GPU: generating (rollout), idle (drained by the long tail), "
                       "training (lent to the drafter), reclaiming (being given back).",
            mappings=[{"type": "value", "options": {str(v): {"text": t, "color": c, "index": v}
                                                    for v, t, c in STATES.values()}}],
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                     "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"}},
            custom={"fillOpacity": 90, "lineWidth": 0})
    L.panel("timeseries", "GPU utilization",
            [(f"tailspec_gpu_utilization_ratio{{{NODE}}}", "{{node}}:{{gpu}} (simulated={{simulated}})")],
            unit="percentunit", desc='From NVML, or simulated where simulated="true" (no GPU behind the numbers).')
    L.panel("timeseries", "GPU memory used", [(f"tailspec_gpu_memory_used_bytes{{{NODE}}}", "{{node}}:{{gpu}}"),
                                              (f"max(tailspec_gpu_memory_total_bytes{{{NODE}}})", "capacity")],
            unit="bytes")
    L.panel("timeseries", "GPUs per state", [("tailspec_gpus", "{{state}}")],
            custom={"stacking": {"mode": "normal"}, "fillOpacity": 60},
            overrides=[{"matcher": {"id": "byName", "options": s},
                        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": c}}]}
                       for s, (_, _, c) in STATES.items()])
    L.panel("stat", "GPUs with simulated telemetry",
            [('count(tailspec_gpu_utilization_ratio{simulated="true"}) or vector(0)', "simulated")], w=6, h=4,
            desc="Non-zero means no NVML: those GPUs' utilization and memory figures are simulated.")
    L.panel("stat", "GPU telemetry errors", [(f"sum(tailspec_gpu_telemetry_error{{{NODE}}}) or vector(0)", "errors")],
            w=6, h=4)
    L.panel("timeseries", "GPU power", [(f"tailspec_gpu_power_watts{{{NODE}}}", "{{node}}:{{gpu}}")], unit="watt",
            w=12, h=4)


def _reclaim_panels(L: Layout) -> None:
    L.row("Reclaimed time")
    L.panel("stat", "Reclaimed share", [("tailspec_reclaimed_share_ratio", "lent / idle")], unit="percentunit", w=6,
            desc="Share of the GPU time the long tail left idle that went to drafter training.")
    L.panel("stat", "GPU time idle and lent", [("tailspec_idle_gpu_seconds_total", "idle"),
                                               ("tailspec_lent_gpu_seconds_total", "lent")], unit="s", w=6)
    L.panel("timeseries", "Idle and lent GPUs (average over 1 min)",
            [("rate(tailspec_idle_gpu_seconds_total[1m])", "idle GPUs"),
             ("rate(tailspec_lent_gpu_seconds_total[1m])", "lent GPUs")], w=12,
            desc="GPU-seconds per second = the average number of GPUs idle (drained or lent) and lent.")


def _session_panels(L: Layout) -> None:
    L.row("Training sessions")
    L.panel("timeseries", "Sessions started / stopped / preempted / declined (per 5 min)",
            [("increase(tailspec_sessions_started_total[5m])", "started"),
             ("increase(tailspec_sessions_stopped_total[5m])", "stopped"),
             ("increase(tailspec_sessions_preempted_total[5m])", "preempted"),
             ("increase(tailspec_sessions_declined_total[5m])", "declined (did not fit the GPU's free memory)")])
    bucket = "sum by (le) (rate(tailspec_session_stop_latency_seconds_bucket[5m]))"
    L.panel("timeseries", "Session stop latency",
            [(f"histogram_quantile(0.5, {bucket})", "p50"), (f"histogram_quantile(0.99, {bucket})", "p99"),
             (("rate(tailspec_session_stop_latency_seconds_sum[5m]) / "
               "rate(tailspec_session_stop_latency_seconds_count[5m])"), "mean")],
            unit="s", desc="From revocation to the session stopped and its GPU memory freed.")
    L.panel("timeseries", "Sessions by status", [("tailspec_sessions", "{{status}}")])
    L.panel("timeseries", "Drafter training loss (latest session per GPU)",
            [(f"tailspec_drafter_training_loss{{{NODE}}}", "{{node}}:{{gpu}}")], w=12)
    L.panel("timeseries", "Drafter training steps (latest session per GPU)",
            [(f"tailspec_drafter_training_steps{{{NODE}}}", "{{node}}:{{gpu}}")], w=12)


def _version_panels(L: Layout) -> None:
    L.row("Drafter versions")
    L.panel("stat", "Promoted drafter version", [("tailspec_drafter_version", "version")], w=6)
    L.panel("timeseries", "Validation acceptance length",
            [("tailspec_drafter_acceptance_length", "promoted version"),
             ("tailspec_drafter_baseline_acceptance_length", "version it replaced")], w=12,
            desc="Expected acceptance length on held-out recent samples.")
    L.panel("stat", "Candidates", [('tailspec_drafter_candidates{promoted="true"}', "promoted"),
                                   ('tailspec_drafter_candidates{promoted="false"}', "rejected")], w=6)
    L.panel("timeseries", "Drafter staleness",
            [("tailspec_drafter_live_acceptance_length", "now (newest samples, current policy)"),
             ("tailspec_drafter_promoted_acceptance_length", "at promotion")], w=12,
            desc="The current drafter's acceptance length on the newest samples beside its validated value when "
                 "promoted: the gap is how far the policy has moved away from it.")
    L.panel("timeseries", "Latest candidate: paired gain lower bound", [("tailspec_drafter_promotion_gain_lcb", "bound")],
            w=12, desc="Promoted only when above 0 (one-sided paired t test).")
    L.panel("stat", "Drafter lineage", [("tailspec_lineage_steps", "steps"), ("tailspec_lineage_merges", "merges")], w=6)
    L.panel("stat", "Drafter health guard", [("tailspec_drafter_guard_trips_total", "trips"),
                                              ("tailspec_drafter_guard_speculation_off", "workers off now")], w=6,
            desc="A rollout worker's live acceptance fell below the floor after a drafter load or a policy-weight "
                 "sync: speculation is off there until a good version loads (event log: drafter_guard).")
    L.panel("stat", "Sample stream", [("tailspec_samples_stream_length", "entries"),
                                      ("tailspec_samples_policy_version", "v {{end}}")], w=6)


def _rollout_panels(L: Layout) -> None:
    L.row("Rollout: speculative decoding")
    L.panel("timeseries", "Acceptance length (latest phase)",
            [("tailspec_rollout_acceptance_length", "{{worker}}"),
             ("avg(tailspec_rollout_acceptance_length)", "mean")], desc="Tokens emitted per target forward.")
    L.panel("timeseries", "Rollout speedup over plain decoding", [("tailspec_rollout_speedup_ratio", "{{worker}}")],
            unit="x")
    L.panel("timeseries", "Rollout tokens/s", [("tailspec_rollout_tokens_per_second", "{{worker}}")], unit="short")
    L.panel("bargauge", "Strategy mix (share of decode steps per draft length k)",
            [("tailspec_rollout_strategy_share_ratio", "{{worker}} k={{k}}")], unit="percentunit", w=12,
            options={"orientation": "horizontal", "displayMode": "basic"})
    L.panel("timeseries", "Dropped samples by reason (per 5 min)",
            [("increase(tailspec_dropped_samples_total[5m])", "{{reason}}")], w=12)


def _health_panels(L: Layout) -> None:
    L.row("Health")
    L.panel("stat", "Cluster state readable", [("min(tailspec_redis_up)", "redis")], w=4, h=4,
            mappings=_stat_mapping({"0": ("DOWN", "red"), "1": ("up", "green")}))
    L.panel("stat", "Scheduler heartbeat age", [("max(tailspec_scheduler_heartbeat_age_seconds)", "age")], unit="s",
            w=4, h=4)
    L.panel("stat", "RL phase", [("max by (phase) (tailspec_phase) == 1", "{{phase}}")], w=4, h=4,
            options={"textMode": "name"})
    L.panel("stat", "RL step", [("max(tailspec_rl_step)", "step")], w=4, h=4)
    L.panel("stat", "Policy version", [("max(tailspec_policy_version)", "policy")], w=4, h=4)
    L.panel("stat", "Rollout figures: latest RL step per worker", [("tailspec_rollout_step", "{{worker}}")], w=4, h=4,
            desc="Lagging behind the RL step means a worker stopped publishing rollout figures.")
    L.panel("stat", "Malformed state entries skipped (1 h)",
            [("sum(increase(tailspec_exporter_bad_payloads_total[1h]))", "last hour")], w=4, h=4)


def build() -> dict:
    """The overview dashboard: one row of panels per question a user asks (where the GPU time goes, how
    much was reclaimed, what the sessions and drafter versions did, what speculation bought, health)."""
    L = Layout()
    _gpu_panels(L)
    _reclaim_panels(L)
    _session_panels(L)
    _version_panels(L)
    _rollout_panels(L)
    _health_panels(L)
    return _dashboard(L.panels)


def _dashboard(panels: list) -> dict:
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": k, "name": n, "version": ""} for k, n in [
                ("timeseries", "Time series"), ("state-timeline", "State timeline"), ("stat", "Stat"),
                ("bargauge", "Bar gauge")]),
        ],
        "title": "tailspec: idle GPUs, drafter training, speculative rollouts",
        "uid": "tailspec-overview",
        "description": "Where the long tail's GPU time goes, how much became drafter training, and what it "
                       "bought in acceptance and speed. Metrics from `tailspec dashboard` (/metrics).",
        "tags": ["tailspec", "rl", "speculative-decoding", "gpu"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "", "links": [],
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": [], "regex": ""},
            {"name": "node", "label": "node", "type": "query", "datasource": DS,
             "query": {"query": "label_values(tailspec_gpu_state, node)", "refId": "node"},
             "definition": "label_values(tailspec_gpu_state, node)", "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "sort": 1,
             "hide": 0, "options": [], "regex": ""},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
