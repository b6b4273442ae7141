"""Drafter versions: validate a session's candidate, promote it only if it is better than the current one.

Validation = expected acceptance length (at chain length k, or under the rollouts' strategy mix when the proposer
hands a `Scoring`: validation.py) on held-out recent samples, measured for the candidate and the current version
on the SAME samples with the CURRENT teacher in one pass (the policy moves, so the current version's old score is
stale). The version records the mix it was scored under (`scored_under`) and the candidate's mean rate per
(depth, sibling rank) (`rank_rates`), which the rollouts' health guard judges the live gain by.

Promotion is a paired test. The unit is a held-out sample: its mean expected acceptance length over its
anchors, candidate minus current (anchors of one sample are correlated; samples are not). The candidate
is promoted when at least `min_pairs` samples were scored and the one-sided lower confidence bound of the
mean gain (Student t: mean − t_{1−α, n−1} · sd / √n) is above zero. The test is made twice, at α = level / 2
each: once when `min_pairs` samples are scored (a clear gain is promoted there, and the rest of the held-out
samples are not scored) and once over all of them. An identical candidate has gain 0 on every sample, so its
bound is 0 and it is never promoted; a worse or equal-in-expectation one is promoted with probability at most
`level` over both tests (Bonferroni).

`drafter:current` is written by a compare-and-swap (Lua) against the version the candidate was scored
against, so two proposers validated against the same version cannot both win; the loser is recorded as
not promoted with the reason.

Every candidate gets a number (Redis INCR `drafter:counter`, or a local counter without Redis), a
directory `ROOT/v<N>` in the drafter format plus `version.json`, an entry in the history
(`drafter:versions`, RPUSH) and, when promoted, `drafter:current`. The same records are mirrored into
`ROOT/history.jsonl` and `ROOT/CURRENT` so `tailspec export --version N` works without a cluster.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import ValidationError
from tailspec.core import state
from tailspec.core.atomic import file_lock, write_text_atomic
from tailspec.core.state import DrafterHealth, DrafterVersion, Sample
from tailspec.drafter_trainer.files import DrafterFileError, read_json_object
from tailspec.drafter_trainer.model import CONFIG_NAME, Eagle3Module
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.validation import (
    CHECKED_BATCH,
    Decision,
    Score,
    Scoring,
    decide,
    pick_holdout,
    validate,
    validate_paired,
)

log = logging.getLogger(__name__)

# A paired validation tests twice: once when `min_pairs` held-out samples are scored, and at its end. Each test
# runs at level / LOOKS, so a candidate no better than the current version is promoted with probability at most
# `level` over both (Bonferroni: valid whatever the two tests' correlation).
LOOKS = 2
# Fields of `drafter:validation` that are not a held-out sample's scores (besides "id").
_NOT_PAIRS = ("look", "mix")


# KEYS: drafter:current. ARGV: expected version (-1 = none), new record. 1 = swapped.
_PROMOTE = """
local v = redis.call('GET', KEYS[1])
local cur = -1
if v then cur = tonumber(cjson.decode(v)['version']) end
if cur ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


def _read_version(f: Path) -> DrafterVersion:
    try:
        return DrafterVersion.model_validate(read_json_object(f))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise DrafterFileError(f"{f}: bad version record at {where}: {first['msg']}") from None


def parse_validation_id(identity: str) -> tuple[int, int, int]:
    """'HEAD:BASELINE:K', the id of the validation whose scores `drafter:validation` keeps → its three numbers."""
    head, baseline, k = (int(x) for x in identity.split(":"))
    return head, baseline, k


