"""The live part of `tailspec bench vllm`: one vLLM engine that follows the cluster (rollout/vllm_live.py).

On a private redis-server, with the health guard at the configuration's defaults (`rollout.guard_*`):
1. reload on promotion: the trained drafter written to `drafter:current` → the next generation call reloads it;
   `reload_on_promotion_s` is the wall time from the write to the first engine step served by the new drafter
   (the call follows the write at once, as in a rollout loop that promotes between phases);
2. guard: a version whose `fc` is zeroed (a drafter a broken weight sync leaves behind) is promoted; the guard's
   verdict comes after `guard_detect_steps` speculative steps (and that many engine steps of the call), the
   rest of the call runs k = 0, outputs compared with plain decoding; a good version brings speculation back;
3. policy sync: the policy's weights moved by 5% noise are loaded in place (vLLM's reload_weights), then the
   drafter, re-validated against them, is promoted and reloaded: `acceptance_after_policy_sync` holds vLLM's
   acceptance before the sync, after it, after the reload, and the validated figures (the version store's
   validation at the same k, temperature ~0 for greedy rollouts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis
from tailspec.benchmarks.vllm_kit import perturbed_policy, validated_acceptance, zeroed_fc
from tailspec.core import state
from tailspec.core.config import RolloutConfig
from tailspec.core.state import DrafterVersion
from tailspec.rollout.health_guard import GuardPolicy
from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout, greedy
from tailspec.rollout.vllm_live import LiveVllm

from tailspec.redis_server import start_redis


def run_live(policy: Path, drafters: dict[str, Path], prompts: list[list[int]], params: Any, eng: dict, k: int,
             reference: list[list[int]], out: Any) -> dict:
    root = drafters["trained"].parent
    policy_v1 = perturbed_policy(policy, root / "policy-v1-noise0.05", scale=0.05)
    bad = zeroed_fc(drafters["trained"], root / "zeroed-fc-norm")
    val = {"v0": validated_acceptance(drafters["trained"], policy, k),
           "v1": validated_acceptance(drafters["trained"], policy_v1, k)}
    rc = RolloutConfig()
    server = start_redis()
    r = redis.Redis.from_url(server.url)
    n = eng["max_num_seqs"]
    ro = VllmRollout(policy, DrafterSpec("eagle3", drafters["untrained"], k=k, schedule=[(1, n, k)]), **eng)
    live = LiveVllm(ro, redis=r, cluster="bench", worker="bench-vllm",
                    guard=GuardPolicy(rc.guard_window_steps, rc.guard_floor, rc.guard_min_gain_share))
    promote = _promoter(r, k)
    try:
        res = _promotion_and_guard(live, promote, drafters, bad, val["v0"], prompts, params, reference, out)
        res["guard_detect_steps"]["window_steps"] = rc.guard_window_steps
        live.update_policy(policy_v1)
        s = live.generate(prompts, params)
        promote(4, drafters["trained"], val["v1"])
        s2 = live.generate(prompts, params)
        before = res.pop("acceptance_before_sync")
        print(f"policy sync in place ({live.ro.policy_dir.name}): acceptance {before:.3f} -> "
              f"{s.counters.acceptance_length:.3f}, after the drafter reload {s2.counters.acceptance_length:.3f} "
              f"(validated {val['v0']:.3f} -> {val['v1']:.3f})", file=out)
    finally:
        ro.close()
        r.close()
        server.stop()
    res["acceptance_after_policy_sync"] = {
        "before_sync": round(before, 4), "after_sync": round(s.counters.acceptance_length, 4),
        "after_sync_and_reload": round(s2.counters.acceptance_length, 4),
        "validated_before": round(val["v0"], 4), "validated_after": round(val["v1"], 4),
        "guard": [v.message() for v in live.verdicts[-2:]]}
    return res


def _promoter(r: Any, k: int):
    """promote(version, path, validated acceptance) writes drafter:current; returns the write's time."""
    def promote(version: int, path: Path, acceptance: float) -> float:
        state.put(r, state.key("bench", "drafter_current"),
                  DrafterVersion(version=version, path=str(path), policy_version=0, acceptance_length=acceptance,
                                 validation_k=k, promoted=True, created_at=time.time()))
        return time.perf_counter()

    return promote


def _promotion_and_guard(live: Any, promote: Any, drafters: dict[str, Path], bad: Path, validated: float,
                         prompts: list[list[int]], params: Any, reference: list[list[int]], out: Any) -> dict:
    """Phases 1 and 2: the trained drafter promoted (reload latency), then a zeroed-fc version (the guard's
    verdict), then the trained one again (speculation back)."""
    live.generate(prompts[:1], greedy(8))  # warm-up
    first: list[float] = []
    t0 = promote(1, drafters["trained"], validated)
    a = live.generate(prompts, params, on_step=lambda *_: first.append(time.perf_counter()) if not first else None)
    reload_s = first[0] - t0
    print(f"promotion -> first step with the new drafter: {reload_s:.3f}s "
          f"(reload {live.loads[-1]['total_seconds']:.3f}s); acceptance {a.counters.acceptance_length:.3f}", file=out)
    steps: list[int] = []
    promote(2, bad, validated)
    g = live.generate(prompts, params, on_step=lambda *_: steps.append(len(live.verdicts)))
    verdict = live.verdicts[-1]
    engine_steps = steps.index(len(live.verdicts)) + 1 if verdict.tripped else None
    promote(3, drafters["trained"], validated)
    back = live.generate(prompts, params)
    exact = [c.token_ids for c in g.completions] == reference == [c.token_ids for c in back.completions]
    print(f"guard: {verdict.message()} (engine step {engine_steps} of the call); outputs exact: {exact}; "
          f"next version back at {back.counters.acceptance_length:.3f}", file=out)
    return {
        "reload_on_promotion_s": round(reload_s, 4),
        "guard_detect_steps": {"speculative_steps": verdict.steps if verdict.tripped else None,
                               "engine_steps": engine_steps, "tripped": verdict.tripped,
                               "live": round(verdict.live, 4),
                               "validated": round(verdict.validated, 4) if verdict.validated else None,
                               "drafts_in_the_call": g.counters.drafts, "outputs_exact": exact},
        "acceptance_before_sync": back.counters.acceptance_length,
    }
