"""A live vLLM engine that follows the cluster (rollout/vllm_live.py), on vLLM's CPU build: a promotion written
in Redis is served at the next generation call and never during one; a policy-weight sync in place plus a
drafter reload accept as validated; a corrupted drafter trips the health guard within its window, outputs stay
exact, speculation stays off until a good version loads; the k schedule is refreshed from a cost model."""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path

import pytest
from vllm_helpers import MAX_TOKENS, drafters, engine_kwargs, prompts, tiny, token_ids

pytestmark = pytest.mark.vllm

WINDOW = 8  # guard window (speculative steps)
K = 3


@cache
def policy_v1() -> Path:
    """The next policy version: the tiny policy's weights moved by 25% noise (the tiny policy's greedy outputs
    on the test prompts first differ at about this size; 5% left them all unchanged)."""
    from tailspec.benchmarks.vllm_kit import perturbed_policy

    from tailspec.tasks.policy import default_cache_dir

    return perturbed_policy(tiny(), default_cache_dir() / "vllm-drafters" / "tiny-v1-noise0.25", scale=0.25)


@cache
def validated() -> dict[str, float]:
    """The trained drafter's validated acceptance at k=3 (the version store's measure, greedy) per policy."""
    from tailspec.benchmarks.vllm_kit import validated_acceptance

    return {"v0": validated_acceptance(drafters()["trained"], tiny(), K),
            "v1": validated_acceptance(drafters()["trained"], policy_v1(), K)}


@pytest.fixture(scope="module")
def refs():
    """Greedy outputs without speculation for both policy versions (built and closed before any live engine:
    two in-process vLLM engines cannot live side by side)."""
    from tailspec.rollout.vllm_backend import VllmRollout, greedy

    out = {}
    for name, policy in (("v0", tiny()), ("v1", policy_v1())):
        ro = VllmRollout(policy, None, **engine_kwargs())
        try:
            out[name] = token_ids(ro.generate(prompts(), greedy(MAX_TOKENS)))
        finally:
            ro.close()
    assert out["v0"] != out["v1"]  # the sync really changes the policy
    validated()
    return out


def version(n: int, path, acceptance: float | None = None):
    from tailspec.core.state import DrafterVersion

    return DrafterVersion(version=n, path=str(path), policy_version=0, acceptance_length=acceptance,
                          validation_k=K, promoted=True, created_at=time.time())


def promote(r, cluster: str, info) -> None:
    from tailspec.core import state

    state.put(r, state.key(cluster, "drafter_current"), info)


def live_engine(drafter: str, **kw):
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout
    from tailspec.rollout.vllm_live import LiveVllm

    ro = VllmRollout(tiny(), DrafterSpec("eagle3", drafters()[drafter], k=K, schedule=[(1, 8, K)]),
                     **engine_kwargs())
    return LiveVllm(ro, **kw)


def test_promotion_in_redis_is_served_at_the_next_call_never_during_one(refs, redis_client):
    from tailspec.rollout.vllm_backend import greedy

    live = live_engine("untrained", redis=redis_client, cluster="promo", guard=None)
    sp = greedy(MAX_TOKENS)
    try:
        a = live.generate(prompts(), sp)  # nothing promoted yet: the drafter it was built with
        assert live.version is None and not live.loads
        promote(redis_client, "promo", version(1, drafters()["trained"]))
        b = live.generate(prompts(), sp)
        assert live.version.version == 1 and live.loads[-1]["version"] == 1
        assert b.counters.acceptance_length > a.counters.acceptance_length + 0.5, (a.counters, b.counters)

        def promote_mid_call(active, c, s, seen=[0]):  # noqa: B006 - a call-local step counter
            seen[0] += 1
            if seen[0] == 3:
                promote(redis_client, "promo", version(2, drafters()["untrained"]))

        c = live.generate(prompts(), sp, on_step=promote_mid_call)
        # written during the call: the whole call ran the trained drafter, step for step as before
        assert live.version.version == 1 and live.ro.drafter_path == drafters()["trained"]
        assert (c.counters.drafts, c.counters.accepted_per_pos) == (b.counters.drafts, b.counters.accepted_per_pos)
        d = live.generate(prompts(), sp)  # ... and served from the next call on
        assert live.version.version == 2 and d.counters.acceptance_length < b.counters.acceptance_length - 0.5
        assert token_ids(a) == token_ids(b) == token_ids(c) == token_ids(d) == refs["v0"]
    finally:
        live.ro.close()


