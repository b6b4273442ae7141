"""Tree speculation is exact (issue 48, section 3), checked against references independent of the engine:

1. the joint law of the first three tokens under static and dynamic trees, both verify rules, T in {0.7, 1, 1.3},
   top-k and top-p, against the target's exact processed distribution (HF forward + HF's logits warpers), with
   the run shown to have accepted drafts at depth 1, at sibling ranks > 0 and deeper;
2. deliberately wrong tree rules (and a tree verify whose accepted path is not moved into the KV cache) fail
   that very check;
3. greedy tree decoding equals HF `generate`, static and dynamic trees up to depth 6 and 32 nodes, batches whose
   rows finish at different times, with a drafter that accepts often;
4. under the coupled rule a request's tokens are the same with no SD, a chain, a static tree, a dynamic tree and
   another drafter;
5. logprobs and sampling logprobs equal a plain recomputation (HF forward, log_softmax, HF warpers);
6. the Strategy value: labels, validation, static topologies, expected accepted length, the engine's refusals.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from engine_helpers import distilled_eagle3, hf_greedy, random_eagle3
from tailspec.rollout import sampling
from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.model_runner import ModelRunner
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import Strategy, expected_accepted, static_tree
from tailspec.rollout.tree import TreeDraft, static_topology
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.test_engine_sampling import check, enumerate_joint

V = 8  # V and PROMPT are tests/test_engine_sampling.py's: its `check` and `enumerate_joint` judge these samples
PROMPT = [1, 3]
N = 12_000
ALPHA = 1e-3
# intra-op threads of the N-row samplings (everything else runs on one: `one_thread`). One: at these small shapes a
# second thread on 2 shared cores spends its time waiting at OpenMP barriers, not working
HEAVY_THREADS = 1

TREE = Strategy.tree((3, 2), 4)
TREE3 = Strategy.tree((4, 2, 1), 7)
DYN = Strategy.dynamic(3, 3, 6)


# -- the exact law (tests/test_engine_sampling.py's) ----------------------------------------------------------------
def small_llama(seed: int, vocab: int = V, layers: int = 2, hidden: int = 32, init: float = 0.1,
                eos: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=None if eos is None else 0,
    )
    return LlamaForCausalLM(cfg).eval()


def warpers(temperature: float, top_p: float = 1.0, top_k: int = 0) -> LogitsProcessorList:
    w = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        w.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        w.append(TopPLogitsWarper(top_p))
    return w


def rank_counts(eng: Engine, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(trials, accepted) [depth, ranks] summed over the engine's StepRecords of tree steps."""
    trials = np.zeros((depth, sampling.TREE_RANKS), dtype=np.int64)
    acc = np.zeros_like(trials)
    for rec in eng.history:
        for d, (t, a) in enumerate(zip(rec.rank_trials, rec.rank_accepted)):
            trials[d, : len(t)] += t
            acc[d, : len(a)] += a
    return trials, acc


@contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def one_thread():
    """Small batches and the distillations run on one intra-op thread (on 2 shared cores a second one spends more
    time waiting for a core than it saves)."""
    with threads(1):
        yield


# -- the V = 8 target and its drafters ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return small_llama(0)


