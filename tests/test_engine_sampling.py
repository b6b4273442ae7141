"""Speculative sampling is exact: the engine's first three tokens follow the target's own processed
distribution, enumerated independently (HF forward + HF's logits warpers), for poor and good drafters —
and deliberately broken acceptance rules fail the very same check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tailspec.rollout import sampling
from tailspec.rollout.drafters import DraftModelProposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

V = 8
PROMPT = [1, 3]
N = 20_000
ALPHA = 1e-3

SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7-p0.9": dict(temperature=0.7, top_p=0.9),
    "k5": dict(temperature=1.0, top_k=5),
}


def small_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return small_llama(0)


@pytest.fixture(scope="module")
def poor() -> LlamaForCausalLM:
    return small_llama(1)  # another random model: q far from p (total variation ~0.3 per token)


def enumerate_joint(model: LlamaForCausalLM, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """Exact P(x1, x2, x3 | prompt) [V, V, V] from one HF forward over all V^2 two-token prefixes."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    pre = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V^2, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), pre], 1)
    with torch.no_grad():
        logits = model(ids).logits.double()
    n = len(PROMPT)

    def proc(x):
        return warpers(ids, x).softmax(-1)

    p1 = proc(logits[:1, n - 1])[0]  # [V]
    p2 = proc(logits[::V, n])  # rows with x2 = 0: [V (x1), V]
    p3 = proc(logits[:, n + 1]).view(V, V, V)  # [x1, x2, V]
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def engine_samples(target, drafter, k: int, setting: dict, verify_rule: str = "residual", n: int = N) -> np.ndarray:
    eng = Engine(target, drafter, selector=k, max_batch=n, max_seq_len=len(PROMPT) + 3, k_max=k, verify_rule=verify_rule)
    params = [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **setting) for i in range(n)]
    outs = eng.generate([PROMPT] * n, params)
    toks = np.array([o.token_ids for o in outs])
    assert toks.shape == (n, 3)
    return toks


def check(toks: np.ndarray, joint: np.ndarray) -> tuple[bool, float, float, float]:
    """(passes, chi-square p-value, total variation, TV bound) of N = len(toks) samples [N, 3] against `joint`.

    TV bound: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) (Jensen per cell), and TV moves by at most 1/N when
    one sample changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2); t = sqrt(ln(1/ALPHA) / 2N).
    """
    n = len(toks)
    p = joint.ravel()
    counts = np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V**3).astype(float)
    expected = p * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        if counts[~big].sum() > 0:  # an outcome the target never produces
            return False, 0.0, 1.0, 0.0
    pval = float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    bound = 0.5 * float(np.sqrt(p * (1 - p) / n).sum()) + math.sqrt(math.log(1 / ALPHA) / (2 * n))
    return (pval > ALPHA and tv < bound), pval, tv, bound


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter_kind", ["poor", "good"])
def test_speculative_sampling_is_exact(target, poor, setting, drafter_kind):
    torch.set_num_threads(2)
    drafter = DraftModelProposer(poor if drafter_kind == "poor" else target)
    joint = enumerate_joint(target, **SETTINGS[setting])
    toks = engine_samples(target, drafter, k=2, setting=SETTINGS[setting])
    ok, pval, tv, bound = check(toks, joint)
    assert ok, f"{setting}/{drafter_kind}: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


def test_deterministic_drafts_are_exact(target):
    """n-gram drafts (q one-hot) take the other branch of the acceptance rule."""
    joint = enumerate_joint(target, temperature=1.0)
    ok, pval, tv, bound = check(engine_samples(target, NgramProposer(), k=2, setting=SETTINGS["t1.0"]), joint)
    assert ok, f"chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


def _always_accept(p, q, drafts, u_accept, u_sample):
    B, K1, _ = p.shape
    bonus = sampling.sample(p[:, -1], u_sample[:, -1])
    return torch.cat([drafts, bonus[:, None]], 1), torch.full((B,), K1 - 1, dtype=torch.long)


def _resample_impl(p, q, drafts, u_accept, u_sample):
    """Right acceptance test, wrong correction: draws from p instead of normalize(max(0, p - q))."""
    B, K1, _ = p.shape
    k = K1 - 1
    px = p[:, :k].gather(-1, drafts[..., None])[..., 0].double()
    qx = q.gather(-1, drafts[..., None])[..., 0].double()
    n_acc = (u_accept * qx < px).long().cumprod(-1).sum(-1)
    final = sampling.sample(p[torch.arange(B), n_acc], u_sample.gather(-1, n_acc[:, None])[:, 0])
    tokens = torch.cat([drafts, drafts[:, :1]], 1).scatter_(1, n_acc[:, None], final[:, None])
    return tokens, n_acc


