"""Synchronous elastic rounds (`trainer.merge_rule = rounds`): one optimizer step over every contributor's gradient.

The asynchronous lineage (lineage.py) lets each session take its own AdamW steps and merge deltas; a delta that
lands after another contributor's is computed on weights that miss that work, and each contributor's step is
normalised on its own batch. Rounds take one step over all of them: every member computes a gradient at the same
weights, the round sums them over a collective, and every member applies the same AdamW step, so members hold the
same weights and moments at all times.

- **Round log (Redis).** Hash `lineage:rounds`: `open` is the round taking entries; `{r}:in` lists its entries
  (session, process tag, tokens, batch share, and `a`: the round the member's weights are before). A round closes
  (one Lua script, atomically) when every member waited for has an entry in it, or when its deadline passes:
  trainer.round_wait × the first entry's compute time after that entry. Members are `lineage:members` (heartbeat,
  the round of their first entry: a joiner is not waited for before it has one); one not seen for MEMBER_TTL_S is
  not waited for (it was killed: a stop leaves explicitly). An entry that finds its round closed goes into the open
  round, one round stale.
- **Exchange (collective.py).** The closed round's entries, in session order, are the ranks of a process group
  (gloo; NCCL on CUDA) that meets through Redis and is kept while the participant set stays the same (`{r}:g`
  names it). Participants whose weights are behind the newest among them (a joiner, a member whose entry was
  late) first receive that member's weights, AdamW moments and counters by broadcast. Then one all-reduce sums the
  gradients, each pre-weighted by its entry's share of the round's tokens (per-token means averaged by tokens),
  and the step is one AdamW step at lr × min(Σ shares, trainer.round_max_lr_scale) (linear scaling; a step cut
  short by a stop has share < 1). One participant alone takes its own gradient as it is: one member is plain
  sequential training, bit for bit.
- **Commit.** Each participant votes (one Lua script) whether its collectives completed; the round is applied only
  when every participant voted yes, and the first no or the voting's timeout decides it failed, once for all. A
  failed round (a member SIGKILLed or silent inside it) is lost whole: the survivors' weights are those before it,
  the same at every one of them, and they go on with the next round in a new group. Every collective and the vote
  wait at most max(trainer.round_timeout_s, trainer.round_wait × the compute time): no member hangs.
- **The newest state.** Rounds are decided in order (a round's exchange first waits for the one before it), and
  the log keeps the newest applied round and the participants that hold its state (`last`, `holders`). A round
  none of whose participants holds that state is decided once (`{r}:mode`, by the first participant to ask): its
  entries move on to the open round while a holder is a live member (it is waited for there), and otherwise its
  participants go on from the head (the holders were killed before publishing: the rounds after the head are lost).
- **Heads (files).** The member whose entry (or poll) closed a round publishes the head (weights and moments as of
  that round, `LineageHead.round`) when trainer.merge_every_steps rounds have closed since the head, and a leaving
  member publishes what it applied: a compare-and-swap on the head's number, fenced by the lease like a merge, that
  adds each session's entries to `lineage:contributions`. A joining member pulls the head; the members catch it up
  in its first round. Rounds up to the head before the new one are then collected (their fields in the log).
- **Leaving.** A session leaves at each stop (validation, lend over): it is no longer waited for, and its work is
  published. It rejoins at its next run.

When every member is gone, the rounds since the last head are lost (nobody holds them); the next member starts from
the head. Rounds need Redis and the torch backend.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tailspec.core import state
from tailspec.core.config import TrainerConfig
from tailspec.core.state import LineageHead
from tailspec.drafter_trainer import lineage as lineage_module
from tailspec.drafter_trainer.checkpoint import write_checkpoint_dir
from tailspec.drafter_trainer.collective import CollectiveFailed, Exchange, flatten, unflatten
from tailspec.drafter_trainer.lineage import (
    FENCE_LUA,
    FENCED,
    MERGED,
    MOVED,
    LineageError,
    copy_trainable,
    snapshot,
)

LOST = -4  # a publish holding a round decided lost (_PUBLISH)

log = logging.getLogger(__name__)

APPLIED, FAILED, CARRIED = 1, 0, 2  # a round's outcome for a participant
MAX_CARRIES = 20  # an entry behind the newest state moves on at most this many rounds (each one deadline) for a holder
MEMBER_TTL_S = 5.0  # a member not seen this long (no entry, no poll) is not waited for: it was killed
POLL_S = 0.002  # a waiting member asks whether its round closed (or was decided) this often: one local round trip

_LIB = """
local function now() local t = redis.call('TIME') return tonumber(t[1]) + tonumber(t[2]) / 1e6 end
local function entries(r)
  local raw = redis.call('HGET', KEYS[1], r .. ':in')
  if raw then return cjson.decode(raw) end
  return {}
