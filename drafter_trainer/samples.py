"""Rollout samples for drafter training: validation, a bounded versioned replay buffer, the Redis reader.

Only ids, rewards and versions travel (docs/architecture.md), and where the rollout shipped its targets, the
path of their file (rollout_targets.py); otherwise the teacher recomputes them. A bad
sample is dropped and counted by reason (locally in `SampleReader.dropped` and in the cluster's `dropped` hash
as `trainer_<reason>`, which the dashboards show), never raised: one bad writer must not stop a session.
Reasons: `malformed` (no `data` field, not JSON, not a Sample), `oversized` (more ids than max_seq_len, or an
entry too large to be one: dropped before it is parsed), `empty_prompt`, `empty_response`,
`nonfinite_reward`, `out_of_vocab`, `stale_policy_version`.

Fresh samples first: a new reader starts at the newest end of the stream (XREVRANGE back to the oldest
policy version the buffer keeps) and then follows new entries forward, so a session never spends its
lease on samples of a policy that no longer exists. Within the buffer a sample n policy versions older
than the newest is drawn with weight `stale_version_weight`^n (0: the newest version only). A teacher's
targets are the current policy's, shipped targets the generating version's (rollout_targets.py).

Held-out split: a sample goes to the validation set when a hash of its ids falls in the held-out
fraction, so the split is stable whatever the arrival order and a sample is never in both sets.
"""

from __future__ import annotations

import logging
import math
import random
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from tailspec.core import state
from tailspec.core.state import Sample
from tailspec.drafter_trainer.weights import Mode, reward_weights

log = logging.getLogger(__name__)

DROP_PREFIX = "trainer_"


def validate_sample(s: Sample, vocab_size: int, max_seq_len: int) -> str | None:
    """None when the sample is usable, else the reason it is not (a short snake_case word)."""
    if not s.prompt_ids:
        return "empty_prompt"
    if not s.response_ids:
        return "empty_response"
    if len(s.prompt_ids) + len(s.response_ids) > max_seq_len:
        return "oversized"
    if s.reward is None or not math.isfinite(s.reward):
        return "nonfinite_reward"
    lo = min(min(s.prompt_ids), min(s.response_ids))
    hi = max(max(s.prompt_ids), max(s.response_ids))
    if lo < 0 or hi >= vocab_size:
        return "out_of_vocab"
    return None


def is_holdout(s: Sample, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = zlib.crc32(np.asarray(s.prompt_ids + [-1] + s.response_ids, dtype=np.int64).tobytes())
    return (h % 10_000) < fraction * 10_000


@dataclass
class SampleBuffer:
    """Most recent samples of the most recent `keep_policy_versions` policy versions, at most `capacity`."""

    capacity: int
    keep_policy_versions: int = 2
    holdout_fraction: float = 0.1
    mode: Mode = "reward"
    w_min: float = 0.1
    w_max: float = 5.0
    stale_version_weight: float = 0.5
    train: deque = field(default_factory=deque)
    holdout: deque = field(default_factory=deque)
    versions: list[int] = field(default_factory=list)  # distinct policy versions kept, ascending
    _weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.train = deque(self.train, maxlen=self.capacity)
        self.holdout = deque(self.holdout, maxlen=max(1, int(self.capacity * max(self.holdout_fraction, 0.05))))

    def __len__(self) -> int:
        return len(self.train)

    def add(self, s: Sample) -> str:
        """Add a validated sample → 'train' | 'holdout' | 'stale' (older than the versions kept)."""
        if s.policy_version not in self.versions:
            if self.versions and len(self.versions) >= self.keep_policy_versions and s.policy_version < self.versions[0]:
                return "stale"
            self.versions = sorted(self.versions + [s.policy_version])[-self.keep_policy_versions:]
            oldest = self.versions[0]
            for q in (self.train, self.holdout):
                kept = [x for x in q if x.policy_version >= oldest]
                q.clear()
                q.extend(kept)
        (self.holdout if is_holdout(s, self.holdout_fraction) else self.train).append(s)
        self._weights = None
        return "holdout" if self.holdout and self.holdout[-1] is s else "train"

    def weights(self) -> np.ndarray:
        """Reward weights of the training samples, normalized over the whole buffer."""
        if self._weights is None or len(self._weights) != len(self.train):
            self._weights = reward_weights([s.reward for s in self.train], [s.group_id for s in self.train],
                                           self.mode, self.w_min, self.w_max)
        return self._weights

    def draw_probs(self) -> np.ndarray | None:
        """Probability of drawing each training sample (None = uniform): stale_version_weight^age."""
        newest = self.policy_version()
        ages = np.fromiter((newest - s.policy_version for s in self.train), dtype=np.float64, count=len(self.train))
        if not ages.any() or self.stale_version_weight == 1.0:
            return None
        p = np.power(self.stale_version_weight, ages) if self.stale_version_weight > 0 else (ages == 0).astype(np.float64)
        return p / p.sum()

    def batch(self, n: int, rng: random.Random) -> tuple[list[Sample], np.ndarray]:
        if not self.train:
            return [], np.zeros(0)
        p = self.draw_probs()
        if p is None:
            idx = [rng.randrange(len(self.train)) for _ in range(n)]
        else:
            cum = np.cumsum(p)
            idx = [min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1) for _ in range(n)]
        w = self.weights()
        return [self.train[i] for i in idx], w[idx]

    def policy_version(self) -> int:
        return self.versions[-1] if self.versions else 0