@pytest.fixture(scope="module")
def drafters(target):
    """`fit`: an EAGLE-3 head distilled on the target's own samples (full vocabulary); `random6`: a random head
    over 6 of the 8 ids (the draft -> target map; two ids it never drafts)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor(PROMPT).expand(128, -1)
    with threads(1):
        with torch.no_grad():
            for _ in range(5):
                probs = target(ids).logits[:, -1].softmax(-1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
        fit, agree = distilled_eagle3(target, ids.tolist(), steps=80, ttt_steps=3)
    assert agree[0] > 0.5, f"the distilled drafter agrees with the target's top-1 at {agree}"
    return {"fit": fit, "random6": random_eagle3(target, draft_vocab_size=6)}


def tree_samples(target, drafter, strategy: Strategy, setting: dict, rule: str, n: int = N):
    eng = Engine(target, Eagle3Proposer(drafter, target), selector=lambda b, last: strategy, max_batch=n,
                 max_seq_len=len(PROMPT) + 3, k_max=strategy.depth, max_tree_nodes=24, verify_rule=rule)
    params = [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **setting) for i in range(n)]
    with threads(HEAVY_THREADS):
        outs = eng.generate([PROMPT] * n, params)
    toks = np.array([o.token_ids for o in outs])
    assert toks.shape == (n, 3)
    return toks, eng, sum(o.stats.accepted for o in outs)  # RequestStats: the accepted drafts that were emitted


SETTINGS = {
    "t0.7": {"temperature": 0.7},
    "t1.0": {"temperature": 1.0},
    "t1.3": {"temperature": 1.3},
    "t1.0-k5": {"temperature": 1.0, "top_k": 5},
    "t0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
}
# every temperature and truncation under both rules; every shape under both rules and with both drafters
CASES = [
    ("residual", "t0.7", TREE, "fit"),
    ("residual", "t1.0", TREE3, "random6"),
    ("residual", "t1.3", DYN, "fit"),
    ("residual", "t1.0-k5", DYN, "random6"),
    ("residual", "t0.7-p0.9", TREE3, "fit"),
    ("coupled", "t0.7", DYN, "random6"),
    ("coupled", "t1.0", TREE, "fit"),
    ("coupled", "t1.3", TREE3, "random6"),
    ("coupled", "t1.0-k5", TREE, "random6"),
    ("coupled", "t0.7-p0.9", DYN, "fit"),
]


@pytest.mark.parametrize("rule,setting,strategy,drafter", CASES, ids=[f"{r}-{s}-{t.label}-{d}" for r, s, t, d in CASES])
def test_tree_sampling_is_exact(target, drafters, rule, setting, strategy, drafter):
    joint = enumerate_joint(target, **SETTINGS[setting])
    toks, eng, emitted = tree_samples(target, drafters[drafter], strategy, SETTINGS[setting], rule)
    trials, acc = rank_counts(eng, strategy.depth)
    print(f"{rule} {setting} {strategy.label} {drafter}: accepted per (depth, rank) {acc[:, :4].tolist()} "
          f"of {trials[:, :4].tolist()}")
    # not vacuous: drafts accepted at depth 1, at a sibling rank > 0, and deeper
    assert acc[0, 0] > 100 and acc[0, 1:].sum() > 100, acc[:, :4]
    assert acc[1].sum() > 100, acc[:, :4]
    reach = np.sum([rec.reach for rec in eng.history], 0)  # rows whose path reached depth j + 1
    assert acc.sum(1).tolist() == reach.tolist()  # the two StepRecord counts agree
    assert 0.3 * acc.sum() < emitted <= acc.sum()  # what was emitted of it (max_tokens cuts the rest)
    ok, pval, tv, bound = check(toks, joint)
    assert ok, f"chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


# -- wrong tree rules fail the same check -----------------------------------------------------------------------
def _walk(p, tree, u_accept, u_sample, remove_rejected: bool = True, normalise: bool = True):
    """sampling.verify_tree restated (test_walks_restate_the_tree_rules), with two switches to break it."""
    B, _, _ = p.shape
    D, R = u_accept.shape[1], tree.children.shape[-1]
    rows = torch.arange(B)
    tokens, path = torch.zeros(B, D + 1, dtype=torch.long), torch.zeros(B, D + 1, dtype=torch.long)
    trials, accepted = torch.zeros(D, R, dtype=torch.long), torch.zeros(D, R, dtype=torch.long)
    cur, n_acc = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    active = torch.ones(B, dtype=torch.bool)
    for d in range(D + 1):
        resid = p[rows, cur].double()
        nxt, took = cur.clone(), torch.zeros(B, dtype=torch.bool)
        if d < D:
            kids = tree.children[rows, cur]
            for r in range(R):
                c = kids[:, r]
                tried = active & ~took & (c >= 0)
                x = tree.tokens[rows, c.clamp(min=0)]
                px = resid.gather(1, x[:, None])[:, 0]
                mass = resid.sum(-1) if normalise else torch.ones_like(px)
                ok = tried & (u_accept[:, d, r] * mass < px)
                if remove_rejected:
                    resid = torch.where((tried & ~ok)[:, None], resid.scatter(1, x[:, None], 0.0), resid)
                nxt, took = torch.where(ok, c, nxt), took | ok
                trials[d, r], accepted[d, r] = (active & (c >= 0)).sum(), ok.sum()
        drawn = sampling.sample(resid, u_sample[:, d])
        stop = active & ~took
        tokens[:, d] = torch.where(took, tree.tokens[rows, nxt], torch.where(stop, drawn, tokens[:, d]))
        n_acc += took.long()
        active &= took
        cur = nxt
        if d < D:
            path[:, d + 1] = cur
    return tokens, n_acc, path, trials, accepted


def _residual_not_updated(p, tree, u_accept, u_sample):
    """A rejected child stays in the residual (the next sibling is tested against p, not p without it)."""
    return _walk(p, tree, u_accept, u_sample, remove_rejected=False)


def _not_renormalised(p, tree, u_accept, u_sample):
    """A child accepted with probability p_res(x), not p_res(x) / |p_res|."""
    return _walk(p, tree, u_accept, u_sample, normalise=False)


def _coupled_walk(p, tree, e, follow_rank0: bool = False):
    """sampling.verify_tree_coupled restated; broken, it emits the race winner but moves to the rank-0 child (when
    there is one) whichever child won."""
    B = p.shape[0]
    D, R = e.shape[1] - 1, tree.children.shape[-1]
    rows = torch.arange(B)
    tokens, path = torch.zeros(B, D + 1, dtype=torch.long), torch.zeros(B, D + 1, dtype=torch.long)
    trials, accepted = torch.zeros(D, R, dtype=torch.long), torch.zeros(D, R, dtype=torch.long)
    cur, n_acc = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    active = torch.ones(B, dtype=torch.bool)
    for d in range(D + 1):
        win = sampling.race(p[rows, cur], e[:, d])
        tokens[:, d] = torch.where(active, win, tokens[:, d])
        if d == D:
            break
        kids = tree.children[rows, cur]
        match = (kids >= 0) & active[:, None] & (tree.tokens.gather(1, kids.clamp(min=0)) == win[:, None])
        took = match.any(-1)
        winner = kids.gather(1, match.long().argmax(-1, keepdim=True))[:, 0]
        nxt = torch.where(kids[:, 0] >= 0, kids[:, 0], winner) if follow_rank0 else winner
        trials[d], accepted[d] = ((kids >= 0) & active[:, None]).sum(0), match.sum(0)
        cur = torch.where(took, nxt, cur)
        n_acc += took.long()
        active &= took
        path[:, d + 1] = cur
    return tokens, n_acc, path, trials, accepted


def _coupled_follows_rank0(p, tree, e):
    return _coupled_walk(p, tree, e, follow_rank0=True)


def assert_same_walk(want, got):
    """(tokens, n_acc, path, rank_trials, rank_accepted) equal, tokens and path up to n_acc (past it: unused)."""
    n_acc = want[1]
    assert torch.equal(got[1], n_acc)
    upto = torch.arange(want[0].shape[1])[None] <= n_acc[:, None]
    for w, x in (want[0], got[0]), (want[2], got[2]):
        assert torch.equal(torch.where(upto, w, -1), torch.where(upto, x, -1))
    assert torch.equal(want[3], got[3]) and torch.equal(want[4], got[4])


def test_walks_restate_the_tree_rules():
    """The broken rules below are one-line edits of faithful copies: the copies equal verify_tree and
    verify_tree_coupled exactly, and the edits change what they emit."""
    g = torch.Generator().manual_seed(0)
    B, vocab = 512, 6
    for strategy in (TREE, TREE3, Strategy.tree((3, 3, 2), 12)):
        topo = static_topology(strategy, torch.device("cpu"))
        m = topo.parent.shape[0]
        # siblings differ (a drafter's children are its distinct top choices): rank + a random offset per parent
        tokens = (topo.rank[None] + torch.randint(0, vocab, (B, m), generator=g).gather(1, topo.parent[None].expand(B, m)))
        tree = TreeDraft(tokens=tokens % vocab, **{k: getattr(topo, k)[None].expand(B, *getattr(topo, k).shape)
                                                   for k in ("parent", "depth", "rank", "anc", "children")})
        p = torch.rand(B, m, vocab, generator=g).pow(3)
        p = (p * (torch.rand(B, m, vocab, generator=g) > 0.3)).add_(1e-3 * (torch.arange(vocab) == 0))
        p = p / p.sum(-1, keepdim=True)
        u_acc = torch.rand(B, strategy.depth, topo.children.shape[-1], generator=g, dtype=torch.float64)
        u_smp = torch.rand(B, strategy.depth + 1, generator=g, dtype=torch.float64)
        want = sampling.verify_tree(p, tree, u_acc, u_smp)
        assert_same_walk(want, _walk(p, tree, u_acc, u_smp))
        assert int(want[1].max()) >= 2 and int(want[4][0, 1:].sum()) > 0  # deep paths and rank > 0 children ran
        broken = _walk(p, tree, u_acc, u_smp, normalise=False)
        assert not torch.equal(broken[0], want[0])
        e = -torch.rand(B, strategy.depth + 1, vocab, generator=g, dtype=torch.float64).log()
        want = sampling.verify_tree_coupled(p, tree, e)
        assert_same_walk(want, _coupled_walk(p, tree, e))
        assert int(want[1].max()) >= 2 and int(want[4][0, 1:].sum()) > 0
        assert not torch.equal(_coupled_follows_rank0(p, tree, e)[2], want[2])  # another path


def _path_not_moved(self, start, path):
    """The accepted path's KV entries left in their tree slots."""