end
local function complete(r, t, ttl)
  local es = entries(r)
  if #es == 0 then return false end
  local have = {}
  for _, e in ipairs(es) do have[e['s']] = true end
  local m = redis.call('HGETALL', KEYS[2])
  for i = 1, #m, 2 do
    local info = cjson.decode(m[i + 1])
    if tonumber(info['joined']) <= r and t - tonumber(info['hb']) <= ttl and not have[m[i]] then return false end
  end
  return true
end
local function close(r)
  local ids = {}
  for _, e in ipairs(entries(r)) do table.insert(ids, e['s'] .. ':' .. e['p']) end
  table.sort(ids)
  local set = table.concat(ids, ',')
  if #ids > 1 then
    if redis.call('HGET', KEYS[1], 'group:set') ~= set then
      redis.call('HSET', KEYS[1], 'group:set', set, 'group:id', redis.call('HINCRBY', KEYS[1], 'group:n', 1))
    end
    redis.call('HSET', KEYS[1], r .. ':g', redis.call('HGET', KEYS[1], 'group:id'))
  end
  redis.call('HSET', KEYS[1], r .. ':closed', 1)
  redis.call('HSET', KEYS[1], 'open', r + 1)
end
local function open_round(init)
  local o = redis.call('HGET', KEYS[1], 'open')
  if o then return tonumber(o) end
  redis.call('HSET', KEYS[1], 'open', init)
  return tonumber(init)
end
local function seen(sid, t, joined)
  local info = redis.call('HGET', KEYS[2], sid)
  if info then joined = cjson.decode(info)['joined'] end
  redis.call('HSET', KEYS[2], sid, cjson.encode({hb = t, joined = joined}))
