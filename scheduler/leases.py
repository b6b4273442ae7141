"""Fenced GPU leases on Redis.

A lease is `SET lease:{node}:{gpu} <Lease JSON> NX PX ttl`. Its fencing token comes from `INCR fence`
before the SET, so tokens are strictly increasing per cluster (a failed SET only leaves a gap).
Renewal, revocation and fenced writes are Lua scripts: the token check and the action happen
atomically in Redis, so a holder that paused past its expiry cannot renew, nor write, after another
holder got the GPU.

Renewal also requires the scheduler's heartbeat key to exist: if the scheduler dies, its heartbeat
expires and every session's next renewal fails — sessions stop on their own within one TTL.

Leader fencing (scheduler/leader.py): the scheduler lends and revokes with its leader epoch, and the
scripts refuse (LeaderLost) unless the leader key carries that epoch, so a deposed leader that wakes up
cannot lend a GPU. A lease records the epoch that granted it and is renewable — by its session or by the
scheduler — only while that epoch leads: a new leader's take-over ends every earlier leader's leases
within one lease TTL, whoever still tries to renew them. Releasing one's own lease is not fenced: it
only gives a GPU back early.

A revocation is also pushed: the revoke scripts PUBLISH the revoked token on a channel named as the GPU's revoke
flag key (`Leases.revoke_channel`), where the session's renewal thread listens (scheduler/lease_keeper.py), so a
session learns of it without polling. The flag stays the authority: a session that missed the push meets it at
its next renewal.
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
DEPOSED = -5  # the leader epoch that granted the lease no longer leads

REASONS = {
    RENEWED: "renewed",
    EXPIRED: "lease expired",
    STALE: "stale fencing token",
    REVOKED: "revoked",
    NO_SCHEDULER: "scheduler heartbeat lost",
    DEPOSED: "leader changed",
}


class LeaderLost(RuntimeError):
    """A fenced scheduler write was refused: the leader key no longer carries the writer's epoch."""


# Lua: true when the leader key (KEYS[n]) carries epoch `e`. A missing or malformed leader key is no match.
_LEADS = """
local function leads(leader_key, e)
  local l = redis.call('GET', leader_key)
  if not l then return false end
  local ok, rec = pcall(cjson.decode, l)
  return ok and type(rec) == 'table' and tonumber(rec['epoch']) == tonumber(e)
end
"""

# KEYS: lease, revoke flag, heartbeat, leader. ARGV: token, ttl_ms, require_heartbeat (1/0).
# A lease granted under a leader epoch renews only while that epoch leads.
_RENEW = _LEADS + """
if redis.call('GET', KEYS[2]) == ARGV[1] then return -3 end
local v = redis.call('GET', KEYS[1])
if not v then return -1 end
local ok, lease = pcall(cjson.decode, v)
if not ok or tonumber(lease['token']) ~= tonumber(ARGV[1]) then return -2 end
if type(lease['epoch']) == 'number' and not leads(KEYS[4], lease['epoch']) then return -5 end
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then return -4 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# Many renewals in one call (the scheduler renews every lease it granted). KEYS: heartbeat, leader, then each
# lease's key and revoke flag. ARGV: ttl_ms, require_heartbeat (1/0), then each lease's token. Returns one
# _RENEW code per lease, in order.
_RENEW_MANY = """
local l = redis.call('GET', KEYS[2])
local leader = nil
if l then
  local ok, rec = pcall(cjson.decode, l)
  if ok and type(rec) == 'table' then leader = tonumber(rec['epoch']) end
end
local hb = ARGV[2] ~= '1' or redis.call('EXISTS', KEYS[1]) == 1
local out = {}
for j = 1, #ARGV - 2 do
  local lk, rk, token = KEYS[1 + 2 * j], KEYS[2 + 2 * j], ARGV[2 + j]
  local code = 1
  if redis.call('GET', rk) == token then
    code = -3
  else
    local v = redis.call('GET', lk)
    if not v then
      code = -1
    else
      local ok, lease = pcall(cjson.decode, v)
      if not ok or tonumber(lease['token']) ~= tonumber(token) then
        code = -2
      elseif type(lease['epoch']) == 'number' and leader ~= lease['epoch'] then
        code = -5
      elseif not hb then
        code = -4
      else
        redis.call('PEXPIRE', lk, ARGV[1])
      end
    end
  end
  out[j] = code