BROKEN = {
    "residual-not-updated": ("residual", "verify_tree", _residual_not_updated, DYN, "t1.0", "fit"),
    "not-renormalised": ("residual", "verify_tree", _not_renormalised, DYN, "t1.0", "fit"),
    "coupled-follows-rank0": ("coupled", "verify_tree_coupled", _coupled_follows_rank0, TREE, "t0.7-p0.9", "random6"),
    "path-not-moved": ("residual", None, _path_not_moved, DYN, "t0.7", "fit"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_tree_rule_fails_the_same_check(target, drafters, monkeypatch, name):
    rule, attr, broken, strategy, setting, drafter = BROKEN[name]
    if attr is None:
        monkeypatch.setattr(ModelRunner, "move_path", broken)
    else:
        monkeypatch.setattr(sampling, attr, broken)
    toks, _, _ = tree_samples(target, drafters[drafter], strategy, SETTINGS[setting], rule)
    ok, pval, tv, bound = check(toks, enumerate_joint(target, **SETTINGS[setting]))
    print(f"{name}: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})")
    assert not ok, f"{name} passed: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


# -- greedy equals HF generate ---------------------------------------------------------------------------------
GV = 48
MAX_TOKENS = [30, 6, 24, 36, 12, 28, 30, 36]


@pytest.fixture(scope="module")
def big():
    """A V = 48 target (3 layers, EOS 2), prompts of 2-12 tokens with HF's greedy references (two of them with an
    extra stop id taken from their own response, so EOS, stop-id and max_tokens finishes all occur), and
    an EAGLE-3 head distilled on the references (accepts often)."""
    model = small_llama(0, vocab=GV, layers=3, hidden=64, init=0.3, eos=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, GV, (int(n),), generator=g).tolist() for n in (2, 7, 12, 4, 9, 3, 11, 5)]
    with threads(1):
        full = [hf_greedy(model, p, 40) for p in prompts]
    refs, stops = [], []
    for i, (r, m) in enumerate(zip(full, MAX_TOKENS)):
        r = r[:m]
        t = next((x for x in r[6:] if x not in r[:6] and x != 2), None) if i in (1, 3) else None
        if t is not None:  # = HF with eos_token_id=[2, t]: the same greedy tokens up to the stop
            r = r[: r.index(t) + 1]
        refs.append(r)
        stops.append((t,) if t is not None else ())
    finishes = {"eos" if r[-1] == 2 else "stop" if s and r[-1] == s[0] else "length" for r, s in zip(refs, stops)}
    assert finishes == {"eos", "stop", "length"}, finishes
    assert len({len(r) for r in refs}) >= 5  # rows finish at different times
    with threads(1):
        drafter, _ = distilled_eagle3(model, [p + r for p, r in zip(prompts, full)], steps=100, ttt_steps=3)
    return model, prompts, refs, stops, drafter


def greedy_run(big, drafter, selector, batch: int, k_max: int = 6):
    model, prompts, refs, stops, _ = big
    eng = Engine(model, Eagle3Proposer(drafter, model), selector=selector, max_batch=batch, max_seq_len=64,
                 k_max=k_max, max_tree_nodes=128)
    params = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=s) for m, s in zip(MAX_TOKENS, stops)]
    outs = eng.generate(prompts, params)
    for i, (o, r, s) in enumerate(zip(outs, refs, stops)):
        assert o.token_ids == r, f"prompt {i}: engine {o.token_ids} != HF {r}"
        assert o.finish_reason == ("stop" if r[-1] in (2, *s) else "length")
        assert len(o.logprobs) == len(r)
    return outs, eng


