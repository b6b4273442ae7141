"""The idle-GPU scheduler: knows GPUs, leases and sessions — not models.

Modules: telemetry (NVML / simulated), monitor (per-node sampling into Redis), idle (per-GPU state
machine), leases (fenced Redis leases), lessor (a term's leases: lend, renew, revoke, reclaim),
session_process (SessionContext + the process that runs a session), dispatch (local processes / Ray actors),
service (the scheduler loop), client (the RL framework's calls), scripted_rollout (a long-tail rollout whose
lengths are drawn, not decoded), attach (Ray mode), busy_sessions (small real sessions used by tests and the
benchmark).
"""
