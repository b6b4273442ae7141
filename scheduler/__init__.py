"""The idle-GPU scheduler: knows GPUs, leases and sessions — not models.

Modules: telemetry (NVML / simulated), monitor (per-node sampling into Redis), idle (per-GPU state
machine), leases (fenced Redis leases), session (SessionContext + the session process entry), dispatch
(local processes / Ray actors), service (the scheduler loop), client (the RL framework's calls),
simulate (a simulated long-tail rollout), attach (Ray mode), top (terminal table), demo_session (a small
real session used by tests and the benchmark).
"""