GREEDY = [
    (TREE, 1),
    (TREE3, 3),
    (Strategy.tree((3, 2, 2, 1, 1, 1), 16), 8),
    (Strategy.tree((2, 2, 2, 2, 2, 2), 32), 5),
    (DYN, 3),
    (Strategy.dynamic(6, 4, 32), 8),
    (Strategy.dynamic(5, 2, 9), 1),
]


@pytest.mark.parametrize("strategy,batch", GREEDY, ids=[f"{s.label}-b{b}" for s, b in GREEDY])
def test_greedy_tree_matches_hf(big, strategy, batch):
    outs, eng = greedy_run(big, big[4], lambda b, last: strategy, batch)
    mean_len = float(np.mean([o.stats.acceptance_length for o in outs]))
    assert mean_len > 1.3, f"{strategy.label}: mean acceptance length {mean_len:.2f}"
    assert all(rec.strategy == strategy for rec in eng.history)
    assert max(rec.accepted for rec in eng.history) >= 2  # paths deeper than one node were taken
    assert all(o.stats.drafted == o.stats.target_forwards * strategy.nodes for o in outs)


def test_greedy_random_drafter_and_changing_strategies(big):
    """A poor drafter (most drafts rejected, siblings past rank 0 accepted) and a hook that moves between no SD,
    chains and trees every step: still HF's tokens."""
    _, acc = rank_counts(greedy_run(big, random_eagle3(big[0], draft_vocab_size=24), lambda b, last: TREE3, 4)[1], 3)
    assert acc[0, 1:].sum() > 0, acc[:, :4]
    cycle = itertools.cycle([Strategy.tree((3, 2, 2, 1), 8), 0, 3, Strategy.dynamic(4, 3, 10), 1, TREE3,
                             Strategy.dynamic(6, 4, 32), Strategy.chain(6)])
    _outs, eng = greedy_run(big, big[4], lambda b, last: next(cycle), 5)
    assert {rec.strategy.kind for rec in eng.history} == {"none", "chain", "tree", "dynamic"}


