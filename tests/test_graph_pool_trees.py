"""The graph pool over the whole strategy space (issue 48, item 4): tree verify shapes and the EAGLE-3 drafter's
steps in the same shared, budgeted plan; every shape pre-warmed at capture; and an engine with the pool attached
decoding exactly what the same engine decodes without it (tokens, logprobs, acceptance), for chains, a static
tree, a dynamic tree and a hook that switches among them, greedy and sampled, with padding rows (3 rows in
bucket 4). On CPU through `emulate=True` (the padded static-buffer path run eagerly); the gpu-marked tests at the
end do the same with real capture and check the pool's measured bytes against the plan's estimate."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import distilled_eagle3, random_eagle3
from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.drafters import Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.graph_pool import (
    DRAFT,
    VERIFY,
    GraphKey,
    GraphShape,
    build_pool,
    capture_plan,
    draft_steps,
    shared_bytes,
)
from tailspec.rollout.selector import AdaptiveSelector, candidate_ks
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import Strategy
from transformers import LlamaConfig, LlamaForCausalLM

TREE = Strategy.tree((3, 2, 1), 6)
DYN = Strategy.dynamic(3, 3, 6)
SPACE = [Strategy.chain(k) for k in range(4)] + [TREE, DYN]
BUCKETS = [1, 2, 4]


def small_llama(seed: int = 0, vocab: int = 48, hidden: int = 32, layers: int = 3, inter: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def cost(buckets=BUCKETS, space=SPACE) -> CostModel:
    return CostModel(buckets, space, {(b, s): 0.01 * (1 + b * s.width / 16) + 0.002 * s.depth
                                      for b in buckets for s in space})


def engine(model, drafter, hook, rule: str = "residual", max_batch: int = 4) -> Engine:
    return Engine(model, Eagle3Proposer(drafter, model), selector=hook, max_batch=max_batch, max_seq_len=48, k_max=3,
                  max_tree_nodes=24, verify_rule=rule)


@pytest.fixture(scope="module")
def pair():
    """A target and an EAGLE-3 drafter fit to its greedy continuations (drafts accepted often, at every depth), in
    float64. A padded bucket runs its matmuls at more rows than the eager forward (3 rows in bucket 4), and a BLAS
    may pick another kernel for another row count and round the last bit differently: how it does depends on the CPU.
    In float32 that flips, on some CPUs, a sampled near-tie between two tokens or drafts, and the rollouts part. In
    float64 the difference stays far below float32's rounding, where logits and draft logits are compared and
    sampled, so pooled and eager runs are equal bit for bit on every CPU, and a wrong slot, buffer or shape still
    shows as a different token, logprob or acceptance."""
    model = small_llama(2)
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 48, (int(n),), generator=g).tolist() for n in (2, 6, 3, 9, 4, 7, 5)]
    with torch.no_grad():
        full = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0].tolist() for p in prompts]
    drafter, _ = distilled_eagle3(model, full, steps=40, ttt_steps=3)
    return model.double(), drafter.double(), prompts


# -- the plan -------------------------------------------------------------------------------------------------------
def test_draft_steps_follow_the_drafters_calls():
    assert draft_steps(0) == [(1, 0)]  # observe only
    assert draft_steps(1) == [(2, 0)]
    assert draft_steps(Strategy.chain(3)) == [(1, 0), (4, 0)]  # two drafting steps [b, 1], observe [b, 4]
    # tree3-2-1n6: depth 1 has 3 nodes; the prior keeps 2 children of the first and 1 of the second, then 1 grandchild
    assert draft_steps(TREE) == [(2, 7), (1, 7), (4, 0)]
    assert draft_steps(DYN) == [(3, 1 + 3 + 2 * 9), (4, 0)]  # topk expanded nodes over every drafted node


def test_tree_shapes_in_the_plan_with_the_drafters_graphs(pair):
    model, drafter, _ = pair
    eng = engine(model, drafter, 0)
    c = cost()
    shape = GraphShape.of(eng.runner, True, eng.drafter)
    plan = capture_plan(c, shape, budget_bytes=1 << 40, margin=100.0)  # every strategy a candidate everywhere
    assert plan.pairs() == {(b, s) for b in BUCKETS for s in SPACE} and not plan.skipped
    for e in plan.entries:
        s = e.strategy
        assert [g.key for g in e.graphs] == [GraphKey(VERIFY, e.bucket, s.width, s.width if s.is_tree else 0)] + [
            GraphKey(DRAFT, e.bucket, w, m) for w, m in draft_steps(s)]
    # drafter graphs shared by several strategies (chain steps [b, 1]; observe [b, 4] of every depth-3 strategy)
    assert len(plan.graphs) < sum(len(e.graphs) for e in plan.entries)
    assert plan.pool_bytes == shared_bytes(plan.entries)
    rep = plan.report()
    assert rep["verify_graphs"] == len(BUCKETS) * 5  # widths 1..4 for chains; TREE and DYN share width 7 as trees
    assert rep["draft_graphs"] == len({g.key for g in plan.graphs if g.key.role == DRAFT}) > 0
    assert plan.lookup(3, TREE) == 4 and plan.lookup(3, 2) == plan.lookup(3, Strategy.chain(2)) == 4
    verify_only = capture_plan(c, GraphShape.of(eng.runner, True), budget_bytes=1 << 40, margin=100.0)
    assert verify_only.pool_bytes < plan.pool_bytes  # the drafter's graphs count in the budget
    tight = capture_plan(c, shape, budget_bytes=verify_only.pool_bytes, margin=100.0)
    assert tight.skipped and tight.pool_bytes <= verify_only.pool_bytes


def test_a_trees_mask_is_in_its_bytes():
    shape = GraphShape(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
                       vocab_size=64, num_layers=4, n_aux=0, attn_len=1040, itemsize=2)
    b, tree, chain = 4, Strategy.tree((2, 2), 6), Strategy.chain(6)  # the same width, 7
    L = shape.attn_len
    assert shape.workspace_bytes(b, tree) - shape.workspace_bytes(b, chain) == 2 * b * 7 * L + 18 * b * L
    assert shape.static_bytes(b, tree) - shape.static_bytes(b, chain) == b * 7 * 8 + b * 7 * 7  # depths, ancestors
    assert shape.workspace_bytes(b, 6) == shape.workspace_bytes(b, chain)  # an int is a chain's k


def test_every_choice_of_the_selector_over_chains_and_trees_is_captured():
    c = cost(buckets=[1, 2, 4, 8, 16])
    shape = GraphShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=64, num_layers=2, n_aux=0, attn_len=256, itemsize=4)
    plan = capture_plan(c, shape, budget_bytes=1 << 40)
    for n in range(1, 17):
        for s in candidate_ks(c, c.bucket(n)):
            assert plan.lookup(n, s) == c.bucket(n), (n, s)
    assert any(s.is_tree for _, s in plan.pairs())


# -- replay equals eager --------------------------------------------------------------------------------------------
def run(pair, hook_of, rule: str, temperature: float, pooled: bool, budget: int = 1 << 40, buckets=BUCKETS):
    """7 requests through an engine of 4 slots (rows finish one by one, and are admitted mid-run), a third of
    them greedy; with `pooled`, every strategy captured at every bucket (within `budget`)."""
    model, drafter, prompts = pair
    eng = engine(model, drafter, hook_of(), rule)
    pool = build_pool(eng, cost(buckets), budget, emulate=True, margin=100.0) if pooled else None
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=temperature if i % 3 else 0.0, seed=50 + i,
                             ignore_eos=True)
              for i in range(len(prompts))]
    outs = eng.generate(prompts, params)
    trace = [(r.rows, r.strategy, r.accepted, r.reach, r.rank_trials, r.rank_accepted) for r in eng.history]
    got = [(o.token_ids, o.logprobs, o.sampling_logprobs, o.finish_reason, o.stats) for o in outs]
    return got, trace, eng, pool


_REFS: dict = {}


def reference(pair, hook: str, rule: str, temperature: float):
    """`run` without the pool (once per case and drafter: several tests compare against the same one)."""
    key = (id(pair[1]), hook, rule, temperature)
    if key not in _REFS:
        _REFS[key] = run(pair, HOOKS[hook], rule, temperature, pooled=False)[:2]
    return _REFS[key]


def cycling(*strategies):
    """A maker of selectors that run `strategies` in turn, one per step (a fresh cycle per engine)."""
    def make():
        it = itertools.cycle(strategies)
        return lambda b, last: next(it)
    return make


HOOKS = {
    "chains": cycling(0, 3, 1, 2, 3),
    "tree": cycling(TREE),
    "dynamic": cycling(DYN),
    "mixed": cycling(TREE, 2, DYN, 0, 3, DYN, 1, TREE),
}
CASES = [(h, "residual", 0.0) for h in HOOKS] + [(h, "coupled", 1.0) for h in HOOKS] + [("mixed", "residual", 0.8)]


@pytest.mark.parametrize("hook,rule,temperature", CASES, ids=[f"{h}-{r}-T{t}" for h, r, t in CASES])
def test_engine_with_the_pool_decodes_exactly_as_without(pair, hook, rule, temperature):
    ref, ref_trace = reference(pair, hook, rule, temperature)
    got, trace, eng, pool = run(pair, HOOKS[hook], rule, temperature, pooled=True)
    assert got == ref  # tokens, logprobs and sampling logprobs bit for bit, finish reasons, drafted / accepted
    assert trace == ref_trace  # per step: rows, strategy, accepted, reach, per-rank trials and acceptances
    assert pool.replays == eng.steps and pool.eager == 0  # every verify replayed
    assert pool.draft_replays > 0 and pool.draft_eager == 0  # every drafter decode step replayed
    assert {r for r, *_ in trace} >= {4, 3}  # full and padded buckets
    assert sum(a for _, _, a, *_ in trace) > 0


def test_more_padding_rows_change_only_float_rounding(pair):
    """Buckets 1 and 4 only: 2 and 3 rows replay bucket 4, so padding turns a matmul of M <= 2 rows (GEMV in the
    eager forward) into M = 4 (GEMM), which a BLAS may round differently (the `pair` fixture's float64 keeps that
    below float32's rounding): tokens, acceptance and every step's counts identical, logprobs equal to float32
    rounding."""
    ref, ref_trace = reference(pair, "mixed", "coupled", 1.0)
    got, trace, _, pool = run(pair, HOOKS["mixed"], "coupled", 1.0, pooled=True, buckets=[1, 4])
    assert trace == ref_trace and {r for r, *_ in trace} & {2, 3}
    for a, b in zip(got, ref):
        assert (a[0], a[3], a[4]) == (b[0], b[3], b[4])  # tokens, finish reason, drafted / accepted
        for x, y in ((a[1], b[1]), (a[2], b[2])):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)
    assert pool.eager == 0 and pool.draft_eager == 0


def test_shapes_the_budget_leaves_out_run_eager_prewarmed_and_exact(pair):
    mixed = HOOKS["mixed"]
    ref, ref_trace = reference(pair, "mixed", "coupled", 1.0)
    model, drafter, _ = pair
    probe = engine(model, drafter, 0)
    full = capture_plan(cost(), GraphShape.of(probe.runner, True, probe.drafter), budget_bytes=1 << 40, margin=100.0)
    got, trace, eng, pool = run(pair, mixed, "coupled", 1.0, pooled=True, budget=full.pool_bytes // 2)
    assert pool.plan.skipped and pool.plan.entries
    assert got == ref and trace == ref_trace
    assert pool.replays > 0 and (pool.eager > 0 or pool.draft_eager > 0)
    shape = GraphShape.of(eng.runner, True, eng.drafter)
    every = {g.key for b, s in pool.plan.pairs() | set(pool.plan.skipped) for g in shape.specs(b, s)}
    assert every <= pool.warmed  # the skipped pairs' shapes were run once at capture too
    assert set(pool.graphs) < pool.warmed


def test_the_adaptive_selectors_exploration_never_meets_an_uncaptured_shape(pair):
    model, drafter, prompts = pair
    c = cost()
    sel = AdaptiveSelector(c, AcceptanceTracker(k_max=3), epsilon=0.5, seed=3)
    eng = engine(model, drafter, sel)
    pool = build_pool(eng, c, budget_bytes=1 << 40, emulate=True)  # the selector's own margin
    eng.generate(prompts, [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(len(prompts))])
    assert len({r.strategy for r in eng.history}) > 2
    assert pool.eager == 0 and pool.draft_eager == 0 and pool.replays == eng.steps


def test_the_drafter_seam_is_set_through_configure(pair):
    model, drafter, _ = pair
    eng = engine(model, drafter, 0)
    d = eng.drafter
    assert d.step_forward == d.step
    with pytest.raises(AttributeError):
        d.step_forward = None
    pool = build_pool(eng, cost(), budget_bytes=1 << 40, emulate=True)
    assert d.step_forward == pool.draft_step and eng.verify_forward == pool.forward
    assert d.configure() is d and d.step_forward == d.step
    # a call the pool has no graph for (prefill's slot0, an odd width) goes eager through the same seam
    x = torch.zeros(1, 5, d.H, dtype=d.dtype)
    pool.draft_step(x, torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], slot0=1)
    assert pool.draft_eager == 1


def test_a_pool_is_built_on_an_idle_engine(pair):
    model, _, prompts = pair
    eng = engine(model, random_eagle3(model), 1)
    eng.add_request(prompts[0], SamplingParams(max_tokens=4))
    eng.step()
    with pytest.raises(ValueError, match="idle|admitting"):
        build_pool(eng, cost(), budget_bytes=1 << 40, emulate=True)


# -- on a GPU: the real capture and replay ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rule,temperature", [("residual", 0.0), ("coupled", 1.0)])
def test_gpu_engine_with_captured_trees_and_drafter_decodes_as_eager(pair, rule, temperature):
    model, drafter, prompts = pair
    model, drafter = model.to("cuda"), drafter.to("cuda")

    def go(pooled: bool):
        eng = engine(model, drafter, HOOKS["mixed"](), rule)
        pool = build_pool(eng, cost(), budget_bytes=1 << 34, margin=100.0) if pooled else None
        params = [SamplingParams(max_tokens=6 + 4 * i, temperature=temperature, seed=50 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        return eng.generate(prompts, params), eng, pool

    try:
        ref, ref_eng, _ = go(False)
        got, eng, pool = go(True)
    finally:
        model.to("cpu"), drafter.to("cpu")
    assert pool.enabled and pool.graphs and pool.pool_bytes_measured > 0
    assert pool.eager == 0 and pool.draft_eager == 0 and pool.replays == eng.steps and pool.draft_replays > 0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    assert [r.accepted for r in eng.history] == [r.accepted for r in ref_eng.history]


@pytest.mark.gpu
def test_gpu_pool_bytes_against_the_estimate():
    """A target and drafter large enough that the plan's estimate, not the allocator's 2 MiB segments, sizes the
    pool: the measured shared pool is within the estimate's range, and below the separate pools."""
    model = small_llama(0, vocab=32768, hidden=256, layers=2, inter=768)
    drafter = random_eagle3(model, draft_vocab_size=4096)
    model, drafter = model.to("cuda", torch.bfloat16), drafter.to("cuda", torch.bfloat16)
    eng = Engine(model, Eagle3Proposer(drafter, model), selector=0, max_batch=16, max_seq_len=512, k_max=3,
                 max_tree_nodes=24)
    c = cost(buckets=[1, 2, 4, 8, 16])
    pool = build_pool(eng, c, budget_bytes=1 << 34, margin=100.0)
    est = pool.plan.pool_bytes
    assert pool.plan.report()["draft_graphs"] > 0
    # most of the estimate is the float32 logits that stay resident; the allocator carves 1-10 MB blocks out of
    # 20 MiB segments, hence the slack of one segment
    assert est / 4 <= pool.pool_bytes_measured <= 1.5 * est + (20 << 20), (pool.pool_bytes_measured, est)
    assert pool.pool_bytes_measured < pool.measure_separate_bytes()
