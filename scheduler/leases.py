"""Fenced GPU leases on Redis.

A lease is `SET lease:{node}:{gpu} <Lease JSON> NX PX ttl`. Its fencing token comes from `INCR fence`
before the SET, so tokens are strictly increasing per cluster (a failed SET only leaves a gap).
Renewal, revocation and fenced writes are Lua scripts: the token check and the action happen
atomically in Redis, so a holder that paused past its expiry cannot renew, nor write, after another
holder got the GPU.

Renewal also requires the scheduler's heartbeat key to exist: if the scheduler dies, its heartbeat
expires and every session's next renewal fails — sessions stop on their own within one TTL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tailspec.core import state
from tailspec.core.state import Lease

# Renewal outcomes (Lua return codes).
RENEWED = 1
EXPIRED = -1  # no lease any more (expired or revoked and deleted)
STALE = -2  # another holder's token is on the GPU now
REVOKED = -3  # the scheduler flagged this token for revocation
NO_SCHEDULER = -4  # scheduler heartbeat gone

REASONS = {
    RENEWED: "renewed",
    EXPIRED: "lease expired",
    STALE: "stale fencing token",
    REVOKED: "revoked",
    NO_SCHEDULER: "scheduler heartbeat lost",
}

# KEYS: lease, revoke flag, heartbeat. ARGV: token, ttl_ms, require_heartbeat (1/0).
_RENEW = """
if redis.call('GET', KEYS[2]) == ARGV[1] then return -3 end
local v = redis.call('GET', KEYS[1])
if not v then return -1 end
local ok, lease = pcall(cjson.decode, v)
if not ok or tonumber(lease['token']) ~= tonumber(ARGV[1]) then return -2 end
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then return -4 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lease. ARGV: token. Deletes the lease only if it carries this token.
_RELEASE = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local ok, lease = pcall(cjson.decode, v)
if ok and tonumber(lease['token']) == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS: lease, revoke flag. ARGV: token, flag ttl_ms. Flags the token, then releases (deletes the lease if it
# is still that token's). Returns 1 if a lease was deleted.
_REVOKE = "redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])\n" + _RELEASE

# KEYS: lease, target. ARGV: token, value, px_ms (0 = no expiry). Writes only while the token holds the lease.
_FENCED_SET = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local ok, lease = pcall(cjson.decode, v)
if not ok or tonumber(lease['token']) ~= tonumber(ARGV[1]) then return 0 end
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
"""


@dataclass
class Leases:
    """Lease operations for one cluster namespace on one Redis connection."""

    r: Any
    cluster: str

    def __post_init__(self) -> None:
        self._renew = self.r.register_script(_RENEW)
        self._revoke = self.r.register_script(_REVOKE)
        self._release = self.r.register_script(_RELEASE)
        self._fenced_set = self.r.register_script(_FENCED_SET)

    def _keys(self, node: str, gpu: int) -> tuple[str, str]:
        return (
            state.key(self.cluster, "lease", node=node, gpu=gpu),
            state.key(self.cluster, "revoke", node=node, gpu=gpu),
        )

    def acquire(self, node: str, gpu: int, holder: str, ttl_s: float) -> Lease | None:
        """Grant a new lease with a fresh fencing token, or None if the GPU is already leased."""
        lease_key, _ = self._keys(node, gpu)
        if self.r.exists(lease_key):  # saves a token when the answer is obviously no
            return None
        token = int(self.r.incr(state.key(self.cluster, "fence")))
        lease = Lease(node=node, gpu=gpu, token=token, holder=holder, granted_at=time.time(), ttl_s=ttl_s)
        if self.r.set(lease_key, state.encode(lease), nx=True, px=_ms(ttl_s)):
            return lease
        return None

    def renew(self, node: str, gpu: int, token: int, ttl_s: float, require_heartbeat: bool = True) -> int:
        """Extend the lease by ttl_s if `token` still holds it; returns RENEWED or a negative reason code."""
        lease_key, revoke_key = self._keys(node, gpu)
        hb = state.key(self.cluster, "scheduler_heartbeat")
        return int(
            self._renew(
                keys=[lease_key, revoke_key, hb], args=[token, _ms(ttl_s), "1" if require_heartbeat else "0"]
            )
        )

    def revoke(self, node: str, gpu: int, token: int, flag_ttl_s: float = 60.0) -> bool:
        """Flag `token` as revoked and delete its lease; True if the lease was still there."""
        lease_key, revoke_key = self._keys(node, gpu)
        return bool(self._revoke(keys=[lease_key, revoke_key], args=[token, _ms(flag_ttl_s)]))

    def release(self, node: str, gpu: int, token: int) -> bool:
        """Delete the lease if `token` holds it (a holder giving the GPU back)."""
        lease_key, _ = self._keys(node, gpu)
        return bool(self._release(keys=[lease_key], args=[token]))

    def current(self, node: str, gpu: int) -> Lease | None:
        lease_key, _ = self._keys(node, gpu)
        return state.get(self.r, lease_key, Lease)

    def fenced_set(
        self, node: str, gpu: int, token: int, target_key: str, value: bytes | str, px_ms: int = 0
    ) -> bool:
        """SET target_key only while `token` holds the GPU's lease (a stale holder's write is refused)."""
        lease_key, _ = self._keys(node, gpu)
        return bool(self._fenced_set(keys=[lease_key, target_key], args=[token, value, px_ms]))


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))
