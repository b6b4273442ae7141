"""The rollout engine on CUDA as a rollout worker runs it, with its graph pool captured and attached: a batch of
repeated prompts of mixed lengths (the prefill plan: each distinct prompt prefilled once, its repeats copied by
slot, the drafter's state too) decodes what each request decodes alone, and greedy output matches HF `generate`
on the same device. The CPU suite checks the same through the eager path and the pool's CPU emulation; here the
CUDA KV cache (zeroed at allocation), the slot copies on the device and the replayed graphs are under test.
Self-contained (no helpers from other test modules): benchmarks/gpu_checks.sh runs it from outside the checkout
against the installed package."""

from __future__ import annotations

import pytest
import torch
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.graph_pool import build_pool
from tailspec.rollout.sequence import SamplingParams

from tailspec.tasks.policy import build_model
from tailspec.tasks.runsum import sample_problems
from tailspec.tasks.tokenizer import build_tokenizer, encode_prompt

pytestmark = pytest.mark.gpu
BUCKETS, KS = [1, 2, 4, 8, 16], [0, 1, 2, 3]


@pytest.fixture(scope="module")
def policy():
    return build_model("micro").to("cuda").eval()  # random init (seeded by the preset): no pre-training needed


def group_batch(n_prompts: int = 5, group: int = 3, seed: int = 7) -> list[list[int]]:
    tok = build_tokenizer()
    base = [encode_prompt(tok, p.prompt) for p in sample_problems(n_prompts, seed=seed)]
    base[0] = base[0] + base[1] + base[2]  # a long prompt among short ones
    return [p for p in base for _ in range(group)]


def random_eagle3(target, draft_vocab_size: int = 16):
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module, vocab_maps_from_counts

    torch.manual_seed(0)
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab_size)
    d = Eagle3Module(cfg, target.get_input_embeddings())
    d.set_vocab_maps(*vocab_maps_from_counts(torch.rand(target.config.vocab_size), draft_vocab_size))
    return d.to("cuda").eval()


def pooled_engine(policy, drafter_kind: str, max_batch: int, rule: str = "residual",
                  record_states: bool = False) -> tuple[Engine, object]:
    drafter = {"none": None, "draft_model": DraftModelProposer(policy),
               "eagle3": Eagle3Proposer(random_eagle3(policy), target=policy)}[drafter_kind]
    eng = Engine(policy, drafter, selector=0 if drafter is None else 2, max_batch=max_batch, max_seq_len=256,
                 k_max=3, verify_rule=rule, record_states=record_states)
    cost = CostModel(BUCKETS, KS, {(b, k): 0.001 * (1 + b * (k + 1) / 64) for b in BUCKETS for k in KS})
    pool = build_pool(eng, cost, budget_bytes=1 << 34)
    assert pool.enabled and pool.graphs and eng.verify_forward == pool.forward
    return eng, pool


@pytest.mark.parametrize("rule", ["coupled", "residual"])
@pytest.mark.parametrize("drafter_kind", ["none", "draft_model", "eagle3"])
def test_gpu_repeated_prompts_decode_as_each_alone(policy, drafter_kind, rule):
    prompts = group_batch()
    sp = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    eng, pool = pooled_engine(policy, drafter_kind, len(prompts) + 1, rule)  # 16: one padding row at first
    together = eng.generate(prompts, sp)
    assert pool.replays > 0 and pool.eager == 0
    alone = [pooled_engine(policy, drafter_kind, 1, rule)[0].generate([p], [s])[0] for p, s in zip(prompts, sp)]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff <= 1e-3, diff
    assert len({tuple(o.token_ids) for o in together[:3]}) > 1  # copies of one prompt are other samples


def test_gpu_greedy_matches_hf_generate(policy):
    prompts = group_batch(n_prompts=4, group=2, seed=3)
    eng, pool = pooled_engine(policy, "draft_model", len(prompts))
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    assert pool.replays > 0 and pool.eager == 0
    eos = policy.config.eos_token_id
    for p, o in zip(prompts, outs):
        ref = policy.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                              device="cuda"), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()


def test_gpu_recorded_targets_match_the_policys_forward(policy):
    """The training targets a rollout ships (rollout/states.py), recorded through the replayed graphs, against the
    policy's own forward over each finished sequence on the device (what a session's teacher computes)."""
    from tailspec.drafter_trainer.model import capture_aux

    prompts = group_batch()
    eng, pool = pooled_engine(policy, "eagle3", len(prompts) + 1, "coupled", record_states=True)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=24, seed=100 + i) for i in range(len(prompts))])
    assert pool.replays > 0
    ids = eng.drafter.aux_layer_ids
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.token_ids], device="cuda")
        with torch.no_grad(), capture_aux(policy, ids) as got:
            logits = policy(input_ids=seq, use_cache=False).logits.float()
        aux, lg = o.states
        n = seq.shape[1]
        torch.testing.assert_close(aux, got[-1][0, : n - 1].cpu(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(lg, logits[0, len(p) - 1 : n - 1].cpu(), rtol=1e-3, atol=1e-3)
