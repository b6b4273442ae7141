"""RL fidelity across seeds: GRPO on the tiny policy with rollouts from the plain engine and from the
speculative engine give reward curves that agree within sampling noise, and a broken acceptance rule fails
the same check.

The test (stated, as the demo issue asks): for each of SEEDS seeds, two GRPO runs of STEPS steps start from
the same weights and optimizer seed, one rolling out with plain decoding and one with speculative decoding
whose drafter changes between steps (n-gram, then a draft model at two draft lengths — as co-training swaps
drafter versions during RL). Every (seed, step) gives one paired difference of mean rewards
(PROMPTS × GROUP samples each). Under "SD is lossless" the differences have mean 0; a two-sided paired
t-test over the SEEDS × STEPS differences must not reject at p = 0.001. The same check run with an
always-accept rule (samples from the drafter, not the policy) must reject.

Why not the demo's co-trained run itself: with sessions, workers and Redis one seed takes minutes on 2
cores; the losslessness being tested is the engine's, and the drafter changing between steps is the part of
co-training that could break it.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from tailspec.rollout import sampling
from tailspec.rollout.drafters import DraftModelProposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams

from tailspec.rl import Rollout, grpo_step
from tailspec.tasks.policy import get_policy, load_policy
from tailspec.tasks.runsum import grade, sample_problems
from tailspec.tasks.tokenizer import decode_response, encode_prompt
from tests.test_engine_sampling import _always_accept

pytestmark = pytest.mark.slow

SEEDS, STEPS, PROMPTS, GROUP = 4, 3, 8, 4
MAX_SEQ = 640
# two-sided t quantile at p = 0.001 with SEEDS * STEPS - 1 = 11 degrees of freedom
T_CRIT = 4.437


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    policy, tok = load_policy(get_policy("tiny", progress=False))
    draft, _ = load_policy(get_policy("micro", progress=False))
    return policy, draft, tok


def reward_curve(policy, draft, tok, seed: int, spec: bool) -> list[float]:
    model = copy.deepcopy(policy)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)
    drafters = [(lambda: NgramProposer(), 3), (lambda: DraftModelProposer(draft), 2), (lambda: DraftModelProposer(draft), 4)]
    curve = []
    for step in range(STEPS):
        problems = sample_problems(PROMPTS, seed=seed * 1000 + step)
        prompts = [encode_prompt(tok, p.prompt) for p in problems for _ in range(GROUP)]
        params = [SamplingParams(max_tokens=MAX_SEQ - len(p), temperature=1.0, seed=seed * 100_000 + step * 1000 + i)
                  for i, p in enumerate(prompts)]
        make, k = drafters[step % len(drafters)]
        engine = Engine(model, make() if spec else None, selector=k if spec else 0, max_batch=len(prompts),
                        max_seq_len=MAX_SEQ, k_max=k if spec else 0, seed=seed)
        outs = engine.generate(prompts, params)
        rollouts = [
            Rollout(p, o.token_ids, o.sampling_logprobs, grade(problems[i // GROUP], decode_response(tok, o.token_ids)).reward,
                    i // GROUP)
            for i, (p, o) in enumerate(zip(prompts, outs))
        ]
        curve.append(float(np.mean([r.reward for r in rollouts])))
        grpo_step(model, opt, rollouts, tok.pad_token_id)
    return curve


_PLAIN: dict[int, np.ndarray] = {}  # the plain curves, computed once for both tests (they never touch `verify`)


def paired_t(models) -> tuple[float, np.ndarray, np.ndarray]:
    policy, draft, tok = models
    key = id(models)
    if key not in _PLAIN:
        _PLAIN[key] = np.array([reward_curve(policy, draft, tok, s, spec=False) for s in range(SEEDS)])
    plain = _PLAIN[key]
    spec = np.array([reward_curve(policy, draft, tok, s, spec=True) for s in range(SEEDS)])
    d = (spec - plain).ravel()
    sd = float(d.std(ddof=1))
    t = float(d.mean()) / (sd / math.sqrt(d.size)) if sd > 0 else (0.0 if d.mean() == 0 else math.inf)
    return t, plain, spec


def test_reward_curves_of_plain_and_speculative_rl_agree_across_seeds(models):
    t, plain, spec = paired_t(models)
    assert 0.1 < plain.mean() < 0.95, plain  # the policy is imperfect: rewards carry signal
    assert abs(t) < T_CRIT, f"t={t:.2f}; plain per step {plain.mean(0)}, speculative per step {spec.mean(0)}"


def test_a_broken_acceptance_rule_fails_the_same_check(models, monkeypatch):
    monkeypatch.setattr(sampling, "verify", _always_accept)
    t, plain, spec = paired_t(models)
    assert abs(t) >= T_CRIT, f"a broken rule passed: t={t:.2f}; plain {plain.mean(0)}, speculative {spec.mean(0)}"
