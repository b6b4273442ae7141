"""Prometheus exporter, web dashboard and Grafana JSON over the cluster-state schema.

`tailspec dashboard` serves, on 127.0.0.1 unless --allow-remote:
  :8300  the page (per-GPU timeline, utilization/memory, reclaimed share, acceptance per drafter version
         and RL step, rollout speedup, sessions), `/api/state`, `/api/timeline?window=S`, `/api/schema`
         (JSON Schema of both responses, from api.py), `/metrics`
  :9300  `/metrics` only, for Prometheus (the families are listed in exporter.METRICS)
grafana/tailspec.json is importable as is (built by grafana_json.py). Programmatic use (the demo):
`server.start_dashboard(redis_url, cluster, port=...)` returns a handle with `.url` and `.stop()`.

Modules: snapshot (reads the state through tailspec.core.state), api (response models = the documented
schema), exporter (Prometheus collector), server (stdlib HTTP, GET only), grafana_json.
"""