end
"""

# KEYS rounds, members, lease|'', revoke|''. ARGV round, entry JSON, session, init round, wait s, ttl s, token.
# → {1, round the entry went into, closed by it (1/0)}; {-2, ..} fenced; {-4, open, 0} the log is behind the member.
_CONTRIBUTE = _LIB + FENCE_LUA + """
if not lease_ok(ARGV[7]) then return {-2, 0, 0} end
local t = now()
local open = open_round(ARGV[4])
local r = tonumber(ARGV[1])
if r > open then return {-4, open, 0} end
if r < open then r = open end
local es = entries(r)
table.insert(es, cjson.decode(ARGV[2]))
redis.call('HSET', KEYS[1], r .. ':in', cjson.encode(es))
if #es == 1 then redis.call('HSET', KEYS[1], r .. ':dl', t + tonumber(ARGV[5])) end
seen(ARGV[3], t, r)
if complete(r, t, tonumber(ARGV[6])) then close(r) return {1, r, 1} end
return {1, r, 0}
"""

# KEYS rounds, members. ARGV round, session, ttl. → 1 closed before, 2 closed now by this call, 0 open, 3 the
# round is not in the log (Redis lost it).
_POLL = _LIB + """
if redis.call('HGET', KEYS[1], ARGV[1] .. ':closed') then return 1 end
if redis.call('HEXISTS', KEYS[1], ARGV[1] .. ':in') == 0 then return 3 end
local t = now()
local r = tonumber(ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then seen(ARGV[2], t, r) end
local dl = redis.call('HGET', KEYS[1], r .. ':dl')
if (dl and t >= tonumber(dl)) or complete(r, t, tonumber(ARGV[3])) then close(r) return 2 end
return 0
"""

# KEYS rounds, members. ARGV session, init round. → the open round. The member registers with its first entry.
_JOIN = _LIB + """
return open_round(ARGV[2])
"""

# KEYS rounds, members. ARGV session, ttl. → 1 when the open round closed because the rest are in.
_LEAVE = _LIB + """
redis.call('HDEL', KEYS[2], ARGV[1])
local o = redis.call('HGET', KEYS[1], 'open')
if o and complete(tonumber(o), now(), tonumber(ARGV[2])) then close(tonumber(o)) return 1 end
return 0
"""

# KEYS rounds. ARGV round, vote (1 its collectives completed, 0 not, -1 no vote: the voting's time is up, 2 its
# entries move on to the open round: no participant could be caught up), participants, their sessions (JSON). → 1 applied, 0 failed (decided once: the first no or timeout), -1 undecided.
# An applied round is the newest state (`last`, held by `holders`); a failed round is counted (`failed`) and its group
# is not used again.
_VOTE = """
local r = ARGV[1]
local d = redis.call('HGET', KEYS[1], r .. ':commit')
if d then return tonumber(d) end
if ARGV[2] == '1' then
  if redis.call('HINCRBY', KEYS[1], r .. ':votes', 1) < tonumber(ARGV[3]) then return -1 end
  redis.call('HSET', KEYS[1], r .. ':commit', 1)
  if tonumber(redis.call('HGET', KEYS[1], 'last') or '0') < tonumber(r) then
    redis.call('HSET', KEYS[1], 'last', r, 'holders', ARGV[4])
  end
  return 1
end
if ARGV[2] == '-1' and redis.call('HEXISTS', KEYS[1], r .. ':in') == 0 then return 0 end
redis.call('HSET', KEYS[1], r .. ':commit', 0)
if ARGV[2] == '2' then return 0 end
redis.call('HINCRBY', KEYS[1], 'failed', 1)
if redis.call('HGET', KEYS[1], 'group:id') == redis.call('HGET', KEYS[1], r .. ':g') then
  redis.call('HDEL', KEYS[1], 'group:set', 'group:id')
end
return 0
"""

# KEYS head, contributions, lease|'', revoke|'', rounds. ARGV expected head number, new head JSON, -, -, -, -, token,
# counts JSON {session: entries}, JSON list of the rounds in the publisher's weights. → {code, head number now}; LOST
# when one of those rounds was decided lost (_MODE): the others went on without it, so weights that hold it are
# not theirs to build on.
_PUBLISH = FENCE_LUA + """
local cur = redis.call('GET', KEYS[1])
local num = 0
if cur then num = tonumber(cjson.decode(cur)['number']) end
if num ~= tonumber(ARGV[1]) then return {-1, num} end
if not lease_ok(ARGV[7]) then return {-2, num} end
for _, q in ipairs(cjson.decode(ARGV[9])) do
  if redis.call('HGET', KEYS[5], q .. ':commit') == '2' then return {-4, num} end
end
redis.call('SET', KEYS[1], ARGV[2])
for sid, n in pairs(cjson.decode(ARGV[8])) do redis.call('HINCRBY', KEYS[2], sid .. ':steps', n) end
return {1, num + 1}
"""

# KEYS rounds, members. ARGV round, newest `a` among its entries, ttl s, head round. → how round r is exchanged,
# decided once (the first participant to ask; the others read it): 'go' (a participant holds the newest state: it
# catches the others up), 'carry' (none does, and a live member outside the round does: the entries move on to the
# open round), 'head' (the head holds it: every participant goes on from the head), 'lost' (nobody alive holds it:
# the rounds after the head are lost, marked 2, and every participant goes on from the head).
_MODE = """
local r = ARGV[1]
local m = redis.call('HGET', KEYS[1], r .. ':mode')
if m then return m end
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
local h = tonumber(ARGV[4])
if tonumber(ARGV[2]) > last then
  m = 'go'
else
  m = 'head'
  if h < last then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
    for _, sid in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'holders') or '[]')) do
      local info = redis.call('HGET', KEYS[2], sid)
      if info and now - tonumber(cjson.decode(info)['hb']) <= tonumber(ARGV[3]) then m = 'carry' end
    end
    if m == 'head' then
      for q = h + 1, last do
        if redis.call('HGET', KEYS[1], q .. ':commit') == '1' then redis.call('HSET', KEYS[1], q .. ':commit', 2) end
      end
      redis.call('HSET', KEYS[1], 'last', h, 'holders', '[]')
      m = 'lost'
    end
  end