class VersionStore:
    def __init__(self, root: str | Path, redis: Any = None, cluster: str = "default"):
        self.root = Path(root)
        self.redis = redis
        self.cluster = cluster
        self.root.mkdir(parents=True, exist_ok=True)

    def _key(self, name: str) -> str:
        return state.key(self.cluster, name)

    def _next_number(self) -> int:
        if self.redis is not None:
            return int(self.redis.incr(self._key("drafter_counter")))
        counter = self.root / "COUNTER"
        with file_lock(self.root / ".counter.lock"):  # two proposers must not read the same number
            n = int(counter.read_text()) + 1 if counter.is_file() else 1
            write_text_atomic(counter, str(n))
        return n

    def path(self, version: int) -> Path:
        return self.root / f"v{version:05d}"

    # -- pending candidates: a validation that outlasts its lend is finished by later sessions -----------------
    def pending_path(self, head: int) -> Path:
        return self.root / "pending" / f"head-{head:08d}"

    def save_pending(self, head: int, steps: int, drafter: Eagle3Module) -> Path:
        """A copy of lineage head `head` as it is validated: the lineage keeps only its newest heads, and the
        session that finishes this validation may start when the head has moved on."""
        device = next(drafter.parameters()).device
        try:  # as propose saves a version: to host memory for the write, back after it
            return drafter.to("cpu").save(self.pending_path(head), extra={"lineage_head": head, "lineage_steps": steps})
        finally:
            drafter.to(device)

    def load_pending(self, head: int, target_embedding: Any = None, map_location: str = "cpu"
                     ) -> tuple[Eagle3Module, int] | None:
        """(drafter, lineage steps) of pending head `head`; None when it is gone or does not load."""
        path = self.pending_path(head)
        try:
            steps = int(read_json_object(path / CONFIG_NAME)["extra"]["lineage_steps"])
            return Eagle3Module.load(path, target_embedding, map_location=map_location), steps
        except (OSError, DrafterFileError, KeyError, TypeError, ValueError) as e:
            log.info("pending candidate head %d not resumed: %s", head, e)
            return None

    def drop_pending(self, keep: int | None = None) -> None:
        """Delete pending copies other than head `keep`'s."""
        root = self.root / "pending"
        for p in root.iterdir() if root.is_dir() else ():
            if keep is None or p.name != self.pending_path(keep).name:
                shutil.rmtree(p, ignore_errors=True)

    def validation_in_progress(self) -> tuple[int, int, int, int] | None:
        """(lineage head, baseline version, k, pairs scored) of the validation whose scores `drafter:validation`
        keeps; None without Redis or when none is kept."""
        if self.redis is None:
            return None
        try:
            ident = self.redis.hget(self._key("drafter_validation"), "id")
            if ident is None:
                return None
            head, cur, k = parse_validation_id(ident.decode() if isinstance(ident, bytes) else ident)
            pipe = self.redis.pipeline()
            for f in _NOT_PAIRS:
                pipe.hexists(self._key("drafter_validation"), f)
            pipe.hlen(self._key("drafter_validation"))
            *marks, fields = pipe.execute()
            return head, cur, k, int(fields) - sum(map(bool, marks))
        except Exception as e:  # noqa: BLE001 — resuming is an optimisation: start a new validation instead
            log.info("validation progress unreadable: %s", e)
            return None

    def validation_mix(self) -> dict[str, float] | None:
        """The strategy mix the validation in progress scores under (None: a chain of its k, or none kept): a
        session finishing it scores under the same mix, so its pairs stay one comparison."""
        if self.redis is None:
            return None
        try:
            raw = self.redis.hget(self._key("drafter_validation"), "mix")
            return None if raw is None else {str(a): float(b) for a, b in json.loads(raw).items()}
        except Exception as e:  # noqa: BLE001 — unreadable: the resumed validation starts over under its own mix
            log.info("validation mix unreadable: %s", e)
            return None

    def current(self) -> DrafterVersion | None:
        if self.redis is not None:
            cur = state.get(self.redis, self._key("drafter_current"), DrafterVersion)
            if cur is not None:
                return cur
        f = self.root / "CURRENT"
        if not f.is_file():
            return None
        info = _read_version(f)
        # CURRENT is a copy of a version's record: one that names another version than the record in the
        # directory it points to is damaged, however well-formed (a flipped digit in `version`). The directory's
        # name (v00002) says which of the two is: a record in the directory that disagrees with its own name is
        # that version's problem, judged when it is loaded, as is a record there that does not parse.
        try:
            own = _read_version(Path(info.path) / "version.json")
        except (DrafterFileError, OSError):
            return info
        if own.version != info.version and Path(info.path).name != self.path(info.version).name:
            raise DrafterFileError(f"{f}: records version {info.version}, but {info.path} is version {own.version}")
        return info

    def history(self) -> list[DrafterVersion]:
        """Every recorded version, oldest first; a damaged entry is skipped (logged, naming it): the history
        is a log of decisions, and one bad line must not hide the others."""
        out = []
        if self.redis is not None:
            for i, r in enumerate(self.redis.lrange(self._key("drafter_versions"), 0, -1)):
                try:
                    out.append(state.decode(DrafterVersion, r, where=f"drafter:versions[{i}]"))
                except ValueError as e:
                    log.warning("skipped a damaged version record: %s", e)
            return out
        f = self.root / "history.jsonl"
        if not f.is_file():
            return []
        for i, line in enumerate(f.read_bytes().decode("utf-8", "replace").splitlines(), 1):
            if line.strip():
                try:
                    out.append(DrafterVersion.model_validate_json(line))
                except ValueError as e:
                    log.warning("%s line %d: skipped a damaged version record: %s", f, i, str(e)[:200])
        return out

    def get(self, version: int) -> DrafterVersion:
        f = self.path(version) / "version.json"
        if not f.is_file():
            known = sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*") if (p / "version.json").is_file())
            raise FileNotFoundError(f"drafter version {version} not found under {self.root}; known: {known}")
        info = _read_version(f)
        if info.version != version:
            raise DrafterFileError(f"{f}: records version {info.version}, expected {version}")
        if Path(info.path).name != f.parent.name:  # a damaged `path` would send a load elsewhere, naming only that
            raise DrafterFileError(f"{f}: records path {info.path}, not its own directory {f.parent}")
        return info

    def load(self, version: int | None = None, target_embedding: Any = None) -> tuple[Eagle3Module, DrafterVersion]:
        """A version's drafter (the current one by default). A damaged version is refused (DrafterFileError
        naming the file); for the current one the newest earlier promoted version that loads is used instead,
        with a warning, so rollouts keep a good drafter."""
        info = self.current() if version is None else self.get(version)
        if info is None:
            raise FileNotFoundError(f"no promoted drafter version under {self.root}")
        try:
            return Eagle3Module.load(info.path, target_embedding), info
        except (DrafterFileError, FileNotFoundError) as e:
            if version is not None:
                raise
            for older in reversed(self.history()):
                if not older.promoted or older.version >= info.version:
                    continue
                try:
                    drafter = Eagle3Module.load(older.path, target_embedding)
                except (DrafterFileError, FileNotFoundError):
                    continue
                log.warning("current drafter version %d does not load (%s); using the earlier promoted version %d",
                            info.version, str(e)[:300], older.version)
                return drafter, older
            raise

    def _progress(self, identity: str | None, mix: dict[str, float] | None = None
                  ) -> tuple[dict[str, Score], Callable[[dict[str, Score]], None] | None]:
        """The paired scores already computed for validation `identity` (lineage head, baseline version, k) under
        `mix` (None: a chain of k; kept beside them, since scores under another mix do not pair) and a callback
        that adds a batch's: a validation longer than a lend is finished by the next sessions (on any
        GPU) instead of starting over in each. Each pair was scored under one teacher, the policy of its session,
        so a pair stays a fair comparison of the two drafters when the policy has moved on since, and the pairs
        of samples that have left the session's held-out set since (their policy version dropped from the
        buffer) still count: with one validation at a time and lends of a second in short tails, a validation
        that counted only the current held-out set lost half its pairs each RL step and never finished."""
        if self.redis is None or identity is None:
            return {}, None
        key = self._key("drafter_validation")
        raw = self.redis.hgetall(key)
        fields = {(a.decode() if isinstance(a, bytes) else a): (b.decode() if isinstance(b, bytes) else b)
                  for a, b in raw.items()}
        done: dict[str, Score] = {}
        kept = json.dumps(mix, sort_keys=True) if mix is not None else None
        if fields.get("id") == identity and fields.get("mix") == kept:
            for f, v in fields.items():
                try:
                    c, b, n = v.split()
                    done[f] = (float(c), float(b), int(n))
                except ValueError:
                    continue  # the "id" or "mix" field, or a damaged entry: scored again
        else:
            pipe = self.redis.pipeline()
            pipe.delete(key)
            pipe.hset(key, mapping={"id": identity, **({"mix": kept} if kept is not None else {})})
            pipe.execute()
            self.drop_pending(keep=parse_validation_id(identity)[0])

        def on_batch(new: dict[str, Score]) -> None:
            try:
                self.redis.hset(key, mapping={f: f"{c!r} {b!r} {n}" for f, (c, b, n) in new.items()})
            except Exception as e:  # progress is an optimisation: a lost batch is scored again
                log.warning("validation progress not saved: %s", e)

        return done, on_batch

    def _interim_look(self, identity: str | None, level: float, min_pairs: int) -> Callable[[list[float]], bool] | None:
        """The paired test at `min_pairs` pairs, at level / LOOKS; None when this validation looked already (a
        session before this one crossed `min_pairs`: its mark is in `drafter:validation`)."""
        key = self._key("drafter_validation")
        if self.redis is not None and identity is not None and self.redis.hget(key, "look") is not None:
            return None

        def look(gains: list[float]) -> bool:
            if self.redis is not None and identity is not None:
                self.redis.hset(key, "look", len(gains))  # before deciding: a stop right after must not look again
            return decide(gains, level / LOOKS, min_pairs).promote

        return look

    def propose(self, candidate: Eagle3Module, teacher: Teacher, holdout: Sequence[Sample], k: int = 4,
                session_id: str | None = None, note: str | None = None,
                check: Callable[[], None] | None = None, level: float = 0.05, min_pairs: int = 16,
                lineage_head: int | None = None, lineage_steps: int | None = None,
                max_samples: int | None = None, scoring: Scoring | None = None) -> DrafterVersion:
        """Score the candidate and the current version on `holdout` (paired), save and record the candidate,
        and promote it if the paired test says it is better — by compare-and-swap against the version it
        was scored against. Also records the current version's acceptance now (staleness). `scoring`: the
        rollouts' strategy mix to score under (None: a chain of k)."""
        how = {} if scoring is None else {"score": scoring.score, "depth": scoring.depth, "ranks": scoring.ranks}
        cur_info = self.current()
        cur, note = self._baseline(cur_info, teacher, note)
        if cur is not None:
            identity = f"{lineage_head}:{cur_info.version}:{k}" if lineage_head is not None else None
            done, on_batch = self._progress(identity, scoring.mix if scoring is not None else None)
            holdout = pick_holdout(holdout, done, max_samples)
            look = self._interim_look(identity, level, min_pairs)
            paired = validate_paired(candidate, cur, teacher, holdout, k, check=check, done=done, on_batch=on_batch,
                                     batch_size=CHECKED_BATCH if check is not None else 32, look_at=min_pairs, look=look,
                                     **how)
            cand_len, baseline, table = paired.mean("candidate"), paired.mean("current"), paired.rank_rates
            d = decide(paired.gains, level / LOOKS, min_pairs)
            if paired.stopped_early:
                d.reason += f" at the interim look ({d.pairs} of {len(holdout)} held-out samples)"
            self.record_health(DrafterHealth(
                drafter_version=cur_info.version, policy_version=teacher.policy_version, acceptance_length=baseline,
                at_promotion=cur_info.acceptance_length, samples=len(paired.current), source="validation"))
        else:
            holdout = pick_holdout(holdout, {}, max_samples)
            v = validate(candidate, teacher, holdout, k, check=check,
                         batch_size=CHECKED_BATCH if check is not None else 32, **how)
            cand_len, baseline, table = v.acceptance_length, None, v.rank_rates
            d = Decision(True, v.anchors, 0.0, 0.0, "no readable current version")
        number = self._next_number()
        info = DrafterVersion(
            version=number, path=str(self.path(number).resolve()), policy_version=teacher.policy_version,
            acceptance_length=cand_len, validation_k=k, baseline_acceptance_length=baseline, promoted=False,
            created_at=time.time(), session_id=session_id, note=note,
            baseline_version=cur_info.version if cur is not None else None, pairs=d.pairs,
            gain_mean=d.gain_mean, gain_lcb=d.gain_lcb if math.isfinite(d.gain_lcb) else None, decision=d.reason,
            lineage_head=lineage_head, lineage_steps=lineage_steps,
            scored_under=dict(scoring.mix) if scoring is not None else None, rank_rates=table,
        )
        cpu = candidate.to("cpu") if teacher.device.type != "cpu" else candidate
        cpu.save(self.path(number), extra={"version": info.model_dump(mode="json")})
        if teacher.device.type != "cpu":
            candidate.to(teacher.device)
        if d.promote:
            promoted = info.model_copy(update={"promoted": True})
            if self._swap_current(cur_info.version if cur_info is not None else -1, promoted):
                info = promoted
            else:
                info = info.model_copy(update={"decision": f"{d.reason}; lost the race: current is no longer "
                                               f"v{cur_info.version if cur_info else 'none'}"})
        write_text_atomic(self.path(number) / "version.json", info.model_dump_json())
        self._record(info)
        return info

    def _baseline(self, cur_info: DrafterVersion | None, teacher: Teacher, note: str | None
                  ) -> tuple[Eagle3Module | None, str | None]:
        """The current version's drafter on the teacher's device to score the candidate against (None: there is
        none, or it is damaged and the candidate may replace it, which `note` then says)."""
        if cur_info is None:
            return None, note
        try:
            cur, _ = self.load(cur_info.version, teacher.embedding())
            return cur.to(teacher.device), note
        except (FileNotFoundError, ValueError) as e:
            return None, f"{note or ''} current version {cur_info.version} unreadable: {e}".strip()

    def _swap_current(self, expected: int, info: DrafterVersion) -> bool:
        """drafter:current := info if it is still `expected` (-1 = none); the mirror file follows."""
        if self.redis is not None:
            ok = bool(self.redis.register_script(_PROMOTE)(keys=[self._key("drafter_current")],
                                                           args=[expected, state.encode(info)]))
            if ok:
                write_text_atomic(self.root / "CURRENT", info.model_dump_json())
            return ok
        with file_lock(self.root / ".lock"):
            cur = self.current()
            if (cur.version if cur is not None else -1) != expected:
                return False
            write_text_atomic(self.root / "CURRENT", info.model_dump_json())
            return True

    def record_health(self, h: DrafterHealth) -> None:
        """Staleness record (drafter_health stream); best-effort, mirrored to ROOT/health.jsonl."""
        try:
            with open(self.root / "health.jsonl", "a") as f:
                f.write(h.model_dump_json() + "\n")
            if self.redis is not None:
                state.append(self.redis, self._key("drafter_health"), h, maxlen=10_000)
        except Exception as e:  # a view of the drafter, never a reason to fail a validation
            log.debug("drafter health not recorded: %s", e)

    def _record(self, info: DrafterVersion) -> None:
        with open(self.root / "history.jsonl", "a") as f:
            f.write(info.model_dump_json() + "\n")
        if self.redis is not None:
            self.redis.rpush(self._key("drafter_versions"), state.encode(info))
            kind = "version_promoted" if info.promoted else "version_rejected"
            state.append(self.redis, self._key("events"), state.Event(kind=kind, detail={
                "version": info.version, "acceptance_length": info.acceptance_length,
                "baseline_acceptance_length": info.baseline_acceptance_length, "gain_lcb": info.gain_lcb,
                "pairs": info.pairs, "decision": info.decision}))

    def seed(self, info: DrafterVersion) -> None:
        """Record a version made outside propose (the run's first drafter) and make it current."""
        if not self._swap_current(-1 if self.current() is None else self.current().version, info):
            raise RuntimeError("drafter:current changed while seeding the version store")
        self._record(info)
