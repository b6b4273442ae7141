import numpy as np
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
