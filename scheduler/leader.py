"""Leader election among a cluster's schedulers: one leads under a fenced Redis lease, the others stand by.

The leader key `scheduler:leader` holds a `SchedulerLeader` record (epoch, holder, node, pid, since) and
expires after `scheduler.leader_ttl_s` unless renewed. Taking it is one Lua script: if the key is absent,
INCR `scheduler:epoch` and SET the record with that epoch, PX ttl. Epochs are therefore strictly increasing
per cluster and name one term of one holder. Renewal (every tick) is a Lua compare of the stored epoch with
the holder's that extends the key and writes the sessions' heartbeat in the same step, so only the leader
writes the heartbeat; the leading scheduler sends it in the round trip of its tick's reads (`renew_command`). Release (clean exit) deletes both, under the same compare.

The epoch is what fences the leader's lease writes (scheduler/leases.py): a scheduler that was paused past
its leader TTL, while a standby took the key, finds its epoch refused at its next lend, revoke or renewal.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tailspec.core import state
from tailspec.core.state import SchedulerLeader, StateError

# KEYS: leader, epoch counter, heartbeat. ARGV: record JSON without epoch, ttl_ms, heartbeat value, heartbeat px.
# Returns {epoch, record} when taken, {0, current record or ''} when someone leads.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then return {0, cur} end
local rec = cjson.decode(ARGV[1])
rec['epoch'] = redis.call('INCR', KEYS[2])
local s = cjson.encode(rec)
redis.call('SET', KEYS[1], s, 'PX', ARGV[2])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
return {rec['epoch'], s}
"""

# Lua: the epoch stored in the leader key, or nil.
_EPOCH_OF = """
local function epoch_of(k)
  local v = redis.call('GET', k)
  if not v then return nil end
  local ok, rec = pcall(cjson.decode, v)
  if not ok or type(rec) ~= 'table' then return nil end
  return tonumber(rec['epoch'])
end
"""

# KEYS: leader, heartbeat. ARGV: epoch, ttl_ms, heartbeat value, heartbeat px. 1 renewed, 0 not the leader.
_RENEW = _EPOCH_OF + """
if epoch_of(KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
return 1
"""

# KEYS: leader, heartbeat. ARGV: epoch. Deletes both only while `epoch` leads.
_RELEASE = _EPOCH_OF + """
if epoch_of(KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


def new_holder_id(node: str) -> str:
    """A name unique to one scheduler instance: node, pid and a random suffix (two instances may share a pid)."""
    return f"{node}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class LeaderElection:
    """One contender's view of the leader key. `epoch` is the term this contender holds, None while it stands by."""

    r: Any
    cluster: str
    node: str
    ttl_s: float
    heartbeat_px: int  # the sessions' heartbeat, written with every renewal
    holder: str = ""
    epoch: int | None = None
    leader: SchedulerLeader | None = None  # the leader as last seen (self when leading)
    terms: int = 0  # terms won by this contender
    _scripts: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.holder = self.holder or new_holder_id(self.node)
        self._scripts = {
            "acquire": self.r.register_script(_ACQUIRE),
            "renew": self.r.register_script(_RENEW),
            "release": self.r.register_script(_RELEASE),
        }
        self._keys = {n: state.key(self.cluster, n) for n in ("leader", "leader_epoch", "scheduler_heartbeat")}

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    def hold(self, renewed: Any = None) -> bool:
        """Renew the term this contender holds, or try to take the key when it holds none (or just lost it).
        Returns whether it leads now; `epoch` changes when a term was lost or won. `renewed`: the answer to
        `renew_command`, sent by the caller with its own commands (None: renew here)."""
        if self.epoch is not None and not (self.renew() if renewed is None else int(renewed)):
            self.epoch = None
        if self.epoch is None:
            self.acquire()
        return self.epoch is not None

    def acquire(self) -> bool:
        """Take the leader key if nobody holds it; a win starts a new epoch."""
        rec = {"holder": self.holder, "node": self.node, "pid": os.getpid(), "since": time.time()}
        epoch, raw = self._scripts["acquire"](
            keys=[self._keys["leader"], self._keys["leader_epoch"], self._keys["scheduler_heartbeat"]],
            args=[state.encode_dict(rec), _ms(self.ttl_s), repr(time.time()), self.heartbeat_px],
        )
        self.leader = _parse(raw)
        if int(epoch) > 0:
            self.epoch = int(epoch)
            self.terms += 1
        return self.epoch is not None

    def renew(self) -> bool:
        """Extend this contender's term and write the heartbeat; False (nothing written) when it no longer leads."""
        assert self.epoch is not None
        ok = self._scripts["renew"](
            keys=[self._keys["leader"], self._keys["scheduler_heartbeat"]],
            args=[self.epoch, _ms(self.ttl_s), repr(time.time()), self.heartbeat_px],
        )
        return bool(ok)

    def renew_command(self) -> tuple:
        """`renew` as one command for the caller to send with its own (its answer goes to `hold`): EVAL of the
        script's text, so it needs no script cache (a restarted Redis has none)."""
        assert self.epoch is not None
        return ("EVAL", _RENEW, 2, self._keys["leader"], self._keys["scheduler_heartbeat"], self.epoch,
                _ms(self.ttl_s), repr(time.time()), self.heartbeat_px)

    def release(self) -> bool:
        """Give the key up at a clean exit (a standby takes over at its next tick instead of after the TTL)."""
        if self.epoch is None:
            return False
        ok = bool(self._scripts["release"](
            keys=[self._keys["leader"], self._keys["scheduler_heartbeat"]], args=[self.epoch]
        ))
        self.epoch = None
        return ok


def current_leader(r: Any, cluster: str) -> SchedulerLeader | None:
    """The leader record, or None when no scheduler leads (or the record is malformed)."""
    try:
        return state.get(r, state.key(cluster, "leader"), SchedulerLeader)
    except StateError:
        return None


def _parse(raw: Any) -> SchedulerLeader | None:
    if not raw:
        return None
    try:
        return state.decode(SchedulerLeader, state.text(raw), where="scheduler:leader")
    except StateError:
        return None


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
