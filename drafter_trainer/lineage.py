"""One drafter lineage that every session on every lent GPU contributes to: elastic, preemptible local SGD.

GPUs are lent and taken back at second granularity, so the set of sessions changes all the time. Under the
asynchronous rule (`trainer.merge_rule = async`, this module's merge) contributors never talk to each other: they
meet only at the lineage head. The synchronous rounds (rounds.py, the default) publish their heads through the same
record and compare-and-swap, and exchange gradients over a process group per round's participant set.

- **head**: the record `lineage:head` (LineageHead: number, path, merged steps) in Redis, naming a
  directory `ROOT/head-<number>-<session>-<seq>/` in the checkpoint format (drafter weights,
  optimizer state, trainer counters). Without Redis the record is `ROOT/HEAD`, guarded by a file lock.
- **pull**: a session starts from the head (weights and optimizer state) and keeps a copy of the
  weights it started from, the *base*.
- **merge** (the outer step): delta = local − base; the new head is head + outer_lr · delta, where head is
  the head *now*. If nobody merged since the base, the new head is the local weights exactly (one
  contributor is plain sequential training, bit for bit); otherwise the delta was delayed (below). The new
  directory is written whole (temp dir, fsync, rename) and then published by one compare-and-swap (Lua)
  that checks, atomically: the head is still the one the delta was applied to (else: re-read, re-apply,
  retry); the session still holds its GPU's lease, or it was revoked and is within its stop (fencing: a
  session whose lease expired unnoticed cannot publish); and this merge's sequence number is new for the
  session (a retry whose answer was lost is not applied twice). The same script adds the merged steps to
  the session's entry of `lineage:contributions`, so the head's step count is always the sum of what
  sessions merged.
  A session killed at any moment has either merged a chunk (all of it) or not (none of it).
- After a merge the session continues from the new head (pull after push), so contributors stay close.

Optimizer state across merges: AdamW's moments stay with the session that computed them; the head
carries the moments of the session that merged last, and a new session starts from those. They are
running estimates of the gradient's mean and scale for the same loss at nearby weights, so they are
valid starting estimates for any contributor (β1 = 0.9 and β2 = 0.95 forget a foreign trajectory in
tens of steps), and starting from them avoids Adam's first steps of full-size sign updates that a reset
would cause at every session start. For the same reason moments a few merges old serve as well, and a
session writes its own only every `trainer.merge_moments_every`-th merge and in the merge its stop makes
(a stop that finds no unmerged step leaves the head's, at most that many merges old); the merges between
link the head's file (`carry_moments`), which takes the moments (two of a merge's three tensor sets) off
most merges' writes, and a merge's write is lent GPU time between training steps.

The outer step is delay-aware and has no state of its own. A merge that finds other merges since its base
applies a *delayed* delta: one computed on weights that miss the others' latest work (asynchronous local
SGD). That delay, not the merge arithmetic (exact), is what two contributors lose against one session at
the same total steps. Two things depend on it, and neither on anything else:
- outer_lr (trainer.merge_outer_lr) scales the delayed delta only; an undelayed merge publishes the local
  weights as they are;
- the session (training_session.py) can run its next chunk with AdamW's β1 = trainer.merge_delayed_beta1 (default
  None: the rule off) after a delayed merge, and with trainer.beta1 after an undelayed one. Contributors taking turns already
  carry each other's recent updates into every step (asynchrony acts as momentum: a delta lands a chunk
  late, on top of the update that followed it), and each session's own moment sees only every n-th chunk
  of the head, so in head time it lags n times as far; adding β1 = 0.9 on top overshoots. Dropping the
  first moment changes nothing else: the second moment (the step's scale) is kept, and the moments a merge
  writes load into the next session with that session's configured β1.
With one contributor no merge is delayed, so both rules are inert and the lineage is plain sequential
training, bit for bit.

The merge is built on Redis + safetensors: members come and go independently, most outer steps have one
contributor, and a merge must survive its contributor's SIGKILL and Redis failover. Why the rounds' exchange uses
torch.distributed directly rather than torchft: docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from tailspec.core import state
from tailspec.core.atomic import file_lock, write_text_atomic
from tailspec.core.state import Event, LineageHead
from tailspec.drafter_trainer.checkpoint import Checkpoint, load_checkpoint, write_checkpoint_dir
from tailspec.drafter_trainer.files import DrafterFileError, read_json_object, read_tensors
from tailspec.drafter_trainer.model import CONFIG_NAME, WEIGHTS_NAME, Eagle3Module

log = logging.getLogger(__name__)

_HEAD_DIR = re.compile(r"^\.?head-(\d{8})-")

# Merge outcomes.
MERGED = 1
MOVED = -1  # another merge landed since the head the delta was applied to: re-apply and retry
FENCED = -2  # the session no longer holds its GPU (lease expired, another token): refused
DUPLICATE = -3  # this (session, seq) was applied already (a retry of a merge whose answer was lost)

# Lua, shared with rounds.py: does fencing token `token` ('0' = unfenced) still hold the GPU? Its lease (KEYS[3])
# carries it, or the scheduler revoked exactly it (KEYS[4]) and the session is within its stop.
FENCE_LUA = """
local function lease_ok(token)
  if token == '0' then return true end
  local v = redis.call('GET', KEYS[3])
  if v then
    local good, lease = pcall(cjson.decode, v)
    if good and tonumber(lease['token']) == tonumber(token) then return true end
  end
  return redis.call('GET', KEYS[4]) == token