@dataclass
class SampleReader:
    """Reads the cluster's sample stream into a buffer; counts and drops bad entries."""

    redis: Any
    cluster: str
    buffer: SampleBuffer
    vocab_size: int
    max_seq_len: int
    keep_versions: int | None = None  # how far back the first read goes (default: the buffer's window)
    last_id: Any = None  # None: not read yet (the first poll starts at the newest end)
    dropped: Counter = field(default_factory=Counter)
    added: int = 0

    @property
    def max_entry_bytes(self) -> int:
        """Largest stream entry that can hold a usable sample: max_seq_len ids of up to 32 characters each
        (digits, separator, whitespace of a pretty-printing writer) plus 64 KiB for the other fields. A larger
        one is dropped unparsed, so a multi-megabyte entry costs the reader a length check, not a JSON parse."""
        return 64 * 1024 + 32 * self.max_seq_len

    def decode(self, fields: dict) -> Sample | None:
        """The Sample of one stream entry's fields, or None after counting why it is unusable."""
        raw = fields.get(b"data", fields.get("data"))
        if raw is None:
            self.drop("malformed")
            return None
        if len(raw) > self.max_entry_bytes:
            self.drop("oversized")
            return None
        try:
            return state.decode(Sample, raw, where=state.key(self.cluster, "samples"))
        except state.StateError:
            self.drop("malformed")
            return None

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        try:
            self.redis.hincrby(state.key(self.cluster, "dropped"), DROP_PREFIX + reason, 1)
        except Exception as e:  # counting is best-effort; the drop itself already happened
            log.debug("could not count dropped sample: %s", e)

    def offer(self, s: Sample) -> str:
        reason = validate_sample(s, self.vocab_size, self.max_seq_len)
        if reason:
            self.drop(reason)
            return reason
        where = self.buffer.add(s)
        if where == "stale":
            self.drop("stale_policy_version")
        else:
            self.added += 1
        return where

    def poll(self, count: int = 1000) -> int:
        """Read up to `count` new stream entries (the first poll: the newest ones); returns how many were
        added to the buffer."""
        before = self.added
        if self.last_id is None:
            self._read_newest()
            return self.added - before
        after = self.last_id
        start = "-" if after in ("0", b"0", "0-0") else b"(" + (after if isinstance(after, bytes) else after.encode())
        for entry_id, fields in self.redis.xrange(state.key(self.cluster, "samples"), min=start, max="+",
                                                  count=count):
            self.last_id = entry_id
            s = self.decode(fields)
            if s is not None:
                self.offer(s)
        return self.added - before


    def _read_newest(self, page: int = 500) -> None:
        """Walk the stream back from its newest entry until the buffer is full or the entries are older
        than the kept policy versions, then add what was read oldest first."""
        key = state.key(self.cluster, "samples")
        keep = self.keep_versions or self.buffer.keep_policy_versions
        want = self.buffer.capacity + (self.buffer.holdout.maxlen or 0)
        got: list[Sample] = []
        newest: int | None = None
        top, self.last_id = "+", "0"
        done = False
        while not done:
            raw = self.redis.xrevrange(key, max=top, min="-", count=page)
            if not raw:
                break
            if self.last_id == "0":
                self.last_id = raw[0][0]
            for _, fields in raw:
                s = self.decode(fields)
                if s is None:
                    continue
                # An unusable sample is dropped here: its policy version (any number) must not move the window.
                reason = validate_sample(s, self.vocab_size, self.max_seq_len)
                if reason:
                    self.drop(reason)
                    continue
                newest = s.policy_version if newest is None else max(newest, s.policy_version)
                if s.policy_version <= newest - keep or len(got) >= want:
                    done = True
                    break
                got.append(s)
            top = b"(" + raw[-1][0]
        for s in reversed(got):
            self.offer(s)


def fill_buffer(buffer: SampleBuffer, samples: Iterable[Sample], vocab_size: int, max_seq_len: int) -> Counter:
    """Validate and add in-process samples (CLI / tests); returns drops by reason."""
    dropped: Counter = Counter()
    for s in samples:
        reason = validate_sample(s, vocab_size, max_seq_len)
        if reason:
            dropped[reason] += 1
        elif buffer.add(s) == "stale":
            dropped["stale_policy_version"] += 1
    return dropped
