"""Drafter versions: validate a session's candidate, promote it only if it beats the current version.

Validation = expected acceptance length at chain length k (loss.acceptance_rates / expected_length) on
held-out recent samples, measured for the candidate and the current version on the SAME samples with
the CURRENT teacher (the policy moves, so the current version's old score is stale).

Every candidate gets a number (Redis INCR `drafter:counter`, or a local counter without Redis), a
directory `ROOT/v<N>` in the drafter format plus `version.json`, an entry in the history
(`drafter:versions`, RPUSH) and, when promoted, `drafter:current`. The same records are mirrored into
`ROOT/history.jsonl` and `ROOT/CURRENT` so `tailspec export --version N` works without a cluster.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tailspec import state
from tailspec.drafter_trainer.checkpoint import write_text_atomic
from tailspec.drafter_trainer.loss import acceptance_rates, expected_length
from tailspec.drafter_trainer.model import Eagle3Drafter, write_dir_atomic
from tailspec.drafter_trainer.teacher import Teacher, collate
from tailspec.state import DrafterVersion, Sample


@dataclass
class Validation:
    acceptance_length: float  # mean over valid anchors of E_k
    alpha: list[float]  # mean per-position acceptance probability α_1..α_k
    anchors: int
    k: int


@torch.no_grad()
def validate(drafter: Eagle3Drafter, teacher: Teacher, samples: Sequence[Sample], k: int = 4,
             batch_size: int = 32, temperature: float = 1.0, check: Callable[[], None] | None = None) -> Validation:
    """Expected acceptance length at chain length k on `samples` (see loss.acceptance_rates). `check` is
    called between batches (a session's stop check: it raises to abandon the validation)."""
    was_training = drafter.training
    drafter.eval()
    total_e, total_a, n = 0.0, torch.zeros(k, dtype=torch.float64), 0
    try:
        for s in range(0, len(samples), batch_size):
            if check is not None:
                check()
            batch = collate(samples[s : s + batch_size]).to(teacher.device)
            out = teacher(batch)
            alpha, valid = acceptance_rates(drafter, out.aux, out.logits, batch.ids, batch.lengths,
                                            batch.prompt_lens, k, temperature)
            e = expected_length(alpha)
            total_e += float(e[valid].double().sum())
            total_a += alpha[valid].double().sum(0).cpu()
            n += int(valid.sum())
    finally:
        drafter.train(was_training)
    if n == 0:
        raise ValueError(f"no held-out sample is long enough to validate at k={k}")
    return Validation(total_e / n, (total_a / n).tolist(), n, k)


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
        n = int(counter.read_text()) + 1 if counter.is_file() else 1
        write_text_atomic(counter, str(n))
        return n

    def path(self, version: int) -> Path:
        return self.root / f"v{version:05d}"

    def current(self) -> DrafterVersion | None:
        if self.redis is not None:
            cur = state.get(self.redis, self._key("drafter_current"), DrafterVersion)
            if cur is not None:
                return cur
        f = self.root / "CURRENT"
        return DrafterVersion.model_validate_json(f.read_text()) if f.is_file() else None

    def history(self) -> list[DrafterVersion]:
        if self.redis is not None:
            raw = self.redis.lrange(self._key("drafter_versions"), 0, -1)
            return [state.decode(DrafterVersion, r, where="drafter:versions") for r in raw]
        f = self.root / "history.jsonl"
        if not f.is_file():
            return []
        return [DrafterVersion.model_validate_json(line) for line in f.read_text().splitlines() if line.strip()]

    def get(self, version: int) -> DrafterVersion:
        f = self.path(version) / "version.json"
        if not f.is_file():
            known = sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*") if (p / "version.json").is_file())
            raise FileNotFoundError(f"drafter version {version} not found under {self.root}; known: {known}")
        return DrafterVersion.model_validate_json(f.read_text())

    def load(self, version: int | None = None, target_embedding: Any = None) -> tuple[Eagle3Drafter, DrafterVersion]:
        info = self.current() if version is None else self.get(version)
        if info is None:
            raise FileNotFoundError(f"no promoted drafter version under {self.root}")
        return Eagle3Drafter.load(info.path, target_embedding), info

    def propose(self, candidate: Eagle3Drafter, teacher: Teacher, holdout: Sequence[Sample], k: int = 4,
                session_id: str | None = None, note: str | None = None,
                check: Callable[[], None] | None = None) -> DrafterVersion:
        """Validate the candidate against the current version on `holdout`; save, record, promote if better."""
        cand = validate(candidate, teacher, holdout, k, check=check)
        cur_info = self.current()
        baseline = None
        if cur_info is not None:
            try:
                cur, _ = self.load(cur_info.version, teacher.embedding())
                baseline = validate(cur.to(teacher.device), teacher, holdout, k, check=check).acceptance_length
            except (FileNotFoundError, ValueError) as e:  # current version unreadable: the candidate may replace it
                note = f"{note or ''} current version unreadable: {e}".strip()
        promoted = baseline is None or cand.acceptance_length > baseline
        number = self._next_number()
        info = DrafterVersion(
            version=number, path=str(self.path(number).resolve()), policy_version=teacher.policy_version,
            acceptance_length=cand.acceptance_length, baseline_acceptance_length=baseline, promoted=promoted,
            created_at=time.time(), session_id=session_id, note=note,
        )
        cpu = candidate.to("cpu") if teacher.device.type != "cpu" else candidate
        cpu.save(self.path(number), extra={"version": info.model_dump(mode="json")})
        write_text_atomic(self.path(number) / "version.json", info.model_dump_json())
        if teacher.device.type != "cpu":
            candidate.to(teacher.device)
        self._record(info)
        return info

    def _record(self, info: DrafterVersion) -> None:
        with open(self.root / "history.jsonl", "a") as f:
            f.write(info.model_dump_json() + "\n")
        if info.promoted:
            write_text_atomic(self.root / "CURRENT", info.model_dump_json())
        if self.redis is not None:
            self.redis.rpush(self._key("drafter_versions"), state.encode(info))
            if info.promoted:
                state.put(self.redis, self._key("drafter_current"), info)
            kind = "version_promoted" if info.promoted else "version_rejected"
            state.append(self.redis, self._key("events"), state.Event(kind=kind, detail={
                "version": info.version, "acceptance_length": info.acceptance_length,
                "baseline_acceptance_length": info.baseline_acceptance_length}))