def test_policy_sync_in_place_and_drafter_reload_accept_as_validated(refs, redis_client):
    from tailspec.rollout.health_guard import GuardPolicy
    from tailspec.rollout.vllm_backend import greedy

    val = validated()
    live = live_engine("trained", redis=redis_client, cluster="sync", guard=GuardPolicy(window_steps=WINDOW),
                       version=version(1, drafters()["trained"], val["v0"]))
    sp = greedy(MAX_TOKENS)
    try:
        a = live.generate(prompts(), sp)
        assert token_ids(a) == refs["v0"] and live.verdicts[-1].event == "load" and not live.verdicts[-1].tripped
        target0 = live.ro.target_digest()
        live.update_policy(policy_v1())
        assert live.ro.target_digest() != target0
        b = live.generate(prompts(), sp)
        # the in-place sync is whole: outputs are those of a fresh vLLM built on the new weights
        assert token_ids(b) == refs["v1"]
        assert live.verdicts[-1].event == "policy_sync" and not live.verdicts[-1].tripped
        # the promoted drafter re-validated against the new policy, reloaded into the synced engine
        promote(redis_client, "sync", version(2, drafters()["trained"], val["v1"]))
        c = live.generate(prompts(), sp)
        assert live.loads[-1]["version"] == 2 and token_ids(c) == refs["v1"]
        v = live.verdicts[-1]
        assert v.event == "reload" and v.version == 2 and not v.tripped, v
        assert c.counters.mean_k == K
        assert abs(c.counters.acceptance_length - val["v1"]) < 0.5, (c.counters.acceptance_length, val)
    finally:
        live.ro.close()


def test_corrupted_drafter_trips_the_guard_outputs_exact_speculation_off_until_a_good_version(
        refs, redis_client, caplog, tmp_path):
    from tailspec.benchmarks.vllm_kit import zeroed_fc
    from tailspec.core import state
    from tailspec.core.state import Event
    from tailspec.rollout.health_guard import GuardPolicy
    from tailspec.rollout.vllm_backend import greedy

    val = validated()
    bad = zeroed_fc(drafters()["trained"], tmp_path / "zeroed-fc-norm")
    live = live_engine("trained", redis=redis_client, cluster="guard", guard=GuardPolicy(window_steps=WINDOW),
                       version=version(1, drafters()["trained"], val["v0"]))
    sp = greedy(MAX_TOKENS)
    try:
        assert token_ids(live.generate(prompts(), sp)) == refs["v0"] and not live.verdicts[-1].tripped
        promote(redis_client, "guard", version(2, bad, val["v0"]))  # claims the good version's validation
        steps: list = []
        with caplog.at_level(logging.WARNING, logger="tailspec.rollout.vllm_live"):
            e = live.generate(prompts(), sp, on_step=lambda a, c, s: steps.append((len(live.verdicts), c)))
        v = live.verdicts[-1]
        assert v.tripped and v.version == 2 and v.event == "reload" and v.steps == WINDOW, v
        assert token_ids(e) == refs["v0"]
        assert any("drafter v2 broken after reload" in r.getMessage() for r in caplog.records)
        # after[0]: the step that completed the window (the verdict); after[1] still verifies the drafts that
        # step proposed; from then on vLLM schedules k = 0
        after = [c for n, c in steps if n == len(live.verdicts)]
        assert len(after) > 2 and sum(c.drafts for c in after[2:]) == 0, after
        entries, _ = state.read_stream(redis_client, state.key("guard", "events"), Event)
        events = [ev for _, ev in entries]
        tripped = [ev for ev in events if ev.kind == "drafter_guard" and ev.detail.get("tripped")]
        assert tripped and tripped[-1].detail["version"] == 2 and tripped[-1].detail["backend"] == "vllm"

        f = live.generate(prompts(), sp)
        assert f.counters.drafts == 0 and token_ids(f) == refs["v0"]
        live.update_policy(tiny())  # a sync does not repair the same version: still off
        g = live.generate(prompts(), sp)
        assert g.counters.drafts == 0 and token_ids(g) == refs["v0"] and live.version.version == 2

        promote(redis_client, "guard", version(3, drafters()["trained"], val["v0"]))
        h = live.generate(prompts(), sp)
        assert h.counters.drafts > 0 and h.counters.acceptance_length > 2.0 and token_ids(h) == refs["v0"]
        assert live.verdicts[-1].version == 3 and not live.verdicts[-1].tripped
    finally:
        live.ro.close()


