"""A live vLLM rollout that follows the cluster between generation calls: promoted drafters, the k schedule,
policy-weight syncs and the drafter health guard.

    live = LiveVllm(VllmRollout(policy_dir, spec, ...), redis=r, cluster="prod", cost=measure_cost(ro, prompts))
    res = live.generate(prompts, greedy(512))   # reloads first if `drafter:current` changed since the last call
    live.update_policy(new_policy_dir)          # in place; the guard watches the next steps

- **Promotion watcher** (in the rollout process, no daemon): before every `generate`, `poll` reads
  `drafter:current` (`tailspec.core.state`, the record the version store's compare-and-swap writes) and, when
  it names another version, loads it into the live LLM (`VllmRollout.reload_drafter`) — between two
  generation calls, never during one. What the LLM loads is the directory `prepare` makes of the version:
  the roof's one drafter loader, `tailspec.drafter_load.load_drafter`, exports a version in tailspec's own
  format once as an EAGLE-3 directory (this component never imports the trainer that writes that format, so
  the loader is handed in); without it (`servable_dir`) only an EAGLE-3 export is served, as it is.
- **Schedule refresh**: after a drafter load, a policy sync, the first call after either (measured acceptance
  replaces the validated prior) and whenever the batch-size mix of a call moves away from the one at the last
  refresh, `num_speculative_tokens_per_batch_size` is recomputed by the engine's adaptive selector
  (`rollout.selector.AdaptiveSelector.schedule`) over the measured cost model and the acceptance vLLM's
  counters show (per-position accepted counts folded into an `AcceptanceTracker`), and swapped into the
  running engine with `VllmRollout.set_schedule`. vLLM 0.32 can change it at run time only when its engine
  core runs in this process (see `set_schedule`); otherwise the refresh is computed and recorded but not
  applied (`refreshes[-1]["applied"] is False`, logged once).
- **Health guard** (`rollout.health_guard.HealthGuard`, the native engine's): armed at every drafter load or
  reload and every policy sync, fed each engine step's counters (k, drafting requests, accepted drafts), it
  compares the live tokens per forward with the version's validated acceptance (`DrafterVersion.
  acceptance_length` at `validation_k`). A broken drafter: a warning naming the version and the event, a
  `drafter_guard` event in the cluster's event log, and speculation off on this engine (schedule all k = 0,
  at once, between two engine steps) — or, where the schedule cannot be changed, a rollback to the last
  version the guard found healthy at the next call (that version's own files when it was healthy until a
  policy sync or a wake-up broke it). A tripped version is not loaded again; speculation comes back when
  another version loads. Outputs stay exact throughout: only the draft length changes.
- **Engines in processes of their own** (the verl and OpenRLHF adapters): the framework generates, so the
  adapter calls `between_calls()` before each batch, `synced()` after the framework's own weight sync, and
  `observe_engines()` with each engine's counters over the batch; every engine has its own guard.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tailspec.core import state
from tailspec.core.state import DrafterVersion, Event
from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.cost_model import CostModel, default_buckets, default_ks
from tailspec.rollout.health_guard import GuardPolicy, HealthGuard, Verdict, record_verdict, validated_alpha
from tailspec.rollout.selector import AdaptiveSelector
from tailspec.rollout.strategy import StepRecord
from tailspec.rollout.vllm_backend import (
    DrafterMismatch,
    RolloutResult,
    SpecCounters,
    StepFn,
    VllmRollout,
)
from tailspec.rollout.vllm_checks import is_eagle3_export

log = logging.getLogger(__name__)

MIX_SHIFT = 0.25  # total-variation distance of the batch-bucket mix that triggers a schedule refresh


def servable_dir(info: DrafterVersion) -> Path:
    """The version's own directory when it is an EAGLE-3 export vLLM can load; else DrafterMismatch."""
    path = Path(info.path)
    if not is_eagle3_export(path):
        raise DrafterMismatch(f"drafter version {info.version} at {path} is not an EAGLE-3 export; give LiveVllm "
                              "prepare=tailspec.drafter_load.load_drafter to export it on promotion")
    return path


def step_record(previous: StepRecord | None, active: int, c: SpecCounters, seconds: float) -> StepRecord | None:
    """One engine step's counters as the engine-independent StepRecord; None for a step that mixed draft
    lengths (drafts proposed before a batch-size change and verified after it)."""
    if c.drafts <= 0:
        return StepRecord.following(previous, active, 0, 0, (), seconds)
    if c.draft_tokens % c.drafts:
        return None
    k = c.draft_tokens // c.drafts
    reach = (list(c.accepted_per_pos) + [0] * k)[:k]
    if not 0 <= c.accepted_tokens <= k * c.drafts or any(not 0 <= r <= c.drafts for r in reach):
        return None
    return StepRecord.following(previous, c.drafts, k, c.accepted_tokens, reach, seconds)


