"""Promotion, a session's side: which lineage head to propose as a candidate version, and the cluster-wide
protocol around its validation. The version store (versions.py) validates a candidate against the current
version by the paired test (validation.py) and promotes it by compare-and-swap; this module decides what it is
handed and keeps the sessions from working against each other:

- **The proposed-head marker** (`drafter:proposed` in Redis, or the file PROPOSED_HEAD under the checkpoint
  directory without one): the number and optimizer steps of the head last proposed, so no head is validated
  twice and a new one is proposed only once it holds `trainer.propose_min_steps` steps more (`worth_proposing`).
- **The validation claim** (`drafter:validating`, `claim_validation` / `release_validation`): one validation runs
  cluster-wide; the other sessions train meanwhile. A killed holder's claim expires by itself.
- **Resumable validation**: a validation cut short by its session's stop keeps its scores in Redis
  (`drafter:validation`) and its head's weights in the store's pending copy; the next session to propose
  finishes it while its baseline is still the current version, instead of starting over on its own head.

- **What a candidate is scored under**: the strategies the rollouts run, when the roof hands a `scoring` source
  (tailspec/mix_score.py reads the mix the workers publish); a chain of `trainer.validation_k` without one or
  before any mix is published. A resumed validation keeps the mix it began under, so its pairs stay comparable.

Validation is itself interruptible by the session's stop check, so the stop deadline holds throughout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailspec.core import state
from tailspec.core.atomic import write_text_atomic
from tailspec.core.config import TrainerConfig
from tailspec.core.state import DrafterVersion, Sample
from tailspec.drafter_trainer.loss import StopRequested
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import Scoring
from tailspec.drafter_trainer.versions import VersionStore

log = logging.getLogger(__name__)
PROPOSED = "PROPOSED_HEAD"
# A claim outlives any validation many times over, and a killed holder's claim blocks the others' validations
# for at most this long.
VALIDATION_CLAIM_S = 30.0
# Delete the claim only if this session still holds it (an expired claim may be another session's by now).
_RELEASE_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, -string.len(ARGV[1]) - 1) == ' ' .. ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# The roof's scoring source: mix → its Scoring; None asks for the rollouts' latest mix (a None back: a chain of k).
ScoringSource = Callable[[dict[str, float] | None], Scoring | None]


class Promotion:
    """What one contributor to the lineage proposes to the version store, and when (the module doc). Without
    Redis (one process, `tailspec train`) there is nothing to race with: no claim, and the marker is a file.
    `scoring`: what candidates are scored under (ScoringSource; None: a chain of trainer.validation_k)."""

    def __init__(self, tc: TrainerConfig, store: VersionStore, redis: Any, cluster: str, root: str | Path,
                 scoring: ScoringSource | None = None):
        self.tc, self.store, self.redis, self.cluster = tc, store, redis, cluster
        self.root = Path(root)
        self.scoring = scoring
        self.validate_s = 0.0  # time spent validating candidates (whole or cut short by a stop)

    def proposed_head(self) -> tuple[int, int]:
        """(number, optimizer steps) of the lineage head last proposed; (0, 0) when none."""
        try:
            raw = self.redis.get(state.key(self.cluster, "drafter_proposed")) if self.redis is not None \
                else (self.root / PROPOSED).read_text()
            if raw is None:
                return 0, 0
            parts = (raw.decode() if isinstance(raw, bytes) else raw).split()
            return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except (OSError, ValueError):
            return 0, 0

    def _mark_proposed(self, number: int, steps: int) -> None:
        value = f"{number} {steps}"
        if self.redis is not None:
            self.redis.set(state.key(self.cluster, "drafter_proposed"), value)
        else:
            write_text_atomic(self.root / PROPOSED, value)

    def propose(self, session: TrainingSession, teacher: Teacher, holdout: list[Sample]) -> DrafterVersion | None:
        """Validate a lineage head as a candidate: the one another session began validating and was stopped in
        (its scores kept, its weights in the store's pending copy), else `session`'s own head (its drafter
        right after its merge) unless that head was proposed already or holds too little training since.
        `holdout`: the buffer's held-out samples (the store picks `trainer.validation_samples` of them)."""
        tc = self.tc
        if session.base is None or not holdout:
            return None
        cand = self._resumable(teacher) or self._own_head(session)
        if cand is None:
            return None
        number, steps, drafter, kept = cand
        # Against a current version a candidate needs promotion_min_pairs scored samples to pass (the first version
        # is taken without a test): with fewer held out it could only be recorded as "too few"; train instead.
        if drafter is None and len(holdout) < tc.promotion_min_pairs and self.store.current() is not None:
            return None
        if not self._claim(number, session.session_id):  # another session is validating: train instead
            return None
        t0 = time.monotonic()
        try:
            if drafter is None:  # the session's own head: kept for whoever finishes the validation
                self.store.save_pending(number, steps, session.drafter)
                drafter = session.drafter
                scoring = self.scoring(None) if self.scoring is not None else None
            else:  # resumed: under the mix it began with (a chain of k when it kept none)
                scoring = self.scoring(kept) if self.scoring is not None and kept else None
            info = self.store.propose(drafter, teacher, holdout, tc.validation_k, session_id=session.session_id,
                                      note=f"lineage head {number} ({steps} steps)", check=session.check,
                                      level=tc.promotion_level, min_pairs=tc.promotion_min_pairs,
                                      lineage_head=number, lineage_steps=steps,
                                      max_samples=tc.validation_samples, scoring=scoring)
        except StopRequested:
            return None
        except ValueError as e:  # e.g. no held-out sample long enough yet
            log.info("candidate not validated: %s", e)
            return None
        else:  # marked before the claim is released, so no session validates this head again
            self._mark_proposed(number, steps)
            self.store.drop_pending()
        finally:
            self.validate_s += time.monotonic() - t0
            self._release(session.session_id)
        return info

    def _own_head(self, session: TrainingSession) -> tuple[int, int, None, None] | None:
        head = session.base
        if not worth_proposing(head.number, head.steps, self.proposed_head(), self.tc.propose_min_steps):
            return None
        if session.fenced_out or session.unmerged_steps:  # the drafter is not the head's weights
            return None
        return head.number, head.steps, None, None

    def _resumable(self, teacher: Teacher) -> tuple[int, int, Any, dict[str, float] | None] | None:
        """A validation cut short by its session's stop, to finish here: in lends shorter than a validation,
        starting over on each session's newer head would never finish one. Only while its baseline is still
        the current version, and when it scored at least one pair. → (head, steps, drafter, the mix it scores
        under: None for a chain of k)."""
        if self._claimed():  # its holder is finishing it: not worth loading the copy
            return None
        got = self.store.validation_in_progress()
        cur = self.store.current()
        if got is None or cur is None:
            return None
        head, baseline, k, pairs = got
        if baseline != cur.version or k != self.tc.validation_k or pairs < 1 or head <= self.proposed_head()[0]:
            return None
        pending = self.store.load_pending(head, teacher.embedding(), map_location=str(teacher.device))
        if pending is None:
            return None
        drafter, steps = pending
        return head, steps, drafter, self.store.validation_mix()

    def _claimed(self) -> bool:
        try:
            return self.redis is not None and bool(self.redis.exists(state.key(self.cluster, "drafter_validating")))
        except Exception as e:  # noqa: BLE001 — the claim itself decides; this only saves a load
            log.info("validation claim unreadable: %s", e)
            return False

    def _claim(self, number: int, session_id: str) -> bool:
        if self.redis is None:  # one process (`tailspec train`): nothing to race with
            return True
        return claim_validation(self.redis, self.cluster, number, session_id)

    def _release(self, session_id: str) -> None:
        if self.redis is not None:
            release_validation(self.redis, self.cluster, session_id)


def worth_proposing(number: int, steps: int, proposed: tuple[int, int], min_steps: int) -> bool:
    """Is lineage head `number` (with `steps` optimizer steps) a candidate, given the head last proposed
    (`proposed`: number, steps)? Not when it was proposed already, holds no training, or holds fewer than
    `min_steps` steps more than the last one proposed (trainer.propose_min_steps)."""
    last_number, last_steps = proposed
    return steps > 0 and number > last_number and steps - last_steps >= min_steps


def claim_validation(redis: Any, cluster: str, number: int, session_id: str) -> bool:
    """Claim the one validation running cluster-wide (`drafter:validating`, SET NX PX) for lineage head `number`.
    Without it, concurrent sessions that find the same unproposed head each score it, on lends mostly shorter
    than one validation; with it the others train meanwhile. A killed holder's claim expires by itself
    (VALIDATION_CLAIM_S); a validation cut short releases it and the next session resumes the scores kept in
    `drafter:validation`. On a Redis error: True (a duplicate validation costs time, not results)."""
    try:
        return bool(redis.set(state.key(cluster, "drafter_validating"), f"{number} {session_id}", nx=True,
                              px=int(VALIDATION_CLAIM_S * 1000)))
    except Exception as e:  # noqa: BLE001 — see the docstring
        log.warning("validation claim failed (%s); validating anyway", e)
        return True


def release_validation(redis: Any, cluster: str, session_id: str) -> bool:
    """Release this session's claim (only its own: an expired claim may be another session's by now)."""
    try:
        return bool(redis.eval(_RELEASE_CLAIM, 1, state.key(cluster, "drafter_validating"), session_id))
    except Exception as e:  # noqa: BLE001 — the claim expires by itself
        log.warning("validation claim not released (%s); it expires in %.0f s", e, VALIDATION_CLAIM_S)
        return False
