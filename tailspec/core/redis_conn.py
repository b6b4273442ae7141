"""One way to open a Redis connection that rides out a Redis restart.

A Redis that is SIGKILLed and restarted (from its AOF) refuses connections for a second or two, then answers
`LOADING` while it replays the file. A long-running process (the RL loop, a rollout worker) should wait that
out, not die: every command is retried on a connection error, a timeout or `LOADING`, with exponential
back-off capped at 0.5 s, for about `outage_s` seconds in all. A command whose reply was lost with the
connection is sent again, so a write may apply twice in that one case (at-least-once); the cluster state's
writers tolerate that (keys are overwritten, streams are read by content)."""

from __future__ import annotations

from typing import Any


def connect(url: str, *, timeout_s: float | None = None, outage_s: float = 15.0) -> Any:
    """A redis.Redis for `url` whose commands are retried through an outage of up to ~`outage_s` seconds.
    `timeout_s` bounds each socket operation (None: blocking commands may wait as long as they ask)."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
    from redis.retry import Retry

    if outage_s < 0:
        raise ValueError(f"outage_s must be >= 0, got {outage_s}")
    retries = int(outage_s / 0.5) + 4  # 0.05, 0.1, 0.2, 0.4, then 0.5 s each
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s or 2.0,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError])
