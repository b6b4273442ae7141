"""Synchronous elastic rounds (`trainer.merge_rule = rounds`): one optimizer step over every contributor's gradient.

The asynchronous lineage (lineage.py) lets each session take its own AdamW steps and merge deltas; a delta that
lands after another contributor's is computed on weights that miss that work, and each contributor's step is
normalised on its own batch. Two contributors then end below one session at the same total steps, while one step
on both batches at twice the lr gains as much as two steps. Rounds
take that step: every member computes a gradient at the same weights, the round combines them, and every member
applies the same AdamW step, so members hold the same weights and moments at all times.

- **Round log.** Redis hash `lineage:rounds`: `open` is the round taking gradients; `{r}:in` lists its entries
  (session, entry name, tokens, batch share, fresh). An entry's gradient is a safetensors file
  `ROOT/rounds/<session>-<entry name>.safetensors`, in place (temp file, rename) before its entry is added, so
  an entry is whole or absent. Round r's step: the entries' per-token-mean gradients averaged by tokens (in session, entry
  order: the same sum in every member), clipped, one AdamW step at lr × min(Σ shares, trainer.round_max_lr_scale)
  (linear scaling; a step cut short by a stop has share < 1).
- **Closing.** A round closes (one Lua script, atomically) when every member waited for has a fresh entry in it,
  or when its deadline passes: trainer.round_wait × the first entry's compute time after that entry. Members are
  `lineage:members` (heartbeat, the round of their first entry: a joiner is not waited for before it has one);
  one not seen for MEMBER_TTL_S is not waited for (it was killed: a stop leaves explicitly). An entry that finds its round closed goes into the open round, one round
  stale, and its member computes a fresh one there too: no gradient is lost, none is applied twice.
- **Heads are snapshots of the log.** The member whose entry closed a round publishes the head (weights and
  moments as of that round, `LineageHead.round`) when trainer.merge_every_steps rounds have closed since the head,
  and a leaving member publishes what it applied: a compare-and-swap on the head's number, fenced by the lease like
  a merge, that adds each session's entries to `lineage:contributions`. A joining member pulls the head and replays
  the rounds after it from the log, bit for bit what the others computed. Rounds up to the head before the new one
  are then collected (their files and fields).
- **Leaving.** A session leaves at each stop (validation, lend over): it is no longer waited for, any round holding
  its entry is applied, and its work is published. It rejoins at its next run.

One contributor is plain sequential training (every round closes at its entry; lr × 1), up to the files written.
The exchange is files on the lineage's filesystem and Redis round trips, sized for the miniature's drafters (a few
MB of gradient a step); a cluster's GPU drafters would carry the same protocol over a collective instead. Rounds
need Redis and the torch backend.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tailspec.core import state
from tailspec.core.config import TrainerConfig
from tailspec.core.state import LineageHead
from tailspec.drafter_trainer import lineage as lineage_module
from tailspec.drafter_trainer.checkpoint import write_checkpoint_dir
from tailspec.drafter_trainer.lineage import (
    FENCE_LUA,
    FENCED,
    MERGED,
    MOVED,
    LineageError,
    copy_trainable,
    snapshot,
)

log = logging.getLogger(__name__)

MEMBER_TTL_S = 5.0  # a member not seen this long (no entry, no poll) is not waited for: it was killed
ORPHAN_AGE_S = 60.0  # a gradient file no round names, this old, was written by a member killed before its entry
POLL_S = 0.002  # a waiting member asks whether its round closed this often (one local Redis round trip)

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
  for _, e in ipairs(es) do if e['f'] == 1 then have[e['s']] = true end end
  local m = redis.call('HGETALL', KEYS[2])
  for i = 1, #m, 2 do
    local info = cjson.decode(m[i + 1])
    if tonumber(info['joined']) <= r and t - tonumber(info['hb']) <= ttl and not have[m[i]] then return false end
  end
  return true
end
local function close(r)
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
local e = cjson.decode(ARGV[2])
e['f'] = 1
if r < open then e['f'] = 0 r = open end
local es = entries(r)
table.insert(es, e)
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

# KEYS head, contributions, lease|'', revoke|''. ARGV expected head number, new head JSON, -, -, -, -, token,
# counts JSON {session: entries}. → {code, head number now}
_PUBLISH = FENCE_LUA + """
local cur = redis.call('GET', KEYS[1])
local num = 0
if cur then num = tonumber(cjson.decode(cur)['number']) end
if num ~= tonumber(ARGV[1]) then return {-1, num} end
if not lease_ok(ARGV[7]) then return {-2, num} end
redis.call('SET', KEYS[1], ARGV[2])
for sid, n in pairs(cjson.decode(ARGV[8])) do redis.call('HINCRBY', KEYS[2], sid .. ':steps', n) end
return {1, num + 1}
"""


class Rounds:
    """One session's membership in the lineage's synchronous rounds (the module doc). The session (training_session.py)
    calls `join` when it starts a run, `step` in place of its optimizer step, `leave` in its last merge."""

    def __init__(self, lineage: Any, session_id: str, cfg: TrainerConfig):
        if lineage.redis is None:
            raise ValueError("trainer.merge_rule = rounds needs Redis (the round log); without it use async")
        if cfg.backend != "torch":
            raise ValueError(f"trainer.merge_rule = rounds needs trainer.backend = torch, not {cfg.backend!r}")
        self.lin, self.sid, self.cfg = lineage, session_id, cfg
        r, c = lineage.redis, lineage.cluster
        self.redis = r
        self.keys = [state.key(c, "lineage_rounds"), state.key(c, "lineage_members")]
        self.dir = Path(lineage.root) / "rounds"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._contribute, self._poll = r.register_script(_CONTRIBUTE), r.register_script(_POLL)
        self._join, self._leave = r.register_script(_JOIN), r.register_script(_LEAVE)
        self._publish = r.register_script(_PUBLISH)
        self.next: int | None = None  # the round this member's weights are before (it contributes to it)
        self.joined = False
        self._n = 0  # gradient files written
        self._tag = uuid.uuid4().hex[:8]  # in the files' names: a session id reused by a new process never collides
        self._applied: dict[int, list[str]] = {}  # round → its entries' sessions, since the head the member knows
        self._head_round = 0
        self._since = time.monotonic()  # when the member last applied a round: its gradient's compute time from here
        self.late = 0  # entries that found their round closed (applied one round later)
        self.waited_s = 0.0  # time waiting for rounds to close
        self.rounds = 0  # rounds applied
        self.merged = 0  # this member's entries a published head holds

    # -- membership ------------------------------------------------------------------------------------
    def join(self, s: Any) -> None:
        """Catch the weights up to the open round. The member is waited for from its first entry on: a joiner's
        first step (its first batch, a teacher's forward) is not held against the others."""
        if self.next is None:
            self.next = s.base.round + 1
            self._head_round = s.base.round
        open_r = int(self._join(keys=self.keys, args=[self.sid, self._head_round + 1]))
        self.joined = True
        self._replay(s, open_r)
        self._since = time.monotonic()

    def leave(self, s: Any) -> None:
        """No longer waited for, and the rounds holding this member's entries applied (then `publish`)."""
        if not self.joined:
            return
        self._leave(keys=self.keys, args=[self.sid, MEMBER_TTL_S])
        self.joined = False
        if self._holds_mine(self.next):  # a late entry moved into the open round: wait for it to close
            self._await(s, self.next)
            self._replay(s, self.next + 1)

    # -- a step ----------------------------------------------------------------------------------------
    def step(self, s: Any, scale: float, share: float, tokens: int) -> None:
        """Contribute the gradient accumulated in the session's parameters (× `scale`: a per-token mean), then
        apply its round once it closes. An entry that found its round closed catches the member up instead: its
        next step contributes a fresh gradient to the round the late one went into."""
        grads = {n: (p.grad * scale if scale != 1.0 else p.grad).detach().contiguous().cpu()
                 for n, p in s.drafter.named_parameters() if p.requires_grad and p.grad is not None}
        s.backend.zero_grad()
        compute_s = time.monotonic() - self._since
        self._n += 1
        n = f"{self._tag}-{self._n:08d}"
        path = self._file(self.sid, n)
        tmp = path.with_name("." + path.name + ".tmp")
        save_file(grads, str(tmp))
        os.replace(tmp, path)
        entry = json.dumps({"s": self.sid, "n": n, "t": int(tokens), "w": float(share)})
        fence = self.lin.fence
        code, r, closed = self._contribute(keys=self.keys + self.lin.fence_keys(), args=[
            self.next, entry, self.sid, self._head_round + 1, max(0.01, self.cfg.round_wait * compute_s),
            MEMBER_TTL_S, fence.token if fence else 0])
        code, r = int(code), int(r)
        if code == FENCED:
            path.unlink(missing_ok=True)
            s.fenced_out = True
            s.request_stop("lineage rounds refused the entry (lease gone)")
            return
        if code == -4:  # the round log restarted behind us (Redis lost it): continue from the head
            path.unlink(missing_ok=True)
            self._load_head(s)
            self.join(s)
            return
        if r > self.next:
            self.late += 1
            self._replay(s, r)
        else:
            self._await(s, r)
            self._replay(s, r + 1)
            if int(closed) and r - self._head_round >= max(1, self.cfg.merge_every_steps):
                self.publish(s)
        self._since = time.monotonic()

    def _await(self, s: Any, r: int) -> None:
        t0 = time.monotonic()
        while not (code := int(self._poll(keys=self.keys, args=[r, self.sid, MEMBER_TTL_S]))):
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - t0
        if code == 3:  # the round log was lost with Redis: what the head holds is what survives
            log.warning("round %d of lineage %s is gone from the log; continuing from the head", r, self.lin.root)
            self._load_head(s)

    # -- applying the log ------------------------------------------------------------------------------
    def _replay(self, s: Any, upto: int) -> None:
        """Apply the closed rounds from `self.next` up to (not including) `upto`; where the log no longer holds
        one (collected after a newer head), continue from the head."""
        attempts = 0
        while self.next < upto:
            try:
                self._apply(s, self.next)
            except (OSError, KeyError, RuntimeError, SafetensorError) as e:
                attempts += 1
                h = self.lin.head()
                if attempts > 50 or h is None or h.round < self.next:
                    raise LineageError(f"round {self.next} of lineage {self.lin.root} cannot be applied: "
                                       f"{str(e)[:300]}") from e
                self._load_head(s)

    def _apply(self, s: Any, r: int) -> None:
        raw, closed = self.redis.hmget(self.keys[0], f"{r}:in", f"{r}:closed")
        if raw is None or closed is None:
            raise KeyError(f"round {r} is not in the log (collected, or not closed)")
        entries = sorted(json.loads(raw), key=lambda e: (e["s"], e["n"]))
        total = sum(e["t"] for e in entries)
        combined: dict[str, torch.Tensor] = {}
        for e in entries:
            g = load_file(str(self._file(e["s"], e["n"])))
            if len(entries) == 1:  # one entry: its gradient as it is (one member is plain training, bit for bit)
                combined = g
                break
            w = e["t"] / total if total > 0 else 1.0 / len(entries)
            for n, t in g.items():
                combined[n] = combined[n] + w * t if n in combined else w * t
        for n, p in s.drafter.named_parameters():
            if p.requires_grad:
                p.grad = combined[n].to(p.device, p.dtype) if n in combined else None
        s.backend.apply(1.0, lr_scale=min(sum(e["w"] for e in entries), self.cfg.round_max_lr_scale))
        s.backend.zero_grad()
        self._applied[r] = [e["s"] for e in entries]
        s.step += len(entries)
        s.tokens_total += total
        s._steps_since_merge += len(entries)
        self.next = r + 1
        self.rounds += 1

    def _load_head(self, s: Any) -> None:
        """The session's weights, moments and counters from the lineage head (the member then replays after it)."""
        head, ck = self.lin.pull(s.teacher.embedding(), map_location=str(s.drafter.fc.weight.device))
        copy_trainable(ck.drafter, s.drafter)
        if ck.optimizer_state is not None:
            s.backend.load_state_dict(ck.optimizer_state)
        s.base, s.base_weights, s.step, s.tokens_total = head, snapshot(s.drafter), head.steps, head.tokens
        s._steps_since_merge = 0
        self.next, self._head_round = head.round + 1, head.round
        self._learn(head)

    # -- publishing ------------------------------------------------------------------------------------
    def publish(self, s: Any) -> None:
        """Publish the rounds this member applied as the lineage head, unless a head already holds them; then
        collect the rounds up to the head before it. The session's merged steps: its entries the head holds."""
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
            code, _ = self._publish(keys=self.lin.head_keys(), args=[
                h.number, state.encode(record), 0, 0, 0, 0, fence.token if fence else 0, json.dumps(counts)])
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
        """A head holds the rounds up to h.round: this member's entries there are merged."""
        for r in [r for r in self._applied if r <= h.round]:
            self.merged += self._applied.pop(r).count(self.sid)
        self._head_round = max(self._head_round, h.round)

    def _collect(self, upto: int) -> None:
        """Delete the rounds up to `upto` (files and fields) and gradient files no round names, ORPHAN_AGE_S old."""
        fields = self.redis.hgetall(self.keys[0])
        named, drop = set(), []
        for k, v in fields.items():
            k = k.decode()
            if not k.endswith(":in"):
                continue
            r = int(k.split(":")[0])
            files = {self._file(e["s"], e["n"]).name for e in json.loads(v)}
            if r <= upto:
                drop.append(r)
                for f in files:
                    (self.dir / f).unlink(missing_ok=True)
            else:
                named |= files
        if drop:
            self.redis.hdel(self.keys[0], *[f"{r}:{x}" for r in drop for x in ("in", "dl", "closed")])
        # Members not seen for MEMBER_TTL_S were killed (a stop leaves): they are dropped, with their temp files.
        now, gone = float(self.redis.time()[0]), set()
        for sid, info in self.redis.hgetall(self.keys[1]).items():
            if now - float(json.loads(info)["hb"]) > MEMBER_TTL_S:
                gone.add(sid.decode())
        if gone:
            self.redis.hdel(self.keys[1], *gone)
        cutoff = time.time() - ORPHAN_AGE_S
        for f in self.dir.iterdir():
            try:
                killed_tmp = f.name.startswith(".") and f.name[1:].rsplit("-", 2)[0] in gone
                orphan = f.name not in named and f.stat().st_mtime < cutoff and not f.name.startswith(f"{self.sid}-")
                if killed_tmp or orphan:
                    f.unlink(missing_ok=True)
            except OSError:
                pass

    def _holds_mine(self, r: int) -> bool:
        """Does round `r` hold an entry of this member? (A late entry moves into the open round, `next`.)"""
        raw = self.redis.hget(self.keys[0], f"{r}:in")
        return raw is not None and any(e["s"] == self.sid for e in json.loads(raw))

    def _file(self, sid: str, n: str) -> Path:
        return self.dir / f"{sid}-{n}.safetensors"
