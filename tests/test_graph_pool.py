"""CUDA graph pool: the capture plan (budget, coverage of the selector's choices, largest-first order), the
lookup with padding rows, and the pool path's outputs against the eager path — on CPU through the same code
with the capture itself replaced by an eager run of the padded static-shape forward (`emulate=True`).
The real capture/replay is checked by the gpu-marked tests at the end."""

from __future__ import annotations

import random

import pytest
import torch
from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.drafters import NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.graph_pool import (
    GraphPool,
    GraphShape,
    build_pool,
    capture_plan,
    pool_reserved_bytes,
    shared_bytes,
)
from tailspec.rollout.model_runner import ModelRunner
from tailspec.rollout.selector import AdaptiveSelector, candidate_ks
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import StepRecord
from transformers import LlamaConfig, LlamaForCausalLM

BUCKETS = [1, 2, 4, 8, 16]
KS = [0, 1, 2, 3, 4]


def small_llama(seed: int = 0, vocab: int = 48) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def cost() -> CostModel:
    return CostModel(BUCKETS, KS, {(b, k): 0.01 + 0.0004 * b * (k + 1) + 0.001 * k for b in BUCKETS for k in KS})


SHAPE = GraphShape(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
                   vocab_size=64, num_layers=4, n_aux=0, attn_len=1040, itemsize=2)


def test_plan_covers_every_candidate_largest_first():
    c = cost()
    plan = capture_plan(c, SHAPE, budget_bytes=1 << 40)
    want = {(b, k) for b in BUCKETS for k in candidate_ks(c, b)}
    assert plan.pairs() == want and not plan.skipped
    assert sorted(g.key for e in plan.entries for g in e.graphs) == sorted(g.key for g in plan.graphs)  # 1 each
    sizes = [g.workspace_bytes for g in plan.graphs]
    assert sizes == sorted(sizes, reverse=True)  # captured largest first
    assert plan.pool_bytes < plan.separate_bytes  # one workspace shared instead of one per graph
    assert plan.pool_bytes == max(e.workspace_bytes for e in plan.entries) + sum(e.static_bytes for e in plan.entries)


@pytest.mark.parametrize("frac", [0.0, 0.2, 0.5, 0.9])
def test_plan_respects_the_memory_budget(frac):
    c = cost()
    full = capture_plan(c, SHAPE, budget_bytes=1 << 40)
    budget = int(frac * full.pool_bytes)
    plan = capture_plan(c, SHAPE, budget_bytes=budget)
    assert plan.pool_bytes <= budget
    assert plan.pairs() | set(plan.skipped) == full.pairs()
    assert plan.pairs().isdisjoint(plan.skipped)
    if frac < 0.9:
        assert plan.skipped
    if plan.entries:  # small buckets are admitted first: nothing skipped is smaller than everything kept
        assert min(b for b, _ in plan.skipped) >= min(e.bucket for e in plan.entries)
    for b, k in plan.skipped:  # a skipped shape runs eager unless a larger captured bucket serves it
        got = plan.lookup(b, k)
        assert got is None or got > b


def test_lookup_pads_to_the_smallest_captured_bucket():
    plan = capture_plan(cost(), SHAPE, budget_bytes=1 << 40)
    assert plan.lookup(1, 0) == 1
    assert plan.lookup(3, 1) == 4 and plan.lookup(5, 0) == 8 and plan.lookup(9, 0) == 16 and plan.lookup(16, 0) == 16
    assert plan.lookup(17, 0) is None  # beyond the largest bucket: eager
    assert plan.lookup(0, 0) is None
    assert plan.lookup(4, 7) is None  # a strategy not in the plan: eager


