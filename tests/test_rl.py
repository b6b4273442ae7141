import numpy as np
import pytest
import torch

from tailspec.rl import Rollout, group_advantages, grpo_step, recompute_logprobs, save_policy_weights
from tailspec.tasks.policy import build_model, build_tokenizer, load_policy


def test_group_advantages_by_hand():
    r = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    g = np.array([0, 0, 0, 0, 1, 1, 1])
    adv = group_advantages(r, g)
    # group 0: mean 0.5, std 0.5 → ±1; group 1: no signal → 0
    np.testing.assert_allclose(adv, [1, -1, 1, -1, 0, 0, 0], atol=1e-5)


def _model():
    tok = build_tokenizer()
    return build_model("micro", tok), tok


def test_recompute_logprobs_matches_stepwise_forward():
    model, tok = _model()
    prompt, resp = [1, 30, 5, 16], [31, 15, 5, 11, 2]
    ro = Rollout(prompt, resp, [0.0] * len(resp), 0.0, 0)
    ro2 = Rollout(prompt[:2], resp[:3], [0.0] * 3, 0.0, 0)  # different length in the same batch (padding)
    got = recompute_logprobs(model, [ro, ro2], tok.pad_token_id)
    want = []
    with torch.no_grad():
        for t in range(len(resp)):
            logits = model(torch.tensor([prompt + resp[:t]])).logits[0, -1]
            want.append(torch.log_softmax(logits, -1)[resp[t]].item())
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    assert len(got[1]) == 3


def test_grpo_step_moves_probability_toward_rewarded_response():
    model, tok = _model()
    prompt = [1, 30, 5, 16]
    good, bad = [31, 15, 5, 2], [32, 16, 6, 2]
    rollouts = []
    for resp, reward in [(good, 1.0), (bad, 0.0)] * 4:
        ro = Rollout(prompt, resp, [0.0] * len(resp), reward, 0)
        ro.logprobs = recompute_logprobs(model, [ro], tok.pad_token_id)[0]
        rollouts.append(ro)

    def seq_logp(resp):
        return sum(recompute_logprobs(model, [Rollout(prompt, resp, [0.0] * len(resp), 0, 0)], tok.pad_token_id)[0])

    before = seq_logp(good) - seq_logp(bad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = grpo_step(model, opt, rollouts, tok.pad_token_id, minibatch=8)
    after = seq_logp(good) - seq_logp(bad)
    assert after > before + 0.1
    assert stats.mean_reward == 0.5 and stats.tokens == 8 * 4 and stats.clip_fraction == 0.0


def test_no_signal_no_update():
    model, tok = _model()
    before = [p.detach().clone() for p in model.parameters()]
    ro = [Rollout([1, 30], [31, 2], [-1.0, -1.0], 1.0, 0) for _ in range(3)]
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), ro, tok.pad_token_id)
    assert stats.tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_save_policy_weights_is_loadable_and_replaces(tmp_path):
    model, tok = _model()
    out = save_policy_weights(model, tok, tmp_path / "policy")
    m2, _ = load_policy(out)
    ids = torch.tensor([[1, 30, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)
        for p in model.parameters():
            p.add_(0.01)
    save_policy_weights(model, tok, out)
    m3, _ = load_policy(out)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, m3(ids).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_grpo_step_rejects_a_temperature_without_a_sampling_distribution():
    import pytest

    model, tok = _model()
    ro = [Rollout([1, 30], [31, 2], [-1.0, -1.0], float(i % 2), 0) for i in range(2)]
    with pytest.raises(ValueError, match="temperature"):
        grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), ro, tok.pad_token_id, temperature=0.0)