end
"""

# KEYS: head, contributions, lease (or ''), revoke flag (or ''). ARGV: expected head number (0 = none), new head
# JSON, session id, seq, steps, fencing token (0 = unfenced). → {code, head number now}
_MERGE = FENCE_LUA + """
local cur = redis.call('GET', KEYS[1])
local num = 0
if cur then num = tonumber(cjson.decode(cur)['number']) end
if num ~= tonumber(ARGV[1]) then return {-1, num} end
if not lease_ok(ARGV[6]) then return {-2, num} end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[3] .. ':seq') or '0')
if tonumber(ARGV[4]) <= last then return {-3, num} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3] .. ':seq', ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[3] .. ':steps', ARGV[5])
return {1, num + 1}
"""


class LineageError(RuntimeError):
    """The lineage cannot be read or merged into (named cause)."""


@dataclass(frozen=True)
class Fence:
    """The GPU lease a session's merges are fenced by."""

    node: str
    gpu: int
    token: int


@dataclass
class MergeResult:
    code: int  # MERGED, FENCED or DUPLICATE
    head: LineageHead | None  # the head after the merge (MERGED), else the head seen
    attempts: int
    steps: int
    weights: dict[str, torch.Tensor] | None = None  # the head's trainable weights (MERGED): continue from these


    @property
    def merged(self) -> bool:
        return self.code == MERGED


SEED = "seed"  # the contributor id of the merge that creates the first head

# Fault-injection seam for tests: called with ("written", path) after a merge's directory is whole and
# before its compare-and-swap; a test process sets it to pause there and be SIGKILLed.
FAULT_HOOK: Callable[[str, Path], None] | None = None


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    """A head directory's weights, checked against the CRC-32 its config records and the shapes its config says
    (a delta added to a tensor of another shape would broadcast into garbage)."""
    meta = read_json_object(d / CONFIG_NAME)
    _, expect = Eagle3Module.from_meta(d / CONFIG_NAME, meta)
    return read_tensors(d / WEIGHTS_NAME, crc=meta.get("weights_crc32"), expect=expect)


def snapshot(drafter: Eagle3Module) -> dict[str, torch.Tensor]:
    """A copy of the trainable weights: the base a later delta is taken against."""
    return {n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}


def copy_trainable(src: Any, drafter: Eagle3Module) -> None:
    """Copy the trainable weights of `src` (a module, or a name → tensor dict) into `drafter`, in place."""
    own = src.state_dict() if hasattr(src, "state_dict") else src
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if p.requires_grad:
                p.copy_(own[n])


