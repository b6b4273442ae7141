"""Telemetry, idle detection, leases, dispatch and Ray attach. Knows GPUs, leases and sessions — not models."""