@pytest.mark.parametrize("broken", [_always_accept, _resample_impl], ids=["always-accept", "resample-from-p"])
def test_broken_acceptance_rule_fails_the_same_check(target, poor, monkeypatch, broken):
    joint = enumerate_joint(target, temperature=1.0)
    monkeypatch.setattr(sampling, "verify", broken)
    ok, pval, tv, bound = check(engine_samples(target, DraftModelProposer(poor), k=2, setting=SETTINGS["t1.0"]), joint)
    assert not ok, f"a broken rule passed: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter_kind", ["poor", "good", "ngram"])
def test_coupled_sampling_is_exact(target, poor, setting, drafter_kind):
    """The drafter-invariant rule passes the same enumerated check as the residual one."""
    torch.set_num_threads(2)
    drafter = {"poor": DraftModelProposer(poor), "good": DraftModelProposer(target), "ngram": NgramProposer()}[drafter_kind]
    joint = enumerate_joint(target, **SETTINGS[setting])
    toks = engine_samples(target, drafter, k=2, setting=SETTINGS[setting], verify_rule="coupled")
    ok, pval, tv, bound = check(toks, joint)
    assert ok, f"{setting}/{drafter_kind}: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"


@pytest.mark.parametrize("setting", ["t1.0", "t0.7-p0.9"])
def test_coupled_tokens_do_not_depend_on_drafter_or_k(target, poor, setting):
    """Under the coupled rule a request's tokens are a function of its seed and the target alone: no drafter,
    a poor one, a perfect one and n-gram drafts at several k give the same tokens, request by request."""
    n = 2000
    runs = {
        "no SD": engine_samples(target, None, 0, SETTINGS[setting], "coupled", n),
        "poor k=1": engine_samples(target, DraftModelProposer(poor), 1, SETTINGS[setting], "coupled", n),
        "poor k=3": engine_samples(target, DraftModelProposer(poor), 3, SETTINGS[setting], "coupled", n),
        "good k=2": engine_samples(target, DraftModelProposer(target), 2, SETTINGS[setting], "coupled", n),
        "ngram k=2": engine_samples(target, NgramProposer(), 2, SETTINGS[setting], "coupled", n),
    }
    for name, toks in runs.items():
        assert np.array_equal(toks, runs["no SD"]), f"{name}: {(toks != runs['no SD']).any(1).sum()} of {n} differ"
    residual = engine_samples(target, DraftModelProposer(poor), 2, SETTINGS[setting], "residual", n)
    assert not np.array_equal(residual, runs["no SD"])  # the residual rule's tokens do depend on the drafter


def test_coupled_acceptance_is_below_residual_and_above_its_bound(target, poor):
    """Per-draft acceptance of a poor drafter at k=1: coupled <= residual (1 - TV is the most an exact rule
    can accept) and >= (1 - TV) / (1 + TV), the Gumbel coupling's guarantee (TV of the first token)."""
    n = 8000
    joint = enumerate_joint(target, temperature=1.0)
    q_joint = enumerate_joint(poor, temperature=1.0)
    tv = 0.5 * float(np.abs(joint.sum((1, 2)) - q_joint.sum((1, 2))).sum())
    rates = {}
    for rule in ("residual", "coupled"):
        eng = Engine(target, DraftModelProposer(poor), selector=1, max_batch=n, max_seq_len=len(PROMPT) + 2, k_max=1,
                     verify_rule=rule)
        outs = eng.generate([PROMPT] * n, [SamplingParams(max_tokens=1, seed=i, ignore_eos=True) for i in range(n)])
        rates[rule] = sum(o.stats.accepted for o in outs) / n
    slack = 4 * math.sqrt(0.25 / n)
    assert rates["coupled"] <= rates["residual"] + slack, rates
    assert abs(rates["residual"] - (1 - tv)) < slack, (rates, tv)
    assert rates["coupled"] >= (1 - tv) / (1 + tv) - slack, (rates, tv)


def _race_without_positions(key, pos, vocab):
    """A broken coupling: every position races with the first position's noise."""
    g = _true_race_noise(key, pos[:, :1], vocab)
    return g.expand(-1, pos.shape[1], -1)


_true_race_noise = sampling.race_noise


def test_coupled_rule_with_shared_noise_fails_the_same_check(target, poor, monkeypatch):
    joint = enumerate_joint(target, temperature=1.0)
    monkeypatch.setattr(sampling, "race_noise", _race_without_positions)
    toks = engine_samples(target, DraftModelProposer(poor), 2, SETTINGS["t1.0"], "coupled")
    ok, pval, tv, bound = check(toks, joint)
    assert not ok, f"a broken coupling passed: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"