end
return out
"""

# KEYS: lease, fence counter, leader. ARGV: lease JSON without token, px_ms, epoch ('' = unfenced).
# Returns the granted lease's JSON, 0 when the GPU is leased, -1 when `epoch` does not lead.
_ACQUIRE = _LEADS + """
if ARGV[3] ~= '' and not leads(KEYS[3], ARGV[3]) then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local lease = cjson.decode(ARGV[1])
lease['token'] = redis.call('INCR', KEYS[2])
if ARGV[3] ~= '' then lease['epoch'] = tonumber(ARGV[3]) end
local s = cjson.encode(lease)
redis.call('SET', KEYS[1], s, 'PX', ARGV[2])
return s
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

# KEYS: lease, revoke flag, leader. ARGV: token, flag ttl_ms, epoch ('' = unfenced). Flags the token, publishes
# it on the channel named as the flag (the session's LeaseKeeper listens there), then releases (deletes the lease
# if it is still that token's). Returns 1 if a lease was deleted, -1 (and writes
# nothing) when `epoch` does not lead.
_REVOKE = (
    _LEADS
    + "if ARGV[3] ~= '' and not leads(KEYS[3], ARGV[3]) then return -1 end\n"
    + "redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])\n"
    + "redis.call('PUBLISH', KEYS[2], ARGV[1])\n"
    + _RELEASE
)

# The scheduler's bulk forms of acquire, revoke and release: at a phase end it revokes every GPU it lent in one
# tick, then releases them; one call each instead of one per GPU (the client's per-command cost is most of such
# a tick). Each is its single form run per lease, the leader checked once: a script runs atomically, so the
# leader key cannot change between two of its leases.

# KEYS: fence counter, leader, then each lease key. ARGV: px_ms, epoch ('' = unfenced), then each lease's JSON
# without token. Returns -1 when `epoch` does not lead (nothing written), else one _ACQUIRE answer per lease.
_ACQUIRE_MANY = _LEADS + """
if ARGV[2] ~= '' and not leads(KEYS[2], ARGV[2]) then return -1 end
local out = {}
for j = 3, #ARGV do
  local lk = KEYS[j]
  if redis.call('EXISTS', lk) == 1 then
    out[j - 2] = 0
  else
    local lease = cjson.decode(ARGV[j])
    lease['token'] = redis.call('INCR', KEYS[1])
    if ARGV[2] ~= '' then lease['epoch'] = tonumber(ARGV[2]) end
    local s = cjson.encode(lease)
    redis.call('SET', lk, s, 'PX', ARGV[1])
    out[j - 2] = s
  end
end
return out
"""

# Deletes KEYS[j] if it carries token ARGV[j]; returns 1 or 0 per lease.
_RELEASE_ONE = """
local function release(lk, token)
  local v = redis.call('GET', lk)
  if not v then return 0 end
  local ok, lease = pcall(cjson.decode, v)
  if ok and tonumber(lease['token']) == tonumber(token) then
    redis.call('DEL', lk)
    return 1
  end
  return 0
end
"""

_RELEASE_MANY = _RELEASE_ONE + """
local out = {}
for j = 1, #KEYS do out[j] = release(KEYS[j], ARGV[j]) end
return out
"""

