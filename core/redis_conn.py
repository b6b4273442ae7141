"""One way to open a Redis connection that rides out a Redis restart.

A Redis that is SIGKILLed and restarted (from its AOF) refuses connections for a second or two, then answers
`LOADING` while it replays the file. A long-running process (the RL loop, a rollout worker) should wait that
out, not die: every command is retried on a connection error, a timeout or `LOADING`, with exponential
back-off capped at 0.5 s, for about `outage_s` seconds in all. A command whose reply was lost with the
connection is sent again, so a write may apply twice in that one case (at-least-once); the cluster state's
writers tolerate that (keys are overwritten, streams are read by content).

A wrong password, a missing permission or a failed TLS handshake is not an outage: `check` raises
RedisSetupError for those at once, with a sentence naming the URL (password redacted) and the fix."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tailspec.core.config import ConfigError


def connect(url: str, *, timeout_s: float | None = None, outage_s: float = 15.0) -> Any:
    """A redis.Redis for `url` whose commands are retried through an outage of up to ~`outage_s` seconds.
    `timeout_s` bounds each socket operation (None: blocking commands may wait as long as they ask)."""
    # deferred: redis (0.2 s to import); the CLI imports this module to build its parser (the scheduler
    # command's Redis checks), and only connecting needs it
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


class RedisSetupError(ConfigError):
    """Redis refused this process's credentials or TLS settings: no retry can help, so it is reported at once."""


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def explain(e: BaseException, url: str) -> str | None:
    """A plain sentence for a Redis error that retrying cannot fix (a password, a permission, TLS), naming
    the URL (password redacted) and what to change; None for anything else (an outage, a timeout)."""
    # deferred: redis (0.2 s to import); the CLI imports this module to build its parser
    from redis.exceptions import AuthenticationError, AuthorizationError

    msg = str(e)
    where = f"Redis at {redact(url)}"
    if isinstance(e, AuthenticationError) or "NOAUTH" in msg or "WRONGPASS" in msg:
        if urlsplit(url).password is None:
            return (f"{where} requires a password and the URL has none: give it as "
                    f"redis://:PASSWORD@host:port/0 (rediss:// for TLS; URL-encode @ : / in the password)")
        return f"{where} refused the password in the URL (wrong password, or wrong user name): {msg}"
    if isinstance(e, AuthorizationError) or "NOPERM" in msg:
        return f"{where}: the URL's Redis user lacks a permission tailspec needs: {msg}"
    if isinstance(e.__cause__ or e.__context__, ssl.SSLError) or "[SSL" in msg:
        hint = ("; for a server certificate signed by your own CA add ?ssl_ca_certs=/path/to/ca.crt to the "
                "rediss:// URL" if "CERTIFICATE_VERIFY_FAILED" in msg else
                "; is the server's port TLS (rediss://) or plain (redis://)?")
        return f"TLS connection to {where} failed: {msg}{hint}"
    return None


def check(r: Any, url: str) -> None:
    """PING once through `r`: raise RedisSetupError when Redis refuses the URL's credentials or TLS (see
    `explain`); any other failure (Redis down or slow) is left to the caller's retries and is not raised."""
    try:
        r.ping()
    except Exception as e:  # noqa: BLE001 — only the unfixable ones are raised
        why = explain(e, url)
        if why is not None:
            raise RedisSetupError(why) from None