def _policy_logprobs_at(model, prompt, response, temperature):
    """Independent of tailspec.rl: one unpadded HF forward per sequence, logits / T, log-softmax."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_grpo_ratio_at_temperature_compares_the_sampling_distribution(tmp_path, redis_url):
    """At T = 0.7 the old logprobs the RL loop gets from a rollout worker and the new ones `grpo_step` computes
    are the same distribution's (the policy at T): for the unchanged policy of the first step the ratio is 1,
    so the recomputation equals the rollout's logprobs, and the clipped objective's update equals the plain
    policy gradient sum(A * grad log p_T) / tokens computed independently. (Raw T = 1 logprobs on one side made
    the ratio p_T / p_1: a different update, and clipped tokens.)"""
    from tailspec.core.config import RolloutConfig

    from tailspec.demo.protocol import WorkItem, WorkRequest
    from tailspec.demo.worker import Worker
    from tailspec.tasks.tokenizer import encode_prompt

    T = 0.7
    model, tok = _model()
    torch.manual_seed(0)
    with torch.no_grad():  # a peaked distribution, where temperature matters
        model.lm_head.weight.mul_(20.0)
    path = save_policy_weights(model, tok, tmp_path / "policy")
    prompts = [encode_prompt(tok, p) for p in ("3+4+1=", "7+7=", "2+9+5+1=", "8=")]
    reqs = [WorkRequest(rid=i, prompt_ids=prompts[i // 2], seed=100 + i) for i in range(8)]
    item = WorkItem(step=0, policy_path=str(path), temperature=T, max_tokens=24, requests=reqs,
                    rollout=RolloutConfig(max_seq_len=64, cuda_graphs=False).model_dump(mode="json"))
    worker = Worker("w0", 0, redis_url, "rltest", "node0")
    try:
        res = worker.run_item(item)
    finally:
        worker.client.close()
    outs = sorted(res.outputs, key=lambda o: o.rid)
    assert len(outs) == 8 and all(len(o.token_ids) > 0 for o in outs)
    # the RL loop's rollouts, as the demo builds them: rewards that differ inside each group
    rollouts = [Rollout(reqs[o.rid].prompt_ids, o.token_ids, o.logprobs, float(o.rid % 2), o.rid // 2) for o in outs]

    with torch.no_grad():
        ref = [_policy_logprobs_at(model, r.prompt_ids, r.response_ids, T) for r in rollouts]
        raw = [_policy_logprobs_at(model, r.prompt_ids, r.response_ids, 1.0) for r in rollouts]
    gap = max(float((a - b).abs().max()) for a, b in zip(ref, raw))
    assert gap > 0.05, f"T = {T} barely changes this policy's logprobs ({gap}): the test would not see a mix-up"
    for r, want in zip(rollouts, ref):
        np.testing.assert_allclose(r.logprobs, want.numpy(), atol=1e-4)
    for r, got in zip(rollouts, recompute_logprobs(model, rollouts, tok.pad_token_id, temperature=T)):
        np.testing.assert_allclose(got, r.logprobs, atol=1e-4)

    # the independent policy gradient at ratio 1
    adv = group_advantages(np.array([r.reward for r in rollouts]), np.array([r.group for r in rollouts]))
    ntok = sum(len(r.response_ids) for r in rollouts)
    model.zero_grad(set_to_none=True)
    loss = -sum(float(a) * _policy_logprobs_at(model, r.prompt_ids, r.response_ids, T).sum()
                for a, r in zip(adv, rollouts)) / ntok
    loss.backward()
    want = [p.grad.detach().clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), rollouts, tok.pad_token_id,
                      minibatch=len(rollouts), temperature=T, max_grad_norm=1e9)
    assert stats.clip_fraction == 0.0 and stats.tokens == ntok
    got = torch.cat([(b - p.detach()).ravel() for b, p in zip(before, model.parameters())])
    want = torch.cat([g.ravel() for g in want])
    assert float((got - want).norm()) <= 1e-3 * float(want.norm()), float((got - want).norm() / want.norm())


def _kl_setup():
    import copy

    model, tok = _model()
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():  # move the policy away from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [1, 30, 5, 16]
    ro = [Rollout(prompt, resp, [0.0] * len(resp), 1.0, 0) for resp in ([31, 15, 5, 2], [32, 16, 6, 11, 2])]
    for r in ro:
        r.logprobs = recompute_logprobs(model, [r], tok.pad_token_id)[0]
    return model, ref, tok, ro


def test_kl_term_value_is_the_k3_estimate_against_the_reference():
    model, ref, tok, ro = _kl_setup()  # equal rewards: no policy-gradient signal, the KL term alone
    new = recompute_logprobs(model, ro, tok.pad_token_id)
    old = recompute_logprobs(ref, ro, tok.pad_token_id)
    d = [r - n for a, b in zip(new, old) for n, r in zip(a, b)]
    want = float(np.mean([np.exp(x) - x - 1 for x in d]))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = grpo_step(model, opt, ro, tok.pad_token_id, kl_coef=0.5, ref_model=ref)
    assert stats.tokens == 9 and want > 1e-3
    np.testing.assert_allclose(stats.kl, want, rtol=1e-4)
    np.testing.assert_allclose(stats.loss, 0.5 * want, rtol=1e-4)


def test_kl_term_pulls_the_policy_toward_the_reference():
    model, ref, tok, ro = _kl_setup()

    def kl_now():
        return grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), ro, tok.pad_token_id,
                         kl_coef=1.0, ref_model=ref).kl

    before = kl_now()
    # without kl_coef, equal rewards carry no signal: nothing moves
    assert grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), ro, tok.pad_token_id).tokens == 0
    assert kl_now() == before
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(10):
        grpo_step(model, opt, ro, tok.pad_token_id, kl_coef=1.0, ref_model=ref)
    assert kl_now() < 0.25 * before
    with pytest.raises(ValueError):
        grpo_step(model, opt, ro, tok.pad_token_id, kl_coef=0.1)


def test_length_sorted_parts_give_the_minibatchs_update():
    """A minibatch accumulated over length-sorted parts of 2 updates the policy as the minibatch taken at
    once (the reference: micro_batch=None), KL term included; the statistics agree too."""
    import copy

    model, tok = _model()
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    ro = []
    for i in range(8):
        resp = [int(x) for x in rng.integers(5, 30, size=int(rng.integers(2, 12)))] + [2]
        r = Rollout([1, 30, int(rng.integers(5, 30))], resp, [0.0] * len(resp), float(i % 3 == 0), i // 4)
        r.logprobs = recompute_logprobs(model, [r], tok.pad_token_id)[0]
        ro.append(r)
    results = {}
    for micro in (None, 2):
        m = copy.deepcopy(model)
        stats = grpo_step(m, torch.optim.SGD(m.parameters(), lr=0.5), ro, tok.pad_token_id, minibatch=8,
                          kl_coef=0.3, ref_model=ref, micro_batch=micro)
        results[micro] = (stats, [p.detach() for p in m.parameters()])
    (s_whole, p_whole), (s_parts, p_parts) = results[None], results[2]
    assert s_whole.tokens == s_parts.tokens > 0
    np.testing.assert_allclose(s_parts.loss, s_whole.loss, rtol=1e-5)
    np.testing.assert_allclose(s_parts.kl, s_whole.kl, rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(p_whole, model.parameters()))
    for a, b in zip(p_parts, p_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