class Lineage:
    def __init__(self, root: str | Path, redis: Any = None, cluster: str = "default", fence: Fence | None = None,
                 outer_lr: float = 1.0, max_attempts: int = 50):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.redis = redis
        self.cluster = cluster
        self.fence = fence
        self.outer_lr = outer_lr
        self.max_attempts = max_attempts
        self._merge_script = redis.register_script(_MERGE) if redis is not None else None

    # -- reading -------------------------------------------------------------------------------------
    def head(self) -> LineageHead | None:
        if self.redis is not None:
            return state.get(self.redis, state.key(self.cluster, "lineage_head"), LineageHead)
        f = self.root / "HEAD"
        if not f.is_file():
            with file_lock(self.root / ".lock"):  # a merge writes contributions, then HEAD, under this lock
                return self._head_file()
        return self._head_file()

    def _head_file(self) -> LineageHead | None:
        """The HEAD file's record (the caller holds the lock where HEAD is missing)."""
        f = self.root / "HEAD"
        if not f.is_file():
            if (self.root / "contributions.json").is_file():  # merged into before: HEAD was lost
                raise LineageError(f"lineage head record {f} is missing, but {self.root} has been merged "
                                   "into (contributions.json): refusing to start a new lineage over it")
            return None
        try:
            return LineageHead.model_validate(read_json_object(f))
        except (DrafterFileError, ValidationError) as e:  # refused, never overwritten: a merge needs the real head
            raise LineageError(f"lineage head record {f} is damaged: {str(e)[:300]}") from None

    def contributions(self) -> dict[str, int]:
        """Optimizer steps each session merged (written in the same atomic step as the merge)."""
        if self.redis is not None:
            raw = self.redis.hgetall(state.key(self.cluster, "lineage_contributions"))
            items = {k.decode(): int(v) for k, v in raw.items()}
        else:
            items = self._read_contributions()
        return {k[: -len(":steps")]: int(v) for k, v in items.items() if k.endswith(":steps")}

    def _read_contributions(self) -> dict[str, int]:
        f = self.root / "contributions.json"
        if not f.is_file():
            return {}
        try:
            items = read_json_object(f)
        except DrafterFileError as e:
            raise LineageError(f"lineage contributions {f} are damaged: {e}") from None
        bad = [k for k, v in items.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise LineageError(f"lineage contributions {f} are damaged: {str(bad[:3])[:200]} are not counts")
        return items

    def pull(self, target_embedding: Any = None, map_location: str = "cpu") -> tuple[LineageHead, Checkpoint] | None:
        """The head and its checkpoint; None when the lineage has no head yet. Retries when a merge
        replaced (and collected) the head between reading the record and its files."""
        err: Exception | None = None
        for _ in range(self.max_attempts):
            h = self.head()
            if h is None:
                return None
            try:
                return h, load_checkpoint(h.path, target_embedding, map_location)
            except (OSError, RuntimeError, SafetensorError, ValueError) as e:
                # A merge can collect the head's directory while it is read: open() fails, or safetensors
                # fails mid-read (RuntimeError / SafetensorError, "No such file"). Retry against the new head.
                err = e
                if self.head() == h:  # not a race: the head's directory is really gone or damaged
                    older = self._pull_older(h, e, target_embedding, map_location)
                    if older is not None:
                        return older
                    break
        raise LineageError(f"lineage head {h.path if h else self.root} cannot be loaded, nor any earlier head "
                           f"directory in {self.root}: {str(err)[:500]}")

    def _older_heads(self, number: int) -> list[tuple[int, Path]]:
        """Head directories numbered below `number`, newest first (after a merge, the head it replaced)."""
        found = []
        for p in self.root.iterdir():
            m = _HEAD_DIR.match(p.name)
            if m is not None and not p.name.startswith(".") and int(m.group(1)) < number and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def _pull_older(self, h: LineageHead, err: Exception, target_embedding: Any,
                    map_location: str) -> tuple[LineageHead, Checkpoint] | None:
        """The head's directory is damaged: the newest earlier head directory that loads whole (its own record as
        the base, so the session's next merge applies its delta to that, not to the damaged weights)."""
        for _, d in self._older_heads(h.number):
            try:
                ck = load_checkpoint(d, target_embedding, map_location)
                rec = LineageHead.model_validate(ck.trainer_state.get("lineage"))
            except (OSError, ValueError) as e:
                log.warning("earlier lineage head %s does not load either: %s", d, e)
                continue
            log.warning("lineage head %s is damaged (%s); continuing from the earlier head %s", h.path,
                        str(err)[:300], d)
            return rec, ck
        return None

    def _head_weights(self, h: LineageHead) -> tuple[int, dict[str, torch.Tensor]]:
        """(number, weights) of the head a delta is applied to: the head's, or where its directory is damaged
        (and no merge replaced it meanwhile) the newest earlier head directory's."""
        try:
            return h.number, _read_weights(Path(h.path))
        except (DrafterFileError, OSError) as e:
            if self.head() != h:
                raise  # collected by a newer merge: the caller re-reads
            for number, d in self._older_heads(h.number):
                try:
                    w = _read_weights(d)
                except (DrafterFileError, OSError):
                    continue
                log.warning("lineage head %s is damaged (%s); merging onto the earlier head %s", h.path,
                            str(e)[:300], d)
                return number, w
            raise LineageError(f"lineage head {h.path} is damaged ({str(e)[:300]}) and no earlier head directory "
                               "loads") from None

    # -- writing -------------------------------------------------------------------------------------
    def seed(self, drafter: Eagle3Module, trainer_state: dict | None = None, session_id: str = "seed",
             optimizer_state: dict | None = None) -> LineageHead | None:
        """Make `drafter` the first head if the lineage has none; returns the head now (the winner's, if
        another seeder was first)."""
        if self.head() is not None:
            return self.head()
        base = snapshot(drafter)
        # Contributor "seed", not the session's id: the session's own merges number their seq from 1.
        res = self.merge(None, base, drafter, optimizer_state, dict(trainer_state or {}), SEED, seq=1, steps=0,
                         fenced=False, note_session=session_id)
        return res.head

    def merge(self, base: LineageHead | None, base_weights: dict[str, torch.Tensor], drafter: Eagle3Module,
              optimizer_state: dict | None, trainer_state: dict, session_id: str, seq: int, steps: int,
              tokens: int = 0, policy_version: int = 0, fenced: bool = True,
              note_session: str | None = None, carry_moments: bool = False) -> MergeResult:
        """Merge the work done since `base` (steps optimizer steps) into the head. `seq` numbers the
        session's merges from 1; a (session, seq) is applied at most once. `carry_moments`: the new head links
        the head's optimizer state instead of writing `optimizer_state` (the module doc: Optimizer state);
        where the head's cannot be carried, `optimizer_state` is written."""
        local = {n: p.detach() for n, p in drafter.named_parameters() if p.requires_grad}
        full = {k: v.detach() for k, v in drafter.state_dict().items()}
        for attempt in range(1, self.max_attempts + 1):
            h = self.head()
            if h is not None and base is None:
                # a seeder lost the race to another seeder: the head it would have made exists
                return MergeResult(MOVED, h, attempt, 0)
            number = (h.number if h else 0) + 1
            # Unique per writer: a writer that loses the race deletes its own directory, never another's
            # (concurrent seeders are all contributor "seed", so the seeding session's id is in the name).
            writer = f"{session_id}.{note_session}" if note_session else session_id
            path = self.root / f"head-{number:08d}-{writer}-{seq}"
            try:
                src, head_w = (0, None) if h is None or h.number == base.number else self._head_weights(h)
                if head_w is None or src == base.number:
                    weights = full  # nobody merged since our base: the new head is exactly our weights
                else:
                    weights = dict(full)
                    for n, w in local.items():
                        b = base_weights[n].to(w.device)
                        weights[n] = head_w[n].to(w.device, w.dtype) + self.outer_lr * (w - b)
                record = LineageHead(
                    number=number, path=str(path.resolve()), steps=(h.steps if h else 0) + steps,
                    tokens=(h.tokens if h else 0) + tokens, merges=(h.merges if h else 0) + (1 if steps else 0),
                    policy_version=max(policy_version, h.policy_version if h else 0),
                    session_id=note_session or session_id,
                    updated_at=time.time())
                intact = h is not None and (head_w is None or src == h.number)  # not an earlier head's stand-in
                self._write_head(path, drafter, optimizer_state, weights, Path(h.path) if carry_moments and intact else None,
                                 {"step": record.steps, **trainer_state, "lineage": record.model_dump(mode="json")})
            except Exception as e:  # OSError, or safetensors' own error for a vanished temp dir
                # Another merge landed and collected the head we read (or our temp dir, now stale): re-read.
                if self.head() != h:
                    shutil.rmtree(path, ignore_errors=True)
                    continue
                raise LineageError(f"could not write lineage head {path}: {e}") from e
            if FAULT_HOOK is not None:
                FAULT_HOOK("written", path)
            code = self._cas(h.number if h else 0, record, session_id, seq, steps, fenced)
            if code == MERGED:
                self.after_merge(record, steps, Path(h.path) if h is not None else None)
                return MergeResult(MERGED, record, attempt, steps, {n: weights[n] for n in local})
            shutil.rmtree(path, ignore_errors=True)
            if code != MOVED:
                return MergeResult(code, h, attempt, steps)
        raise LineageError(f"merge of {session_id}#{seq} lost the compare-and-swap {self.max_attempts} times in a row")

    @staticmethod
    def _write_head(path: Path, drafter: Eagle3Module, optimizer_state: dict | None, weights: dict[str, torch.Tensor],
                    carry_from: Path | None, trainer_state: dict) -> None:
        if carry_from is not None:
            try:
                write_checkpoint_dir(path, drafter, None, trainer_state, tensors=weights, optimizer_from=carry_from)
                return
            except (DrafterFileError, OSError) as e:  # collected meanwhile, damaged, or another backend's
                log.debug("head %s: optimizer state not carried from %s (%s); writing this session's", path,
                          carry_from, str(e)[:200])
        write_checkpoint_dir(path, drafter, optimizer_state, trainer_state, tensors=weights)

    def fence_keys(self) -> list[str]:
        """KEYS[3] and KEYS[4] of the scripts that check FENCE_LUA: the fence's lease and revoke flag ('' unfenced)."""
        f, c = self.fence, self.cluster
        return [state.key(c, "lease", node=f.node, gpu=f.gpu), state.key(c, "revoke", node=f.node, gpu=f.gpu)] \
            if f else ["", ""]

    def head_keys(self, fenced: bool = True) -> list[str]:
        """KEYS of a head's compare-and-swap: the head, the contributions, then the fence's (fence_keys)."""
        return [state.key(self.cluster, "lineage_head"), state.key(self.cluster, "lineage_contributions"),
                *(self.fence_keys() if fenced else ["", ""])]

    def _cas(self, expected: int, record: LineageHead, session_id: str, seq: int, steps: int, fenced: bool) -> int:
        if self.redis is not None:
            f = self.fence if fenced else None
            keys = self.head_keys(fenced)
            code, _ = self._merge_script(keys=keys, args=[expected, state.encode(record), session_id, seq, steps,
                                                          f.token if f else 0])
            return int(code)
        with file_lock(self.root / ".lock"):
            h = self._head_file()
            if (h.number if h else 0) != expected:
                return MOVED
            cf = self.root / "contributions.json"
            contrib = self._read_contributions()
            if seq <= int(contrib.get(f"{session_id}:seq", 0)):
                return DUPLICATE
            contrib[f"{session_id}:seq"] = seq
            contrib[f"{session_id}:steps"] = int(contrib.get(f"{session_id}:steps", 0)) + steps
            # contributions first: a crash between the two writes leaves them ahead of HEAD, which the
            # next merge's read-modify-write does not undo; HEAD is the commit point.
            write_text_atomic(cf, json.dumps(contrib))
            write_text_atomic(self.root / "HEAD", record.model_dump_json())
            return MERGED

    def after_merge(self, record: LineageHead, steps: int, replaced: Path | None) -> None:
        """A new head is in: its event (when it holds new steps), and the directories it replaced collected."""
        if self.redis is not None and steps:
            try:
                state.append(self.redis, state.key(self.cluster, "events"), Event(kind="lineage_merged", detail={
                    "head": record.number, "steps": record.steps, "session_id": record.session_id, "merged": steps,
                    **({"round": record.round} if record.round else {})}))
            except Exception as e:  # the event log is a view; the merge itself is done
                log.debug("lineage event not written: %s", e)
        self.collect(record.number, keep=replaced)

    def collect(self, current: int | None = None, keep: Path | None = None) -> int:
        """Delete head directories other than the head's and `keep` (a merge keeps the head it replaced: where
        the new head's directory is found damaged, sessions continue from that one), numbered up to the
        head's, and temp directories of killed writers numbered so. A writer of such a number expected an
        older head, so its compare-and-swap fails whatever happens to its files (and it re-reads); a merge in
        flight towards current + 1 is never touched. Returns how many were removed."""
        h = self.head()
        if h is None:
            return 0
        current = h.number if current is None else min(current, h.number)
        removed = 0
        for p in self.root.iterdir():
            m = _HEAD_DIR.match(p.name)
            if m is None or p.resolve() == Path(h.path).resolve() or (keep is not None and p.resolve() == keep.resolve()):
                continue
            if int(m.group(1)) <= current:
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
        return removed

    def temp_dirs(self) -> list[Path]:
        """Hidden temporary siblings left by killed writers (collected by later merges)."""
        return [p for p in self.root.iterdir() if p.name.startswith(".head-")]