def test_every_choice_of_the_adaptive_selector_is_captured():
    c = cost()
    plan = capture_plan(c, SHAPE, budget_bytes=1 << 40)
    rng = random.Random(0)
    sel = AdaptiveSelector(c, AcceptanceTracker(k_max=4), epsilon=0.3, seed=1)
    last = None
    for step in range(2000):
        n = rng.randint(1, 16)
        k = sel(n, last)
        assert plan.lookup(n, k) == c.bucket(n), (n, k)
        alpha = [0.05, 0.5, 0.9][(step // 300) % 3]  # acceptance moves: the selector's choices move with it
        reach, alive = [], n
        for _ in range(k):
            alive = sum(rng.random() < alpha for _ in range(alive))
            reach.append(alive)
        last = StepRecord.following(last, n, k, sum(reach), reach, c.t(n, k))
    assert sel.switches > 2


def _prefill(r, prompts):
    T = max(len(p) for p in prompts)
    toks = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    r.forward(toks[:, :-1], torch.zeros(len(prompts), dtype=torch.long))
    return r


@pytest.mark.parametrize("want_aux", [False, True])
def test_pool_path_equals_eager_path(want_aux):
    """Same verify inputs through the padded static-shape path (bucket 4 for 3 rows) and the eager path, on
    two runners with identical caches: logits and aux states agree, and the real rows' KV caches too."""
    model = small_llama()
    prompts = [[1, 5, 7, 9, 11], [1, 4, 4], [1, 8, 3, 3, 3, 3, 6]]
    eager, pooled = (ModelRunner(model, max_slots=8, cache_len=64, aux_layer_ids=(0, 1, 3)) for _ in range(2))
    c = CostModel([1, 2, 4, 8], [0, 2], {(b, k): 0.01 * (1 + b * (k + 1) / 16) for b in (1, 2, 4, 8) for k in (0, 2)})
    plan = capture_plan(c, GraphShape.of(pooled, want_aux), budget_bytes=1 << 40)
    pool = GraphPool(pooled, plan, want_aux=want_aux, emulate=True).capture()  # its warm-ups write slots 0..7
    assert pool.warmed == set(pool.graphs) == {g.key for g in plan.graphs}
    for r in (eager, pooled):  # then the requests arrive
        _prefill(r, prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.tensor([[11, 20, 21], [4, 30, 31], [6, 40, 41]])
    for step in range(3):  # three verify steps at advancing positions
        start = lengths - 1 + 3 * step
        le, ae = eager.forward(ids + step, start, max_pos=int(start.max()) + 2, want_aux=want_aux)
        lp, ap = pool.forward(ids + step, start, max_pos=int(start.max()) + 2, want_aux=want_aux)
        assert lp.shape == le.shape == (3, 3, 48)
        torch.testing.assert_close(lp, le, rtol=1e-5, atol=1e-5)
        if want_aux:
            torch.testing.assert_close(ap, ae, rtol=1e-5, atol=1e-5)
    assert pool.replays == 3 and pool.eager == 0
    for kc_e, kc_p in zip(eager.k_cache, pooled.k_cache):
        for row, L in enumerate(lengths.tolist()):
            torch.testing.assert_close(kc_p[row, :, : L + 8], kc_e[row, :, : L + 8])
    # a shape outside the plan (k = 1) goes eager through the same seam
    pool.forward(ids[:, :2], lengths - 1, want_aux=want_aux)
    assert pool.eager == 1


def test_engine_through_the_pool_matches_plain_engine():
    """Greedy decoding with the pool on the engine's verify seam (padding rows, shrinking batch, switching k)
    is token-identical to the same engine without it."""
    model = small_llama(seed=2)
    prompts = [[1] + [3 + (i * j) % 40 for j in range(3 + i)] for i in range(6)]
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0) for i in range(6)]
    ks = iter([0, 2, 1, 2, 0, 2, 2, 1] * 40)

    def choose(n, last):
        return next(ks)

    ref = Engine(model, NgramProposer(), selector=choose, max_batch=8, max_seq_len=64, k_max=2).generate(prompts, params)
    ks = iter([0, 2, 1, 2, 0, 2, 2, 1] * 40)
    eng = Engine(model, NgramProposer(), selector=choose, max_batch=8, max_seq_len=64, k_max=2)
    c = CostModel([1, 2, 4, 8], [0, 1, 2], {(b, k): 0.01 * (1 + b * (k + 1) / 64) for b in (1, 2, 4, 8) for k in (0, 1, 2)})
    pool = build_pool(eng, c, budget_bytes=1 << 40, emulate=True)
    assert eng.verify_forward == pool.forward
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert pool.replays == eng.steps and pool.eager == 0
    assert {r.rows for r in eng.history} > {6}  # the batch shrank: padded buckets were used


def test_pool_disabled_on_cpu_without_emulation():
    model = small_llama()
    eng = Engine(model, NgramProposer(), selector=1, max_batch=4, max_seq_len=32, k_max=2)
    c = CostModel([1, 2, 4], [0, 1], {(b, k): 0.01 * (b + k) for b in (1, 2, 4) for k in (0, 1)})
    pool = build_pool(eng, c, budget_bytes=1 << 40)
    assert not pool.enabled and not pool.graphs and eng.verify_forward == eng.runner.forward
    assert pool.plan.entries  # the plan is still made (and tested above)
    with pytest.raises(ValueError, match="budget"):
        capture_plan(c, GraphShape.of(eng.runner), budget_bytes=-1)
    assert shared_bytes([]) == 0


# -- on a GPU: the real capture and replay ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_replay_equals_eager_at_every_captured_shape(dtype):
    model = small_llama(vocab=64).to("cuda", dtype)
    eager = ModelRunner(model, max_slots=16, cache_len=128, aux_layer_ids=(0, 1, 3))
    graphed = ModelRunner(model, max_slots=16, cache_len=128, aux_layer_ids=(0, 1, 3))
    c = CostModel(BUCKETS, KS, {(b, k): 0.01 + 0.0004 * b * (k + 1) + 0.001 * k for b in BUCKETS for k in KS})
    plan = capture_plan(c, GraphShape.of(graphed, True), budget_bytes=1 << 40)
    pool = GraphPool(graphed, plan, want_aux=True).capture()
    assert pool.enabled and len(pool.graphs) == len(plan.entries) and pool.pool_bytes_measured > 0
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    g = torch.Generator(device="cuda").manual_seed(0)
    for e in plan.entries:
        k = e.strategy.depth
        for n in sorted({e.bucket, max(1, e.bucket - 1)}):  # exact fit and one padding row
            if plan.lookup(n, e.strategy) != e.bucket:
                continue
            ids = torch.randint(0, 64, (n, k + 1), device="cuda", generator=g)
            start = torch.randint(0, 100, (n,), device="cuda", generator=g)
            # Both runners attend over the same history: capture's warm-up and earlier padding rows wrote
            # the graphed runner's cache (as in the engine, where admission's prefill overwrites it). Copy
            # in place: the graphs hold these tensors' addresses.
            for kv_e, kv_g in zip(eager.kv_cache, graphed.kv_cache, strict=True):
                kv_e.normal_(generator=g)
                kv_g.copy_(kv_e)
            le, ae = eager.forward(ids, start, max_pos=int(start.max()) + k, want_aux=True)
            lp, ap = pool.forward(ids, start, max_pos=int(start.max()) + k, want_aux=True)
            torch.testing.assert_close(lp, le, **tol)
            torch.testing.assert_close(ap.float(), ae.float(), **tol)
    assert pool.eager == 0 and pool.replays > 0


def test_pool_bytes_are_the_segments_its_pool_owns(monkeypatch):
    """A pool's size counts only the allocator segments tagged with its pool id: not the default pool's (eager
    warm-ups) nor another graph pool's."""
    segments = [
        {"total_size": 2 << 20, "segment_pool_id": (0, 0)},  # default pool: warm-up activations
        {"total_size": 20 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 2 << 20, "segment_pool_id": (0, 7)},
        {"total_size": 4 << 20, "segment_pool_id": (0, 8)},  # another graph's pool
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert pool_reserved_bytes((0, 7)) == 22 << 20
    assert pool_reserved_bytes((0, 9)) == 0


@pytest.mark.gpu
def test_gpu_shared_pool_is_smaller_than_separate_graphs():
    model = small_llama(vocab=64).to("cuda", torch.bfloat16)
    runner = ModelRunner(model, max_slots=16, cache_len=128)
    plan = capture_plan(cost(), GraphShape.of(runner), budget_bytes=1 << 40)
    pool = GraphPool(runner, plan).capture()
    separate = pool.measure_separate_bytes()
    assert 0 < pool.pool_bytes_measured < separate