end
redis.call('HSET', KEYS[1], r .. ':mode', m)
return m
"""

ROUND_FIELDS = ("in", "dl", "closed", "g", "votes", "commit", "mode")


class Rounds:
    """One session's membership in the lineage's synchronous rounds (the module doc). The session (training_session.py)
    calls `join` when it starts a run, `step` in place of its optimizer step, `leave` in its last merge."""

    def __init__(self, lineage: Any, session_id: str, cfg: TrainerConfig, device: torch.device | None = None):
        if lineage.redis is None:
            raise ValueError("trainer.merge_rule = rounds needs Redis (the round log); without it use async")
        if cfg.backend != "torch":
            raise ValueError(f"trainer.merge_rule = rounds needs trainer.backend = torch, not {cfg.backend!r} "
                             "(set trainer.merge_rule = async)")
        self.lin, self.sid, self.cfg = lineage, session_id, cfg
        r, c = lineage.redis, lineage.cluster
        self.redis = r
        self.keys = [state.key(c, "lineage_rounds"), state.key(c, "lineage_members")]
        self._contribute, self._poll = r.register_script(_CONTRIBUTE), r.register_script(_POLL)
        self._join, self._leave = r.register_script(_JOIN), r.register_script(_LEAVE)
        self._vote, self._publish = r.register_script(_VOTE), r.register_script(_PUBLISH)
        self._mode = r.register_script(_MODE)
        self.exchange = Exchange(r, f"{self.keys[0]}:collective:", device or torch.device("cpu"))
        self.next: int | None = None  # the round this member's weights are before (it contributes to it)
        self.joined = False
        self._tag = uuid.uuid4().hex[:8]  # this process in the group's names: a session id reused never collides
        self._applied: dict[int, list[str]] = {}  # round → its entries' sessions, since the head the member knows
        self._head_round = 0
        self._since = time.monotonic()  # when the member last applied a round: its gradient's compute time from here
        self.late = 0  # entries that found their round closed (applied one round later)
        self.waited_s = 0.0  # time waiting for rounds to close
        self.exchange_s = 0.0  # time in the rounds' collectives and votes
        self.rounds = 0  # rounds applied
        self.failed = 0  # rounds this member was in that failed (lost whole)
        self._contributions = state.key(c, "lineage_contributions")
        self._credited_before = self._credited()  # a session id reused: an earlier process's credit is not ours

    @property
    def merged(self) -> int:
        """This member's entries that published heads hold: what the lineage's contributions credit it with. Its own
        applied rounds cannot tell: a round it applied can be decided lost after it left (_MODE: no live holder), and
        a head then published from the older head covers that round's number without holding it."""
        return self._credited() - self._credited_before

    def _credited(self) -> int:
        return int(self.redis.hget(self._contributions, f"{self.sid}:steps") or 0)

    # -- membership ------------------------------------------------------------------------------------
    def join(self, s: Any) -> None:
        """Register for the open round. A member behind it (a joiner from the head) is caught up by the others in
        its first round; it is waited for from its first entry on (its first step is not held against the others)."""
        if self.next is None:
            self.next = s.base.round + 1
            self._head_round = s.base.round
        self._join(keys=self.keys, args=[self.sid, self._head_round + 1])
        self.joined = True
        self._since = time.monotonic()

    def leave(self, s: Any) -> None:
        """No longer waited for (then `publish`). Every entry of this member was exchanged in its own step."""
        if not self.joined:
            return
        self._leave(keys=self.keys, args=[self.sid, MEMBER_TTL_S])
        self.joined = False

    # -- a step ----------------------------------------------------------------------------------------
    def step(self, s: Any, scale: float, share: float, tokens: int) -> None:
        """Contribute the gradient accumulated in the session's parameters (× `scale`: a per-token mean), wait for
        its round to close, exchange it with the round's other participants and apply the round. A step taken
        outside a run (`train_step` called directly) joins first."""
        if not self.joined:
            self.join(s)
        params = self._params(s)
        with torch.no_grad():
            flat = flatten([(p.grad * scale if scale != 1.0 else p.grad) if p.grad is not None else torch.zeros_like(p)
                            for p in params])
        s.backend.zero_grad()
        compute_s = time.monotonic() - self._since
        entry = json.dumps({"s": self.sid, "p": self._tag, "t": int(tokens), "w": float(share), "a": self.next})
        fence = self.lin.fence
        code, r, closed = self._contribute(keys=self.keys + self.lin.fence_keys(), args=[
            self.next, entry, self.sid, self._head_round + 1, max(0.01, self.cfg.round_wait * compute_s),
            MEMBER_TTL_S, fence.token if fence else 0])
        code, r = int(code), int(r)
        if code == FENCED:
            s.fenced_out = True
            s.request_stop("lineage rounds refused the entry (lease gone)")
            return
        if code == -4:  # the round log restarted behind us (Redis lost it): continue from the head
            self._load_head(s)
            self.join(s)
            return
        if r > self.next:
            self.late += 1
        for _ in range(MAX_CARRIES + 1):
            closed_here = self._await(s, r)
            if closed_here is None:
                return
            outcome = self._exchange(s, r, flat, params, compute_s)
            if outcome != CARRIED:
                break
            # nobody in the round could catch this member up: its entry goes into the open round (still fenced)
            code, r, closed = self._contribute(keys=self.keys + self.lin.fence_keys(), args=[
                self.next, entry, self.sid, self._head_round + 1, max(0.01, self.cfg.round_wait * compute_s),
                MEMBER_TTL_S, fence.token if fence else 0])
            code, r = int(code), int(r)
            if code != 1:
                return
        if outcome == APPLIED and (int(closed) or closed_here) and r - self._head_round >= max(1, self.cfg.merge_every_steps):
            self.publish(s)
        self._since = time.monotonic()

    def _await(self, s: Any, r: int) -> bool | None:
        """Wait for round r to close → whether this call closed it; None when the round is gone from the log (Redis
        lost it: the member continued from the head)."""
        t0 = time.monotonic()
        while not (code := int(self._poll(keys=self.keys, args=[r, self.sid, MEMBER_TTL_S]))):
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - t0
        if code == 3:
            log.warning("round %d of lineage %s is gone from the log; continuing from the head", r, self.lin.root)
            self._load_head(s)
            return None
        return code == 2

    def timeout_s(self, compute_s: float) -> float:
        """Each collective of a round, and its vote, waits at most this: the round's deadline or the floor."""
        return max(self.cfg.round_timeout_s, self.cfg.round_wait * compute_s)

    def _exchange(self, s: Any, r: int, flat: torch.Tensor, params: list[torch.nn.Parameter], compute_s: float) -> int:
        """Round r's collectives and commit; its step applied when every participant's completed → APPLIED, FAILED
        (lost whole), or CARRIED: no participant holds the newest state while a live member outside the round does,
        so the entries move on to the open round, where that member is waited for."""
        timeout = self.timeout_s(compute_s)
        t0 = time.monotonic()
        self._settle(r - 1, timeout)  # rounds apply in order: the newest state is known once the one before is decided
        raw, gid = self.redis.hmget(self.keys[0], f"{r}:in", f"{r}:g")
        entries = sorted(json.loads(raw), key=lambda e: (e["s"], e["p"]))
        sessions = json.dumps([e["s"] for e in entries])
        newest, vote, synced = max(e["a"] for e in entries), 1, False
        src = next((i for i, e in enumerate(entries) if e["a"] == newest), 0) \
            if any(e["a"] < newest for e in entries) else None
        head = self.lin.head()
        mode = self._mode(keys=self.keys, args=[r, newest, MEMBER_TTL_S, head.round if head is not None else 0])
        if mode == b"carry":  # a live member outside the round holds the newest state: move on to a round it is in
            self._decide(r, CARRIED, len(entries), timeout, sessions)
            self.exchange_s += time.monotonic() - t0
            return CARRIED
        if mode in (b"head", b"lost"):  # no participant holds the newest state: every participant goes on from the head
            if mode == b"lost":
                log.warning("lineage %s: the members holding the rounds after the head are gone; round %d goes on from "
                            "the head", self.lin.root, r)
            self._load_head(s)
            newest, src = self.next, None
        behind = self.next < newest
        if vote and len(entries) > 1:
            rank = next(i for i, e in enumerate(entries) if (e["s"], e["p"]) == (self.sid, self._tag))
            total = sum(e["t"] for e in entries)
            try:
                self.exchange.join(gid.decode(), rank, len(entries), timeout)
                if src is not None:  # participants behind the newest among them are caught up first
                    synced = behind
                    self._sync(s, params, src, timeout)
                flat.mul_(entries[rank]["t"] / total if total > 0 else 1.0 / len(entries))
                self.exchange.all_reduce(flat, timeout)
            except CollectiveFailed as e:
                log.warning("session %s: round %d failed (%s); it is lost, the next goes on", self.sid, r, e)
                vote = 0
        applied = self._decide(r, vote, len(entries), timeout, sessions) == 1
        self.exchange_s += time.monotonic() - t0
        if not applied:
            self.failed += 1
            if gid is not None:  # its group is not used again (the round log forgets it too)
                self.exchange.drop()
            if synced:  # its state sync may be partial: back to the head, caught up in a later round
                self._load_head(s)
            elif not behind:
                self.next = r + 1
            return FAILED
        if behind:
            self._learn_missed(r)
        self._apply(s, r, flat, params, entries)
        return APPLIED

    def _settle(self, r: int, timeout_s: float) -> None:
        """Wait for round r's decision when it has participants still exchanging; no decision within the timeout
        fails it (its participants died inside it)."""
        raw, commit = self.redis.hmget(self.keys[0], f"{r}:in", f"{r}:commit")
        if raw is None or commit is not None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.redis.hget(self.keys[0], f"{r}:commit") is not None:
                return
            time.sleep(POLL_S)
        self._vote(keys=self.keys[:1], args=[r, -1, 0, "[]"])

    def _decide(self, r: int, vote: int, participants: int, timeout_s: float, sessions: str) -> int:
        """Vote on round r and wait for its decision (1 applied, 0 failed); no decision within the timeout fails it."""
        got = int(self._vote(keys=self.keys[:1], args=[r, vote, participants, sessions]))
        deadline = time.monotonic() + timeout_s
        while got == -1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
            got = int(self.redis.hget(self.keys[0], f"{r}:commit") or -1)
        if got == -1:
            got = int(self._vote(keys=self.keys[:1], args=[r, -1, participants, sessions]))
        return got

    def _sync(self, s: Any, params: list[torch.nn.Parameter], src: int, timeout_s: float) -> None:
        """The newest participant's weights, AdamW moments and counters into every participant (broadcast)."""
        opt = s.backend.optimizer
        sts = [opt.state.get(p, {}) for p in params]
        has = all("exp_avg" in st for st in sts)
        counters = torch.tensor([s.step, s.tokens_total, int(has),
                                 int(float(sts[0]["step"])) if has and params else 0], dtype=torch.int64)
        self.exchange.broadcast(counters, src, timeout_s)
        ws = flatten([p.detach() for p in params]).to(params[0].device)
        self.exchange.broadcast(ws, src, timeout_s)
        moments = []
        if int(counters[2]):
            moments = [flatten([st.get(k, torch.zeros_like(p)) if has else torch.zeros_like(p)
                                for st, p in zip(sts, params)]).to(params[0].device) for k in ("exp_avg", "exp_avg_sq")]
            for m in moments:
                self.exchange.broadcast(m, src, timeout_s)
        with torch.no_grad():
            for p, w in zip(params, unflatten(ws, params)):
                p.copy_(w)
        if moments:
            avg, sq = unflatten(moments[0], params), unflatten(moments[1], params)
            for p, a, q in zip(params, avg, sq):
                opt.state[p] = {"step": torch.tensor(float(counters[3]), dtype=torch.float32),
                                "exp_avg": a.clone(), "exp_avg_sq": q.clone()}
        else:
            opt.state.clear()
        s.step, s.tokens_total = int(counters[0]), int(counters[1])

    def _learn_missed(self, r: int) -> None:
        """A member caught up in round r: the rounds it missed since its head, from the log, for its publish's counts."""
        for m in range(self._head_round + 1, r):
            if m in self._applied:
                continue
            raw, commit = self.redis.hmget(self.keys[0], f"{m}:in", f"{m}:commit")
            if raw is not None and commit is not None and int(commit) == 1:
                self._applied[m] = [e["s"] for e in json.loads(raw)]

    def _apply(self, s: Any, r: int, flat: torch.Tensor, params: list[torch.nn.Parameter], entries: list[dict]) -> None:
        for p, g in zip(params, unflatten(flat, params)):
            p.grad = g
        s.backend.apply(1.0, lr_scale=min(sum(e["w"] for e in entries), self.cfg.round_max_lr_scale))
        s.backend.zero_grad()
        self._applied[r] = [e["s"] for e in entries]
        s.step += len(entries)
        s.tokens_total += sum(e["t"] for e in entries)
        s._steps_since_merge += len(entries)
        self.next = r + 1
        self.rounds += 1

    @staticmethod
    def _params(s: Any) -> list[torch.nn.Parameter]:
        return [p for _, p in s.drafter.named_parameters() if p.requires_grad]

    def _load_head(self, s: Any) -> None:
        """The session's weights, moments and counters from the lineage head (the member is behind the others until
        its next round catches it up)."""
        head, ck = self.lin.pull(s.teacher.embedding(), map_location=str(s.drafter.fc.weight.device))
        copy_trainable(ck.drafter, s.drafter)
        if ck.optimizer_state is not None:
            s.backend.load_state_dict(ck.optimizer_state)
        s.base, s.base_weights, s.step, s.tokens_total = head, snapshot(s.drafter), head.steps, head.tokens
        s._steps_since_merge = 0
        self.next, self._head_round = head.round + 1, head.round
        self.exchange.drop()
        self._learn(head)

    # -- publishing ------------------------------------------------------------------------------------
    def publish(self, s: Any) -> None:
        """Publish the rounds this member applied as the lineage head, unless a head already holds them; then
        collect the rounds up to the head before it. A round of its own that was decided lost (a member that left
        before publishing: no live holder) is not published: the member takes the head instead. The session's
        merged steps: `merged`."""
        upto = self.next - 1
        for _ in range(self.lin.max_attempts):
            h = self.lin.head()
            if h is None:
                raise LineageError(f"lineage {self.lin.root} has no head to publish rounds onto")
            if h.round >= upto:
                if h.round == upto:
                    s.base, s.base_weights, s._steps_since_merge = h, snapshot(s.drafter), 0
                elif not self.joined:  # a newer head than our weights: a leaving member takes it (proposals use it)
                    self._load_head(s)
                self._learn(h)
                return
            counts: dict[str, int] = {}
            for r in range(h.round + 1, upto + 1):
                for sid in self._applied.get(r, ()):
                    counts[sid] = counts.get(sid, 0) + 1
            record = LineageHead(number=h.number + 1, path="", steps=h.steps + sum(counts.values()),
                                 tokens=s.tokens_total, merges=h.merges + 1,
                                 policy_version=max(s.teacher.policy_version, h.policy_version),
                                 session_id=self.sid, round=upto, updated_at=time.time())
            path = self.lin.root / f"head-{record.number:08d}-{self.sid}-r{upto}"
            record.path = str(path.resolve())
            opt = s._host_optimizer if s._host_optimizer is not None else s.backend.state_dict()
            try:
                write_checkpoint_dir(path, s.drafter, opt, {
                    "step": record.steps, "tokens": record.tokens, "backend": s.backend.name, "session_id": self.sid,
                    "policy_version": s.teacher.policy_version, "saved_at": time.time(),
                    "lineage": record.model_dump(mode="json")})
            except Exception as e:  # OSError, or safetensors' own error for a collected temp dir
                if self.lin.head() != h:  # another member published (and collected our temp dir): re-read
                    shutil.rmtree(path, ignore_errors=True)
                    continue
                raise LineageError(f"could not write lineage head {path}: {e}") from e
            if lineage_module.FAULT_HOOK is not None:  # the tests' seam, as in a merge
                lineage_module.FAULT_HOOK("written", path)
            fence = self.lin.fence
            applied = [r for r in range(h.round + 1, upto + 1) if r in self._applied]  # in this member's weights
            code, _ = self._publish(keys=[*self.lin.head_keys(), self.keys[0]], args=[
                h.number, state.encode(record), 0, 0, 0, 0, fence.token if fence else 0, json.dumps(counts),
                json.dumps(applied)])
            if int(code) == LOST:  # a round only this member held was given up while it was leaving
                shutil.rmtree(path, ignore_errors=True)
                for r in applied:
                    self._applied.pop(r, None)
                self._load_head(s)
                return
            if int(code) == MERGED:
                s.merges += 1
                s.base, s.base_weights, s._steps_since_merge = record, snapshot(s.drafter), 0
                self._learn(record)
                self.lin.after_merge(record, sum(counts.values()), Path(h.path))
                self._collect(h.round)
                return
            shutil.rmtree(path, ignore_errors=True)
            if int(code) != MOVED:
                s.fenced_out = True
                return
        raise LineageError(f"publishing round {upto} lost the compare-and-swap {self.lin.max_attempts} times")

    def _learn(self, h: LineageHead) -> None:
        """A head covers the rounds up to h.round: they are no longer this member's to publish."""
        for r in [r for r in self._applied if r <= h.round]:
            del self._applied[r]
        self._head_round = max(self._head_round, h.round)

    def _collect(self, upto: int) -> None:
        """Delete the rounds up to `upto` from the log, and members not seen for MEMBER_TTL_S (killed: a stop leaves)."""
        drop = set()
        for k in self.redis.hkeys(self.keys[0]):
            head, _, field = k.decode().partition(":")
            if field in ROUND_FIELDS and head.isdigit() and int(head) <= upto:
                drop.add(k)
        if drop:
            self.redis.hdel(self.keys[0], *drop)
        now, gone = float(self.redis.time()[0]), []
        for sid, info in self.redis.hgetall(self.keys[1]).items():
            if now - float(json.loads(info)["hb"]) > MEMBER_TTL_S:
                gone.append(sid)
        if gone:
            self.redis.hdel(self.keys[1], *gone)
