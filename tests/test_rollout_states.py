"""The rollout's recorded training targets (rollout/states.py) against the teacher's own forward over the finished
sequence (drafter_trainer.teacher: the HF model with capture_aux), the reference a session would otherwise run."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import micro_policy, random_eagle3, task_prompts
from tailspec.core.state import Sample
from tailspec.drafter_trainer.teacher import Teacher, collate
from tailspec.rollout.drafters import Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams


@pytest.fixture(scope="module")
def policy():
    return micro_policy()[0]


@pytest.mark.parametrize("k", [0, 3])
def test_recorded_states_match_the_teachers_forward(policy, k):
    drafter = random_eagle3(policy)
    prompts = task_prompts(5, seed=11)
    prompts = prompts + prompts[:2] + [prompts[0]]  # repeated prompts: the prefill plan's slot copies
    eng = Engine(policy, Eagle3Proposer(drafter, target=policy), selector=k, max_batch=8, max_seq_len=160,
                 k_max=4, record_states=True)
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    outs = eng.generate(prompts, params)  # rows finish at different steps: compaction moves the buffers
    teacher = Teacher(policy, drafter.config.aux_layer_ids)
    samples = [Sample(prompt_ids=p, response_ids=o.token_ids, reward=0.0, policy_version=0) for p, o in zip(prompts, outs)]
    ref = teacher(collate(samples))
    for b, (p, o) in enumerate(zip(prompts, outs)):
        aux, logits = o.states
        n, P, G = len(p) + len(o.token_ids), len(p), len(o.token_ids)
        assert aux.shape == (n - 1, ref.aux.shape[-1]) and logits.shape == (G, policy.config.vocab_size)
        torch.testing.assert_close(aux, ref.aux[b, : n - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, ref.logits[b, P - 1 : n - 1], rtol=1e-4, atol=1e-4)


def test_record_states_needs_an_aux_drafter(policy):
    with pytest.raises(ValueError, match="record_states"):
        Engine(policy, None, record_states=True)


def test_no_states_unless_asked(policy):
    eng = Engine(policy, Eagle3Proposer(random_eagle3(policy), target=policy), selector=2, max_seq_len=96)
    (out,) = eng.generate(task_prompts(1), SamplingParams(max_tokens=8, seed=1))
    assert out.states is None and eng.recorder is None