def measure_cost(ro: VllmRollout, prompts: Sequence[Sequence[int]], ks: Sequence[int] | None = None,
                 buckets: Sequence[int] | None = None, steps: int = 6) -> CostModel:
    """t(b, k) of this engine: for each k a constant schedule, for each batch bucket b that many requests
    decoding without EOS; the median wall time of its steps at batch b (the prefill step left out), made
    monotone in b and k (timing noise only adds time). Needs `set_schedule` to work (in-process engine)."""
    # deferred: vLLM (an optional extra; this module imports without it)
    from vllm import SamplingParams

    ks = list(ks if ks is not None else default_ks(ro.k_max))
    buckets = list(buckets if buckets is not None else default_buckets(ro.max_num_seqs))
    built = ro.schedule
    table: dict[tuple[int, int], float] = {}
    for k in ks:
        if not ro.set_schedule([(1, ro.max_num_seqs, k)]):
            raise RuntimeError("measure_cost needs an engine whose schedule can change at run time "
                               "(engine core in this process: in_process_engine())")
        for b in buckets:
            times: list[float] = []
            ro.generate([prompts[i % len(prompts)] for i in range(b)],
                        SamplingParams(temperature=0.0, max_tokens=(k + 1) * steps + 1, ignore_eos=True),
                        on_step=lambda active, c, s, b=b, times=times: times.append(s) if active == b else None)
            steady = sorted(times[1:] or times)
            table[(b, k)] = steady[len(steady) // 2]
    ro.set_schedule(built or [(1, ro.max_num_seqs, ro.k_max)])
    return CostModel(buckets, ks, table).monotone()


class LiveVllm:
    """A VllmRollout plus the promotion watcher, the schedule refresh and the health guard (module doc)."""

    def __init__(self, rollout: VllmRollout, *, redis: Any = None, cluster: str = "default",
                 current: Callable[[], DrafterVersion | None] | None = None,
                 prepare: Callable[[DrafterVersion], Path] = servable_dir, cost: CostModel | None = None,
                 guard: GuardPolicy | None = None, version: DrafterVersion | None = None, worker: str = "vllm",
                 on_verdict: Callable[[Verdict], None] | None = None):
        if rollout.spec is None or rollout.spec.method != "eagle3":
            raise ValueError("LiveVllm follows EAGLE-3 drafter versions: build the VllmRollout with method eagle3")
        self.ro, self.redis, self.cluster, self.worker = rollout, redis, cluster, worker
        self._current = current or (lambda: state.get(redis, state.key(cluster, "drafter_current"), DrafterVersion)
                                    if redis is not None else None)
        self.prepare, self.cost, self.on_verdict = prepare, cost, on_verdict
        self.guard = HealthGuard(guard) if guard is not None else None
        # engines in processes of their own (a framework's): one guard each, fed their counters per call
        self.engine_guards: dict[str, HealthGuard] = {}
        self._armed: tuple = (None, None, "start", 4, None)  # what the guards were last armed with
        self.version = version  # the live drafter's record (None: the one it was built with, unversioned)
        self.tracker = AcceptanceTracker(k_max=rollout.k_max)
        self.good_path: Path | None = rollout.drafter_path  # the last drafter the guard found healthy
        self.refused: set[int] = set()  # versions that tripped the guard or failed to load: not loaded again
        self.loads: list[dict] = []
        self.refreshes: list[dict] = []
        self.verdicts: list[Verdict] = []
        self._last: StepRecord | None = None
        self._mix: Counter = Counter()
        self._mix_at_refresh: dict[int, float] | None = None
        self._measure_next = False
        self._rollback = False
        self._warned_static = False
        if self.guard is not None and version is not None:
            self._arm(version, "load")

    # -- the watcher ------------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Load the promoted version if it changed since the last load; True when one was loaded."""
        info = self._current()
        if info is None or info.version in self.refused:
            return False
        if self.version is not None and (info.version, info.path) == (self.version.version, self.version.path):
            return False
        return self.load(info)

    def load(self, info: DrafterVersion, event: str = "reload") -> bool:
        """Load `info` into the live LLM now (call it between generation calls). A version that does not
        fit is refused and remembered (logged, the old drafter keeps serving): never retried every call."""
        try:
            res = self.ro.reload_drafter(self.prepare(info))
        except (DrafterMismatch, OSError, ValueError) as e:
            self.refused.add(info.version)
            log.error("%s: drafter v%d not loaded (%s); serving the previous drafter", self.worker, info.version, e)
            self._event("warning", {"drafter_version": info.version, "error": str(e)[:500]})
            return False
        self.version = info
        self.loads.append({"version": info.version, "event": event, **res})
        self._arm(info, event)
        self.tracker = AcceptanceTracker(k_max=self.ro.k_max, prior=self._prior(info),
                                         drafter_version=info.version, policy_version=self.tracker.policy_version)
        self._refresh(event)
        return True

    def update_policy(self, path: str | Path, policy_version: int | None = None) -> dict:
        """Policy-weight sync in place (`VllmRollout.update_policy`), then the guard watches the same drafter
        under the new weights and the schedule is refreshed."""
        res = self.ro.update_policy(path)
        self.synced(policy_version)
        return res

    def synced(self, policy_version: int | None = None, event: str = "policy_sync") -> None:
        """The policy weights under the live drafter changed (here, or by a framework's own weight sync, or its
        engines woke from sleep): the guards watch the same drafter again and the schedule is refreshed."""
        v = self.version
        self._arm_all(v.version if v else None, v.acceptance_length if v else None, event,
                      (v.validation_k or 4) if v else 4, v.rank_rates if v else None)
        if event == "policy_sync":  # the same drafter against a moved target: its acceptance counts decay
            self.tracker.set_version(self.tracker.drafter_version, policy_version if policy_version is not None
                                     else (self.tracker.policy_version or 0) + 1)
        self._refresh(event)

    def between_calls(self) -> None:
        """What must happen between two generation calls: a rollback the guard asked for, then the watcher's
        check. `generate` calls it; a framework adapter whose engines generate on their own calls it before
        each batch."""
        if self._rollback:
            self._roll_back()
        self.poll()

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *, on_step: StepFn | None = None,
                 **kw: Any) -> RolloutResult:
        """`VllmRollout.generate` after the watcher's check (and a pending rollback); the guard and the
        schedule's estimates read every engine step; the schedule is refreshed after the call when due."""
        self.between_calls()
        self._last, self._mix = None, Counter()

        def step(active: int, c: SpecCounters, seconds: float) -> None:
            self._observe(active, c, seconds)
            if on_step is not None:
                on_step(active, c, seconds)

        res = self.ro.generate(prompts, params, on_step=step, **kw)
        self._after_call()
        return res

    def _observe(self, active: int, c: SpecCounters, seconds: float) -> None:
        rec = step_record(self._last, active, c, seconds)
        if rec is None:
            return
        self._last = rec
        if rec.step == 1:  # the call's prefill: neither a decode cost nor acceptance evidence
            return
        self._mix[active] += 1
        if self.cost is not None:
            self.cost.observe(active, rec.k, seconds)
        if rec.k > 0:
            self.tracker.observe(rec)
        verdict = self.guard.observe(rec.k, rec.rows, rec.accepted) if self.guard is not None else None
        if verdict is not None:
            self._verdict(verdict)

    def observe_engines(self, windows: dict[str, SpecCounters]) -> list[Verdict]:
        """One generation call's counters per engine (the difference of two `process_counters` reads), for
        engines whose steps this process cannot see. Each engine has its own guard, so one engine whose
        drafter broke (a failed weight sync, a bad wake-up) is not averaged away by the healthy ones."""
        out = []
        if self.guard is None:
            return out
        for name, c in windows.items():
            g = self.engine_guards.get(name)
            if g is None:
                g = self.engine_guards[name] = HealthGuard(self.guard.policy)
                version, validated, event, k, rates = self._armed
                g.arm(version, validated, event, validated_k=k, rank_rates=rates)
            verdict = g.observe_totals(c.mean_k, c.drafts, c.accepted_tokens)
            if verdict is not None:
                out.append(verdict)
                self._verdict(verdict, worker=f"{self.worker}-{name}" if not name.startswith(self.worker) else name)
        return out

    def _after_call(self) -> None:
        mix = self._bucket_mix(self._mix)
        if self._measure_next:
            self._refresh("measured")
        elif mix and self._mix_at_refresh is not None:
            keys = set(mix) | set(self._mix_at_refresh)
            shift = sum(abs(mix.get(b, 0.0) - self._mix_at_refresh.get(b, 0.0)) for b in keys) / 2
            if shift > MIX_SHIFT:
                self._refresh("batch_mix")
        if mix and self._mix_at_refresh is None:
            self._mix_at_refresh = mix

    def _bucket_mix(self, mix: Counter) -> dict[int, float]:
        total = sum(mix.values())
        if not total:
            return {}
        bucket = self.cost.bucket if self.cost is not None else (lambda b: b)
        out: Counter = Counter()
        for b, n in mix.items():
            out[bucket(b)] += n / total
        return dict(out)

    # -- the schedule -----------------------------------------------------------------------------------
    def current_schedule(self) -> list[tuple[int, int, int]]:
        """What the engine should run now: all k = 0 while the guard holds speculation off; else the
        adaptive selector's pick per batch size over the cost model and the acceptance seen (without a cost
        model: the schedule the LLM was built with, or k_max everywhere)."""
        n, k_max = self.ro.max_num_seqs, self.ro.k_max
        if self.guard is not None and not self.guard.speculate:
            return [(1, n, 0)]
        if self.cost is None:
            return list(self.ro.spec.schedule or [(1, n, k_max)])
        sel = AdaptiveSelector(self.cost, self.tracker, ks=[k for k in self.cost.ks if k <= k_max], epsilon=0.0)
        return sel.schedule(n)

    def _refresh(self, reason: str) -> None:
        schedule = self.current_schedule()
        applied = self.ro.set_schedule(schedule)
        if not applied and not self._warned_static:
            self._warned_static = True
            log.warning("%s: vLLM's engine core runs in another process: the k schedule cannot change at run "
                        "time (vLLM 0.32); it stays as built", self.worker)
        self.refreshes.append({"reason": reason, "schedule": schedule, "applied": applied})
        self._measure_next = reason in ("reload", "load", "policy_sync", "wake", "rollback")
        if self._mix:
            self._mix_at_refresh = self._bucket_mix(self._mix)

    # -- the guard --------------------------------------------------------------------------------------
    def _arm(self, info: DrafterVersion, event: str) -> None:
        self._arm_all(info.version, info.acceptance_length, event, info.validation_k or 4, info.rank_rates)

    def _arm_all(self, version: int | None, validated: float | None, event: str, validated_k: int = 4,
                 rank_rates: list[list[float]] | None = None) -> None:
        self._armed = (version, validated, event, validated_k, rank_rates)
        for g in ([self.guard] if self.guard is not None else []) + list(self.engine_guards.values()):
            g.arm(version, validated, event, validated_k=validated_k, rank_rates=rank_rates)

    @staticmethod
    def _prior(info: DrafterVersion) -> float:
        if info.acceptance_length is None:
            return 0.5
        return validated_alpha(info.acceptance_length, info.validation_k or 4, info.rank_rates)

    def _verdict(self, v: Verdict, worker: str | None = None) -> None:
        worker = worker or self.worker
        self.verdicts.append(v)
        if v.tripped:
            log.warning("%s: %s", worker, v.message())
            if v.version is not None:
                self.refused.add(v.version)
            if not self.ro.set_schedule([(1, self.ro.max_num_seqs, 0)]):
                # a drafter the guard found healthy, broken by a weight sync or a wake-up: its own files reloaded
                # repair it; any other broken drafter is replaced by the last healthy one
                repair = v.event in ("policy_sync", "wake") and self.good_path == self.ro.drafter_path
                self._rollback = self.good_path is not None and (self.good_path != self.ro.drafter_path or repair)
                if not self._rollback:
                    log.error("%s: speculation cannot be turned off on this engine and no earlier healthy drafter "
                              "is known; decoding goes on with the broken one (outputs stay exact)", worker)
        else:
            log.info("%s: %s", worker, v.message())
            self.good_path = self.ro.drafter_path
        self._event("drafter_guard", {"worker": worker, **asdict(v)})
        if self.redis is not None:
            try:  # best effort, as the event
                record_verdict(self.redis, self.cluster, worker, v, backend="vllm")
            except Exception as e:  # noqa: BLE001 - a lost status must not fail the rollout
                log.warning("guard verdict not recorded: %s", e)
        if self.on_verdict is not None:
            self.on_verdict(v)

    def _roll_back(self) -> None:
        """Where the schedule cannot be changed: reload the last drafter the guard found healthy."""
        self._rollback = False
        assert self.good_path is not None
        res = self.ro.reload_drafter(self.good_path)
        self.loads.append({"version": None, "event": "rollback", **res})
        log.warning("%s: reloaded the last healthy drafter %s", self.worker, self.good_path)
        self._arm_all(None, None, "rollback")

    def _event(self, kind: str, detail: dict) -> None:
        if self.redis is None:
            return
        try:  # best effort, as the native workers: a lost event must not fail the rollout
            state.append(self.redis, state.key(self.cluster, "events"),
                         Event(kind=kind, detail={"worker": self.worker, "backend": "vllm", **detail}))
        except Exception as e:  # noqa: BLE001
            log.warning("%s event not recorded: %s", kind, e)
