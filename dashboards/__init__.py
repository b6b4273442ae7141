"""Prometheus exporter, web dashboard and Grafana JSON over the cluster-state schema."""