# -- coupled: the same tokens whatever the drafter and shape ------------------------------------------------------
def sampled_run(big, drafter, strategy, rule: str = "coupled", settings=({"temperature": 1.0},), batch: int = 8):
    """16 seeded requests (the 8 prompts twice, at most 24 tokens each; their settings cycled from `settings`) run
    with `strategy` (a Strategy, an int k, or a hook) at batch `batch` (rows finish and are admitted mid-run)."""
    model, prompts, _, _, _ = big
    reqs = [(p, SamplingParams(max_tokens=min(m, 24), seed=100 + 10 * i + j, **settings[(i + j) % len(settings)]))
            for j in range(2) for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
    hook = strategy if callable(strategy) else (lambda b, last: strategy)
    eng = Engine(model, Eagle3Proposer(drafter, model), selector=hook, max_batch=batch, max_seq_len=64, k_max=6,
                 max_tree_nodes=128, verify_rule=rule)
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return [o.token_ids for o in outs], outs


def test_coupled_tokens_do_not_depend_on_drafter_or_shape(big):
    """T = 1, seeded: no SD, a chain, static and dynamic trees (depth 6 and 32 nodes among them, and a hook that
    changes shape every step), with the fit drafter and with a random one over half the vocabulary."""
    fit, poor = big[4], random_eagle3(big[0], draft_vocab_size=24)
    base, _ = sampled_run(big, fit, 0)
    assert len({tuple(t) for t in base}) == len(base)  # sampled: the requests differ
    cycle = itertools.cycle([TREE3, 0, Strategy.tree((2, 2, 2, 2, 2, 2), 32), 3, Strategy.dynamic(6, 4, 32)])
    runs = {
        "chain3": (fit, 3), "tree": (fit, Strategy.tree((3, 2, 2, 1), 8)), "dyn": (fit, Strategy.dynamic(4, 3, 10)),
        "changing": (fit, lambda b, last: next(cycle)),
        "poor tree": (poor, TREE3), "poor dyn": (poor, Strategy.dynamic(6, 4, 32)),
    }
    for name, (drafter, strategy) in runs.items():
        toks, outs = sampled_run(big, drafter, strategy)
        differ = [i for i, (a, b) in enumerate(zip(toks, base)) if a != b]
        assert not differ, f"{name}: requests {differ} differ from no SD"
        assert sum(o.stats.accepted for o in outs) > 0, name
    # the residual rule's tokens do depend on the drafter: this comparison can fail
    residual, _ = sampled_run(big, fit, Strategy.tree((3, 2, 2, 1), 8), rule="residual")
    assert residual != base


# -- logprobs ---------------------------------------------------------------------------------------------------
LOGPROB_CASES = [
    ("residual", Strategy.tree((3, 2, 2, 1), 8), {"temperature": 0.7}),
    ("coupled", Strategy.dynamic(4, 3, 10), {"temperature": 0.7, "top_k": 12}),
    ("residual", Strategy.dynamic(6, 4, 32), {"temperature": 0.7, "top_p": 0.9}),
    ("coupled", Strategy.tree((2, 2, 2, 2, 2, 2), 32), {"temperature": 0.7}),
]


@pytest.mark.parametrize("rule,strategy,setting", LOGPROB_CASES, ids=[f"{r}-{s.label}" for r, s, _ in LOGPROB_CASES])
def test_tree_logprobs_equal_recomputation(big, rule, strategy, setting):
    """logprobs: log_softmax of an HF forward over prompt + response; sampling_logprobs: the same through HF's
    warpers. A quarter of the rows are greedy in the same batch: their tokens are the argmax, their sampling
    logprobs 0."""
    model = big[0]
    _, outs = sampled_run(big, big[4], strategy, rule, (setting, setting, setting, {"temperature": 0.0}))
    assert sum(o.stats.accepted for o in outs) > 0
    warp = warpers(**setting)
    for i, o in enumerate(outs):
        ids = torch.tensor([o.prompt_token_ids + o.token_ids])
        n, g = len(o.prompt_token_ids), len(o.token_ids)
        with torch.no_grad():
            logits = model(ids).logits[0, n - 1 : n - 1 + g].double()
        tok = torch.tensor(o.token_ids)
        raw = torch.log_softmax(logits, -1)[torch.arange(g), tok]
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), raw, atol=1e-4, rtol=0), i
        if (i % 8 + i // 8) % 4 == 3:  # greedy rows
            assert o.token_ids == logits.argmax(-1).tolist() and set(o.sampling_logprobs) == {0.0}, i
        else:
            processed = torch.log_softmax(warp(ids, logits), -1)[torch.arange(g), tok]
            assert torch.allclose(torch.tensor(o.sampling_logprobs, dtype=torch.float64), processed, atol=1e-4,
                                  rtol=0), i


# -- the Strategy value -----------------------------------------------------------------------------------------
ALL = [Strategy.none(), Strategy.chain(1), Strategy.chain(4), TREE, TREE3, Strategy.tree((4, 2, 2, 1, 1, 1), 20),
       DYN, Strategy.dynamic(6, 4, 32), Strategy.dynamic(1, 2, 2)]


@pytest.mark.parametrize("s", ALL, ids=[s.label for s in ALL])
def test_label_round_trip(s):
    back = Strategy.parse(s.label)
    assert back == s and back.kind == s.kind and back.branching == s.branching and back.label == s.label
    assert Strategy.of(s.label) == s


def test_invalid_strategies_raise():
    bad = [
        lambda: Strategy.tree((2, 2), 7),  # more nodes than the full tree (6)
        lambda: Strategy.tree((2, 2), 1),  # fewer nodes than its depth
        lambda: Strategy.tree((2, 0), 3),  # a level with no children
        lambda: Strategy.dynamic(0, 2, 2),
        lambda: Strategy.dynamic(2, 2, 7),  # drafts 2 + 4 = 6 nodes
        lambda: Strategy.chain(-1),
        lambda: Strategy(2, 2, "chain", (1, 2)),
    ]
    for make in bad:
        with pytest.raises(ValueError, match="strategy|k must be"):
            make()
    for label in ("tree3-2", "dyn3x3", "chain", "bogus", "tree3-2n40"):
        with pytest.raises(ValueError, match="strategy"):
            Strategy.parse(label)
    assert Strategy.tree((1, 1, 1), 3) == Strategy.chain(3) and Strategy.tree((1, 1, 1), 3).kind == "chain"


@pytest.mark.parametrize("branching", [(3, 2), (4, 2, 1), (2, 2, 2, 2, 2, 2), (4, 3, 2, 2), (1, 3, 1)])
def test_static_tree_shape(branching):
    full = sum(math.prod(branching[: d + 1]) for d in range(len(branching)))
    previous: set = set()
    for nodes in range(len(branching), full + 1):
        tree = static_tree(branching, nodes)
        assert len(tree) == nodes
        paths, depth = [], []
        for i, (parent, rank) in enumerate(tree, start=1):
            assert 0 <= parent < i  # parents precede children
            d = 0 if parent == 0 else depth[parent - 1]
            assert rank < branching[d]
            depth.append(d + 1)
            paths.append((paths[parent - 1] if parent else ()) + (rank,))
        assert depth == sorted(depth)  # ordered by depth
        assert len(set(paths)) == nodes  # no two nodes in one place
        assert previous <= set(paths)  # a smaller budget's tree is part of a larger one's
        previous = set(paths)
    with pytest.raises(ValueError):
        static_tree(branching, full + 1)


def test_expected_accepted_chain_and_tree():
    rates = [0.8, 0.6, 0.5, 0.4]
    chain = Strategy.chain(4)
    assert expected_accepted(chain, lambda d, r: rates[d]) == pytest.approx(
        sum(math.prod(rates[: j + 1]) for j in range(4)))
    a = 0.7
    assert expected_accepted(Strategy.chain(5), lambda d, r: a) == pytest.approx(a * (1 - a**5) / (1 - a))
    share = [0.45, 0.25, 0.15, 0.1]  # sibling ranks are exclusive: at most one child is accepted

    def accept(d, r):
        return share[r] * 0.9**d

    rng = np.random.default_rng(0)
    for s in (TREE, TREE3, Strategy.tree((4, 3, 2, 2), 20), Strategy.tree((2, 2, 2, 2, 2, 2), 32)):
        child = {(p, r): i + 1 for i, (p, r) in enumerate(zip(s.parents, s.ranks))}
        n = 100_000
        cur, alive, total = np.zeros(n, dtype=int), np.ones(n, dtype=bool), np.zeros(n)
        for d in range(s.depth):
            cdf = np.cumsum([accept(d, r) for r in range(len(share))])
            pick = np.searchsorted(cdf, rng.random(n), side="right")  # len(share): none accepted
            nxt = np.array([child.get((c, r), -1) for c, r in zip(cur, pick)])
            alive &= nxt >= 0
            total += alive
            cur = np.where(alive, nxt, cur)
        want = expected_accepted(s, accept)
        se = total.std() / math.sqrt(n)
        assert abs(total.mean() - want) < 5 * se + 1e-9, (s.label, total.mean(), want, se)
    assert expected_accepted(Strategy.none(), accept) == 0.0


def test_engine_refuses_strategies_it_cannot_run(target):
    eng = Engine(target, DraftModelProposer(small_llama(1)), selector=2, k_max=4, max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match="tree strategy.*draft_model drafter drafts chains only"):
        eng.check_strategy(TREE)
    eng.configure(selector=lambda b, last: TREE)
    with pytest.raises(ValueError, match="chains only"):
        eng.generate([PROMPT], SamplingParams(max_tokens=3))
    eagle = Engine(target, Eagle3Proposer(random_eagle3(target, V), target), k_max=2, max_tree_nodes=12,
                   max_batch=2, max_seq_len=16)
    eagle.check_strategy(TREE)  # fits
    with pytest.raises(ValueError, match=r"tree4-2-1n7 is 3 deep; this engine's k_max is 2"):
        eagle.check_strategy(TREE3)
    with pytest.raises(ValueError, match="max_tree_nodes is 12"):
        eagle.check_strategy(Strategy.dynamic(2, 4, 8))  # drafts 4 + 16 nodes
    with pytest.raises(ValueError, match="at most 16"):
        Engine(target, Eagle3Proposer(random_eagle3(target, V), target), k_max=2, max_tree_nodes=64, max_batch=2,
               max_seq_len=16).check_strategy(Strategy.tree((17,), 17))
    eagle.configure(selector=lambda b, last: TREE3)
    with pytest.raises(ValueError, match="k_max"):
        eagle.generate([PROMPT], SamplingParams(max_tokens=3))