def test_schedule_refreshed_from_the_cost_model_after_a_load_and_a_batch_mix_change(refs):
    from tailspec.rollout.cost_model import CostModel
    from tailspec.rollout.vllm_backend import greedy

    # a made-up cost table where drafting is cheap alone and expensive in a full batch
    buckets, ks = [1, 2, 4, 8], [0, 1, 2, 3]
    cost = CostModel(buckets, ks, {(b, k): 0.01 * (1 + 0.02 * b * (1 + k * b)) for b in buckets for k in ks})
    live = live_engine("untrained", cost=cost, guard=None)
    try:
        live.load(version(1, drafters()["trained"], validated()["v0"]))
        first = live.refreshes[-1]
        assert first["reason"] == "reload" and first["applied"] and live.ro.schedule == first["schedule"]
        ks_by_batch = {b: k for s, e, k in first["schedule"] for b in range(s, e + 1)}
        assert ks_by_batch[1] > 0 and ks_by_batch[8] == 0, first["schedule"]
        trace: list = []
        res = live.generate(prompts(8), greedy(24, ignore_eos=True), trace=trace)
        assert live.refreshes[-1]["reason"] == "measured"  # measured acceptance replaced the prior
        full = [c for b, c in trace[1:] if b == 8]
        assert full and sum(c.draft_tokens for c in full[1:]) == 0 and res.counters.drafts == 0
        n = len(live.refreshes)
        live.generate(prompts(1), greedy(24, ignore_eos=True))  # batch 8 -> batch 1: the mix moved
        assert len(live.refreshes) == n + 1 and live.refreshes[-1]["reason"] == "batch_mix"
    finally:
        live.ro.close()


def test_engine_core_in_its_own_process_rolls_back_to_the_last_healthy_drafter(redis_url, tmp_path):
    """vLLM's default engine core runs in its own process, where the k schedule cannot be changed at run time:
    a tripped guard then reloads the last drafter it found healthy before the next call (speculation on, the
    good drafter's acceptance), outputs exact throughout. Run in a process of its own: the multiprocess engine
    must not meet the in-process ones of this module."""
    import json
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, str(here / "vllm_rollback_run.py"), redis_url, str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=here.parent,
                          env={**__import__("os").environ, "PYTHONPATH": str(here)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["healthy_first"] and out["schedule_settable"] is False, out
    assert out["tripped"] == {"tripped": True, "version": 2, "event": "reload"}, out
    assert out["drafter_after_trip"] == out["bad"] and out["drafter_after_rollback"] == out["good"], out
    assert out["rollback_loads"] == ["reload", "rollback"], out
    assert out["acceptance"]["after_rollback"] > 2.0 > out["acceptance"]["tripped_call"], out
    assert out["tokens_equal"] and out["guard_status_tripped"] is False, out  # healthy again after the rollback
