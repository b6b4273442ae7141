"""The selector's schedule [(first batch size, last batch size, k)] reaches vLLM as
num_speculative_tokens_per_batch_size, and the k vLLM drafts with (drafted tokens per drafting request-step,
from its own counters) follows the batch size. Progress reaches the scheduler through the client while
generate runs."""

from __future__ import annotations

import itertools

import pytest
from vllm_helpers import drafters, engine_kwargs, prompts, tiny

pytestmark = pytest.mark.vllm

SCHEDULE = [(1, 1, 3), (2, 3, 1), (4, 8, 0)]  # k=3 alone, k=1 for 2-3 requests, no speculation from 4 on


def k_for(batch: int) -> int:
    return next(k for s, e, k in SCHEDULE if s <= batch <= e)


@pytest.fixture(scope="module")
def engine():
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout

    ro = VllmRollout(tiny(), DrafterSpec("eagle3", drafters()["trained"], k=3, schedule=SCHEDULE),
                     **engine_kwargs())
    yield ro
    ro.close()


def test_k_follows_batch_size(engine):
    from tailspec.rollout.vllm_backend import greedy

    sp = greedy(24, ignore_eos=True)
    seen: dict[int, int] = {}
    for n in (1, 2, 4):
        trace: list = []
        res = engine.generate(prompts(4)[:n], sp, trace=trace)
        assert all(len(c.token_ids) == 24 for c in res.completions)
        # A step's k is checked where the batch did not change since the previous step (at a change, drafts
        # proposed under the old batch size are verified under the new one).
        for (prev_b, _), (b, c) in itertools.pairwise(trace):
            if b != prev_b:
                continue
            if k_for(b) == 0:
                assert c.draft_tokens == 0, f"batch {b}: {c}"
            elif c.drafts:
                assert c.draft_tokens == k_for(b) * c.drafts, f"batch {b}: {c}"
                seen[b] = seen.get(b, 0) + 1
        if n == 4:  # all four run to the same length without speculation: never a draft
            assert res.counters.draft_tokens == 0 and res.counters.drafts == 0
    assert seen.get(1, 0) > 3 and seen.get(2, 0) > 3, seen  # k=3 alone and k=1 in pairs were both exercised


def test_same_output_whatever_k(engine):
    from tailspec.rollout.vllm_backend import greedy

    sp = greedy(24)
    alone = [engine.generate([p], sp).completions[0].token_ids for p in prompts(4)]
    together = [c.token_ids for c in engine.generate(prompts(4), sp).completions]
    assert alone == together


def test_progress_reaches_scheduler(engine, redis_url, redis_client):
    from tailspec.core import state
    from tailspec.rollout.vllm_backend import client_progress, greedy
    from tailspec.scheduler.client import TailspecClient

    client = TailspecClient(redis_url, cluster="t")
    seen: list[tuple] = []
    report = client_progress(client, "vllm0", [0])

    def on_progress(*a):
        seen.append(a)
        report(*a)

    try:
        res = engine.generate(prompts(4), [greedy(8), greedy(16), greedy(24), greedy(32)],
                              on_progress=on_progress, progress_every_s=0.0)
        assert client.flush(5.0)
    finally:
        client.close()
    actives = [s[0] for s in seen]
    assert actives[-1] == 0 and seen[-1][1] == 4 and seen[-1][2] == res.tokens
    assert any(0 < a < 4 for a in actives), actives  # reports came while requests were still running
    assert actives == sorted(actives, reverse=True)
    p = state.get(redis_client, state.key("t", "progress", worker="vllm0"), state.Progress)
    assert (p.active, p.finished, p.total, p.tokens_done) == (0, 4, 4, res.tokens)