# KEYS: leader, then each lease's key and revoke flag. ARGV: flag ttl_ms, epoch ('' = unfenced), then each
# lease's token. Returns -1 when `epoch` does not lead (nothing written), else one _REVOKE answer per lease.
_REVOKE_MANY = _LEADS + _RELEASE_ONE + """
if ARGV[2] ~= '' and not leads(KEYS[1], ARGV[2]) then return -1 end
local out = {}
for j = 1, #ARGV - 2 do
  local token = ARGV[2 + j]
  redis.call('SET', KEYS[1 + 2 * j], token, 'PX', ARGV[1])
  redis.call('PUBLISH', KEYS[1 + 2 * j], token)
  out[j] = release(KEYS[2 * j], token)
end
return out
"""

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
        self._renew_many = self.r.register_script(_RENEW_MANY)
        self._acquire = self.r.register_script(_ACQUIRE)
        self._revoke = self.r.register_script(_REVOKE)
        self._release = self.r.register_script(_RELEASE)
        self._fenced_set = self.r.register_script(_FENCED_SET)
        self._acquire_many = self.r.register_script(_ACQUIRE_MANY)
        self._revoke_many = self.r.register_script(_REVOKE_MANY)
        self._release_many = self.r.register_script(_RELEASE_MANY)
        self._key_cache: dict[tuple[str, int], tuple[str, str]] = {}

    def _keys(self, node: str, gpu: int) -> tuple[str, str]:
        """The GPU's lease key and revoke flag (kept: the scheduler names every GPU's keys many times a second)."""
        keys = self._key_cache.get((node, gpu))
        if keys is None:
            keys = self._key_cache[(node, gpu)] = (
                state.key(self.cluster, "lease", node=node, gpu=gpu),
                state.key(self.cluster, "revoke", node=node, gpu=gpu),
            )
        return keys

    def revoke_channel(self, node: str, gpu: int) -> str:
        """The pub/sub channel the GPU's revocations are published on (the token): its revoke flag key's name."""
        return self._keys(node, gpu)[1]

    @property
    def _leader_key(self) -> str:
        return state.key(self.cluster, "leader")

    def acquire(self, node: str, gpu: int, holder: str, ttl_s: float, epoch: int | None = None,
                client: Any = None) -> Any:
        """Grant a new lease with a fresh fencing token, or None if the GPU is already leased. With `epoch`
        (the scheduler always passes its own) the grant happens only while that leader epoch leads, else
        LeaderLost; the lease records the epoch. `client`: a pipeline to queue the call on; its result then
        comes with the pipeline's and `granted` reads it."""
        lease_key, _ = self._keys(node, gpu)
        template = {"node": node, "gpu": gpu, "holder": holder, "granted_at": time.time(), "ttl_s": ttl_s}
        out = call_script(self._acquire, [lease_key, state.key(self.cluster, "fence"), self._leader_key],
                          [state.encode_dict(template), _ms(ttl_s), _epoch_arg(epoch)], client)
        return out if client is not None else self.granted(out, node, gpu, epoch)

    def granted(self, out: Any, node: str, gpu: int, epoch: int | None = None) -> Lease | None:
        """The lease an acquire call answered with `out` granted, None when the GPU was leased already."""
        if isinstance(out, Exception):
            raise out
        if out == -1:
            raise LeaderLost(f"epoch {epoch} does not lead cluster {self.cluster}: lend of {node}:{gpu} refused")
        if out == 0:
            return None
        return state.decode(Lease, out, where=self._keys(node, gpu)[0])

    def renew(self, node: str, gpu: int, token: int, ttl_s: float, require_heartbeat: bool = True,
              client: Any = None) -> Any:
        """Extend the lease by ttl_s if `token` still holds it (and, for a lease granted under a leader epoch,
        that epoch still leads); returns RENEWED or a negative reason code. `client`: a pipeline to queue the
        call on (the result then comes with the pipeline's)."""
        lease_key, revoke_key = self._keys(node, gpu)
        hb = state.key(self.cluster, "scheduler_heartbeat")
        out = call_script(self._renew, [lease_key, revoke_key, hb, self._leader_key],
                          [token, _ms(ttl_s), "1" if require_heartbeat else "0"], client)
        return out if client is not None else int(out)

    def renew_many(self, leases: list[tuple[str, int, int]], ttl_s: float, require_heartbeat: bool = True,
                   client: Any = None) -> Any:
        """renew() of many (node, gpu, token) leases in one command: one code each, in order. `client`: a pipeline
        to queue the call on."""
        keys = [state.key(self.cluster, "scheduler_heartbeat"), self._leader_key]
        for node, gpu, _ in leases:
            keys.extend(self._keys(node, gpu))
        out = call_script(self._renew_many, keys,
                          [_ms(ttl_s), "1" if require_heartbeat else "0", *(t for _, _, t in leases)], client)
        return out if client is not None else [int(x) for x in out]

    def revoke(self, node: str, gpu: int, token: int, flag_ttl_s: float = 60.0, epoch: int | None = None,
               client: Any = None) -> Any:
        """Flag `token` as revoked and delete its lease; True if the lease was still there. With `epoch`,
        only while that leader epoch leads, else LeaderLost and nothing is written. `client`: a pipeline to
        queue the call on; `revoked` reads its result."""
        lease_key, revoke_key = self._keys(node, gpu)
        out = call_script(self._revoke, [lease_key, revoke_key, self._leader_key],
                          [token, _ms(flag_ttl_s), _epoch_arg(epoch)], client)
        return out if client is not None else self.revoked(out, node, gpu, epoch)

    def revoked(self, out: Any, node: str, gpu: int, epoch: int | None = None) -> bool:
        if isinstance(out, Exception):
            raise out
        if int(out) == -1:
            raise LeaderLost(f"epoch {epoch} does not lead cluster {self.cluster}: revoke of {node}:{gpu} refused")
        return bool(int(out))

    def release(self, node: str, gpu: int, token: int, client: Any = None) -> Any:
        """Delete the lease if `token` holds it (a holder giving the GPU back). `client`: a pipeline to queue on."""
        lease_key, _ = self._keys(node, gpu)
        out = call_script(self._release, [lease_key], [token], client)
        return out if client is not None else bool(out)

    # -- bulk forms, for the scheduler's tick: queued on a pipeline (`client`), one result list each --------------
    def acquire_many(self, gpus: list[tuple[str, int]], holder: str, ttl_s: float, epoch: int | None,
                     client: Any) -> None:
        """acquire() of each (node, gpu), in one command; `answers` splits the result into acquire() answers."""
        keys = [state.key(self.cluster, "fence"), self._leader_key, *(self._keys(n, g)[0] for n, g in gpus)]
        now = time.time()
        args = [state.encode_dict({"node": n, "gpu": g, "holder": holder, "granted_at": now, "ttl_s": ttl_s})
                for n, g in gpus]
        call_script(self._acquire_many, keys, [_ms(ttl_s), _epoch_arg(epoch), *args], client)

    def revoke_many(self, leases: list[tuple[str, int, int]], flag_ttl_s: float, epoch: int | None,
                    client: Any) -> None:
        """revoke() of each (node, gpu, token), in one command; `answers` splits the result into revoke()
        answers."""
        keys = [self._leader_key]
        for node, gpu, _ in leases:
            keys.extend(self._keys(node, gpu))
        call_script(self._revoke_many, keys, [_ms(flag_ttl_s), _epoch_arg(epoch), *(t for _, _, t in leases)],
                    client)

    def release_many(self, leases: list[tuple[str, int, int]], client: Any) -> None:
        """release() of each (node, gpu, token), in one command; `answers` splits the result."""
        call_script(self._release_many, [self._keys(n, g)[0] for n, g, _ in leases], [t for _, _, t in leases],
                    client)

    @staticmethod
    def answers(out: Any, n: int) -> list[Any]:
        """A bulk call's result as n single answers: the same error, or the same refusal (-1), for each when the
        call failed or the epoch did not lead."""
        if isinstance(out, Exception) or not isinstance(out, list):
            return [out] * n
        return out

    def current(self, node: str, gpu: int) -> Lease | None:
        lease_key, _ = self._keys(node, gpu)
        return state.get(self.r, lease_key, Lease)

    def fenced_set(
        self, node: str, gpu: int, token: int, target_key: str, value: bytes | str, px_ms: int = 0
    ) -> bool:
        """SET target_key only while `token` holds the GPU's lease (a stale holder's write is refused)."""
        lease_key, _ = self._keys(node, gpu)
        return bool(self._fenced_set(keys=[lease_key, target_key], args=[token, value, px_ms]))


def call_script(script: Any, keys: list, args: list, client: Any = None) -> Any:
    """Run a registered script: EVALSHA on the connection when `client` is None (redis-py loads it on NOSCRIPT); EVAL
    of its text on a pipeline, where redis-py would otherwise check that the pipeline's scripts are loaded with one
    more round trip (SCRIPT EXISTS) at every execute. Redis keeps the compiled script either way."""
    if client is None:
        return script(keys=keys, args=args)
    return client.eval(script.script, len(keys), *keys, *args)


def _epoch_arg(epoch: int | None) -> str:
    return "" if epoch is None else str(int(epoch))


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))
