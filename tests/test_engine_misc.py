"""Engine contracts beyond token equality: logprobs under SD, seeds independent of the batch, bad input
refused before any compute, and the EAGLE-3 adapter matching drafter_trainer.model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import micro_policy, noisy_copy, random_eagle3, random_micro, task_prompts
from tailspec.rollout import model_runner
from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams

from tailspec.tasks.policy import build_model


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(2)
    return micro_policy()[0]


@pytest.fixture(scope="module")
def prompts():
    return task_prompts(8, seed=11)


def teacher_forced_logprobs(model, prompt, tokens, temperature=1.0):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_logprobs_equal_plain_decoding(policy, prompts):
    sp = SamplingParams(max_tokens=30, temperature=0.0)
    plain = Engine(policy, None, max_batch=4, max_seq_len=160).generate(prompts, sp)
    for drafter in (DraftModelProposer(policy), DraftModelProposer(random_micro(3)), NgramProposer()):
        spec = Engine(policy, drafter, selector=4, max_batch=4, max_seq_len=160).generate(prompts, sp)
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids
            diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
            assert diff <= 1e-4, f"{drafter.name}: logprob difference {diff}"
            assert all(x == 0.0 for x in b.sampling_logprobs)  # greedy: the processed distribution is one-hot


@pytest.mark.parametrize("drafter_kind", ["good", "poor"])
def test_sampled_logprobs_equal_teacher_forced(policy, prompts, drafter_kind):
    """Under SD at temperature 0.7, every emitted token's logprob is the policy's own (raw and processed),
    as a plain teacher-forced HF forward over the same tokens computes it."""
    drafter = DraftModelProposer(policy if drafter_kind == "good" else random_micro(3))
    sp = [SamplingParams(max_tokens=30, temperature=0.7, seed=i) for i in range(len(prompts))]
    outs = Engine(policy, drafter, selector=3, max_batch=4, max_seq_len=160).generate(prompts, sp)
    assert sum(o.stats.accepted for o in outs) > 0
    for p, o in zip(prompts, outs):
        raw = teacher_forced_logprobs(policy, p, o.token_ids)
        proc = teacher_forced_logprobs(policy, p, o.token_ids, temperature=0.7)
        assert (raw - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max().item() <= 1e-4
        assert (proc - torch.tensor(o.sampling_logprobs, dtype=torch.float64)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("drafter_name", ["none", "draft_model", "ngram"])
def test_same_seed_same_output_regardless_of_batch(policy, prompts, drafter_name):
    def drafter():
        return {"none": None, "draft_model": DraftModelProposer(noisy_copy(policy)), "ngram": NgramProposer()}[drafter_name]

    k = 0 if drafter_name == "none" else 3
    target = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=1234)
    alone = Engine(policy, drafter(), selector=k, max_batch=1, max_seq_len=160).generate([prompts[0]], target)[0]
    # the same request in the middle of a crowd with other params and seeds, admitted later, other batch size
    others = [SamplingParams(max_tokens=25, temperature=0.8, top_k=5, seed=i) for i in range(6)]
    crowd_prompts = prompts[1:4] + [prompts[0]] + prompts[4:7]
    params = others[:3] + [target] + others[3:]
    crowd = Engine(policy, drafter(), selector=k, max_batch=3, max_seq_len=160).generate(crowd_prompts, params)[3]
    assert crowd.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(crowd.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    other_seed = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=99)
    differ = Engine(policy, drafter(), selector=k, max_batch=1, max_seq_len=160).generate([prompts[0]], other_seed)[0]
    assert differ.token_ids != alone.token_ids  # the seed matters (40 sampled tokens: a collision is negligible)


def test_bad_input_rejected_before_any_compute(policy, monkeypatch):
    calls = []
    real = model_runner.ModelRunner.forward
    monkeypatch.setattr(model_runner.ModelRunner, "forward", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    eng = Engine(policy, NgramProposer(), selector=2, max_batch=4, max_seq_len=64)
    V = policy.config.vocab_size
    good = [1, 5, 6]
    cases = [
        ([], SamplingParams(), "empty prompt"),
        ([1] * 60, SamplingParams(max_tokens=10), "exceeds the cache"),
        ([1] * 65, SamplingParams(max_tokens=1), "exceeds the cache"),
        ([1, V], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2.5], SamplingParams(), "outside the vocabulary"),
        (good, SamplingParams(max_tokens=0), "max_tokens"),
        (good, SamplingParams(max_tokens=8, temperature=-1.0), "temperature"),
        (good, SamplingParams(max_tokens=8, temperature=float("nan")), "temperature"),
        (good, SamplingParams(max_tokens=8, top_p=0.0), "top_p"),
        (good, SamplingParams(max_tokens=8, top_k=-2), "top_k"),
        (good, SamplingParams(max_tokens=8, stop_token_ids=(V + 3,)), "stop token ids"),
        (good, SamplingParams(max_tokens=8, seed=-5), "seed"),
    ]
    for prompt, sp, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.add_request(prompt, sp)
    # one bad request in a list: nothing is queued, nothing runs
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([good, good, [1, V + 7]], SamplingParams(max_tokens=5))
    assert not eng.has_unfinished() and calls == []
    assert len(eng.generate([good], SamplingParams(max_tokens=5))[0].token_ids) >= 1 and calls  # the hook works


def test_misfit_drafters_rejected_at_construction(policy):
    from transformers import LlamaConfig, LlamaForCausalLM

    other_vocab = LlamaForCausalLM(LlamaConfig(vocab_size=policy.config.vocab_size + 5, hidden_size=32,
                                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(policy, DraftModelProposer(other_vocab), selector=2)
    bigger = build_model("tiny")  # hidden 256 / 4 layers: an EAGLE-3 head made for it does not fit micro
    with pytest.raises(ValueError, match="hidden_size"):
        Engine(policy, Eagle3Proposer(random_eagle3(bigger)), selector=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(policy, None, selector=3)


def test_eagle3_adapter_matches_the_module(policy):
    """Our drafter forward equals drafter_trainer.model's cached forward, and after every engine step the
    adapter's pending first-draft logits equal the module run from scratch (no cache) over the row's
    whole history of (target aux state, next token) pairs — the catch-up bookkeeping is right."""
    from tailspec.drafter_trainer.model import DrafterCache, capture_aux

    head = random_eagle3(policy)
    ad = Eagle3Proposer(head)
    ad.setup(2, 64, torch.device("cpu"))
    cache = DrafterCache.allocate(head.config, 2, 64)
    H = head.config.hidden_size
    hid, ids = torch.randn(2, 6, H), torch.randint(0, policy.config.vocab_size, (2, 6))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        ref_logits, ref_out = head(hid, ids, pos, cache, torch.tensor([0, 1]))
    out = ad.step(hid, ids, pos)
    logits = ad.head(out)
    assert torch.allclose(logits, ref_logits, atol=1e-5) and torch.allclose(out, ref_out, atol=1e-5)

    def selector(batch_size, last):  # k = 2, 0, 3, 2, 0, 3, ... by step
        return [2, 0, 3][(last.step if last is not None else 0) % 3]

    eng = Engine(policy, Eagle3Proposer(head), selector=selector, max_batch=3, max_seq_len=128)
    for p in task_prompts(3, seed=2):
        eng.add_request(p, SamplingParams(max_tokens=40, temperature=1.0, seed=len(p)))
    checked = 0
    for _ in range(12):
        eng.step()
        s = eng.slots
        for row in range(s.n):
            L = int(s.ints[row, 0])
            toks = s.tokens[row, :L].tolist()
            with torch.no_grad(), capture_aux(policy, head.config.aux_layer_ids) as got:
                policy(torch.tensor([toks[:-1]]))
                pos = torch.arange(L - 1)[None]
                lg, _ = head(head.project(got[0]), torch.tensor([toks[1:]]), pos)
            assert torch.allclose(eng.drafter.next_logits[row], lg[0, -1], atol=1e-4), f"row {row} at length {L}"
            checked += 1
    assert checked >= 12


def test_hash_arithmetic_and_table_step_uniforms():
    """The counter-based uniforms: the 32-bit multiply is exact (both the wrapping and the split form), and
    a step's uniforms read in one gather from the per-request table hashed at admission are the same
    numbers as one hash call per stream."""
    import random

    from tailspec.rollout import sampling

    rng = random.Random(0)
    xs = [rng.randrange(2**32) for _ in range(2000)] + [0, 2**32 - 1]
    x = torch.tensor(xs, dtype=torch.long)
    for c in (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F):
        want = [(v * c) % 2**32 for v in xs]
        assert sampling._mul32(x, c).tolist() == want
        assert sampling._mul32_split(x, c).tolist() == want
    key = sampling.seed_mix(torch.tensor([3, 2**40 + 7, 0], dtype=torch.long))
    lengths = torch.tensor([5, 17, 300])
    for k in (0, 1, 4):
        pos = lengths[:, None] + torch.arange(k + 1)
        u_draft, u_acc, u_smp = sampling.step_uniforms_from(sampling.uniform_table(key, 310), lengths, k)
        assert torch.equal(u_draft, sampling.uniforms(key, pos[:, :k], sampling.DRAFT))
        assert torch.equal(u_acc, sampling.uniforms(key, pos[:, :k], sampling.ACCEPT))
        assert torch.equal(u_smp, sampling.uniforms(key, pos, sampling.SAMPLE))
        assert ((u_smp >= 0) & (u_smp < 1)).all()


def test_step_seconds_cover_the_finishing_of_requests(policy, prompts, monkeypatch):
    """A step's recorded seconds are what the step cost the rollout, handing out its finished requests included:
    the adaptive selector's cost model learns from them, and finishing is a large share of a step on a GPU."""
    import time

    eng = Engine(policy, None, max_batch=2, max_seq_len=128)
    finish = eng._finish

    def slow_finish(done, stopped):
        time.sleep(0.05)
        return finish(done, stopped)

    monkeypatch.setattr(eng, "_finish", slow_finish)
    outs = eng.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(outs) == 2
    assert eng.last.seconds >= 0.05  # the step that finished the last request paid for finishing it
