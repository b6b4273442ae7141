"""Synchronous rounds (drafter_trainer/rounds.py) on a real redis-server and gloo: one contributor is plain
training, a round of two is one AdamW step on their token-weighted gradient (all-reduced), a joiner is caught up
bit for bit in its first round, a member that never answers does not hold the others up, a round whose collective
fails is lost whole within its timeout, and every entry is counted once in the published head."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from tailspec.core import state
from tailspec.drafter_trainer.checkpoint import load_checkpoint
from tailspec.drafter_trainer.lineage import Fence, Lineage
from tailspec.drafter_trainer.training_session import TrainingSession

from tests.test_trainer_session import cfg, frozen_teacher, make_buffer

torch.set_num_threads(1)
CLUSTER = "rt"


def rounds_cfg(tmp_path, **kw):
    return cfg(tmp_path, merge_rule="rounds", **kw)


def session(tmp_path, redis_client, sid: str, **kw) -> TrainingSession:
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    return TrainingSession(rounds_cfg(tmp_path, **kw), frozen_teacher(), make_buffer(), lineage=lin, session_id=sid,
                           merge_every_steps=kw.get("merge_every_steps", 10))


def trainable(s: TrainingSession) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in s.drafter.named_parameters() if p.requires_grad}


def run_together(*sessions: TrainingSession, steps: int) -> None:
    threads = [threading.Thread(target=s.run, kwargs={"max_steps": steps}) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)


def test_one_member_is_plain_sequential_training(tmp_path, redis_client):
    plain = TrainingSession(cfg(tmp_path / "p"), frozen_teacher(), make_buffer(),
                            lineage=Lineage(tmp_path / "p" / "lineage"), session_id="a", merge_every_steps=2)
    plain.run(max_steps=5)
    one = session(tmp_path, redis_client, "a", merge_every_steps=2)
    res = one.run(max_steps=5)
    for n, w in trainable(plain).items():
        assert torch.equal(w, trainable(one)[n]), n
    head = Lineage(tmp_path / "lineage", redis_client, CLUSTER).head()
    assert (head.round, head.steps, res.merged_steps) == (5, 5, 5)


def register(redis_client, *sids: str) -> None:
    """Members as their first entries would register them (waited for from round 1 on)."""
    now = float(redis_client.time()[0])
    for sid in sids:
        redis_client.hset(state.key(CLUSTER, "lineage_members"), sid, json.dumps({"hb": now + 60, "joined": 1}))


def test_a_round_of_two_is_one_adamw_step_on_their_token_weighted_gradient(tmp_path, redis_client):
    a = session(tmp_path, redis_client, "a", round_wait=50.0)
    b = session(tmp_path, redis_client, "b", round_wait=50.0)
    register(redis_client, "a", "b")
    w0 = trainable(a)
    sent = {}
    for x in (a, b):  # each member's gradient as it enters the round (per-token mean)
        def capture(s, scale, share, tokens, _step=x.rounds.step):
            sent[s.session_id] = ({n: p.grad.detach().clone() * scale for n, p in s.drafter.named_parameters()
                                   if p.requires_grad}, tokens)
            _step(s, scale, share, tokens)
        x.rounds.step = capture
    run_together(a, b, steps=1)
    entries = json.loads(redis_client.hget(state.key(CLUSTER, "lineage_rounds"), "1:in"))
    assert sorted(e["s"] for e in entries) == ["a", "b"]
    assert {e["s"]: e["t"] for e in entries} == {k: t for k, (_, t) in sent.items()}
    total = sum(t for _, t in sent.values())
    grads = {}
    for g, t in sent.values():
        for n, x in g.items():
            grads[n] = grads.get(n, 0) + x.double() * t / total
    c = a.cfg
    ref = {n: torch.nn.Parameter(w.clone()) for n, w in w0.items()}
    for n, p in ref.items():
        p.grad = grads[n].float()
    torch.nn.utils.clip_grad_norm_(list(ref.values()), c.grad_clip)
    opt = torch.optim.AdamW(list(ref.values()), lr=c.lr * 2, betas=(c.beta1, 0.95), weight_decay=c.weight_decay)
    opt.step()
    head = Lineage(tmp_path / "lineage", redis_client, CLUSTER).head()
    published = load_checkpoint(head.path).drafter.state_dict()
    for n, p in ref.items():
        assert torch.allclose(published[n], p.detach(), atol=1e-6, rtol=0), n
        assert torch.equal(trainable(a)[n], trainable(b)[n]), n
    assert head.steps == 2 and head.round == 1


def test_members_stay_identical_and_every_entry_is_counted_once(tmp_path, redis_client):
    a = session(tmp_path, redis_client, "a", merge_every_steps=2, round_wait=50.0)
    b = session(tmp_path, redis_client, "b", merge_every_steps=2, round_wait=50.0)
    register(redis_client, "a", "b")
    run_together(a, b, steps=6)
    assert a.rounds.rounds == b.rounds.rounds == 6 and a.rounds.late == b.rounds.late == 0
    wa, wb = trainable(a), trainable(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    sa, sb = a.backend.state_dict()["state"], b.backend.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    head = lin.head()
    assert head.steps == 12 == a.merged_steps + b.merged_steps
    assert {k: v for k, v in lin.contributions().items() if v} == {"a": a.merged_steps, "b": b.merged_steps}
    published = load_checkpoint(head.path).drafter.state_dict()
    assert all(torch.equal(published[n], wa[n]) for n in wa)
    assert a.rounds.exchange.built == 1  # one group for the two, kept across their rounds


def test_a_joiner_is_caught_up_in_its_first_round_bit_for_bit(tmp_path, redis_client):
    a = session(tmp_path, redis_client, "a", merge_every_steps=100, round_wait=50.0)
    a.rounds.join(a)
    for _ in range(3):  # the only member: each round closes at its entry; nothing is published (merge_every 100)
        a.train_step()
    assert Lineage(tmp_path / "lineage", redis_client, CLUSTER).head().round == 0
    b = session(tmp_path, redis_client, "b", merge_every_steps=100, round_wait=50.0)
    b.rounds.join(b)
    assert b.rounds.next == 1 and a.rounds.next == 4  # b holds the head; a holds rounds 1..3
    register(redis_client, "a", "b")
    run_together(a, b, steps=1)  # round 4: b receives a's state, then both apply the round
    assert b.rounds.next == a.rounds.next == 5 and b.step == a.step == 5
    wa, wb = trainable(a), trainable(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    sa, sb = a.backend.state_dict()["state"], b.backend.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    assert all(torch.equal(sa[i]["step"], sb[i]["step"]) for i in sa)
    b.merge(final=True)  # rounds 1..4 published (a closed round 4): a's three and the shared one, each counted once
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    assert lin.head().steps == 5 and {k: v for k, v in lin.contributions().items() if v} == {"a": 4, "b": 1}


def test_a_member_gone_silent_holds_a_round_only_to_its_deadline_and_its_late_entry_counts_once(tmp_path,
                                                                                                 redis_client):
    a = session(tmp_path, redis_client, "a", round_wait=5.0, merge_every_steps=100)
    b = session(tmp_path, redis_client, "b", round_wait=5.0, merge_every_steps=100)
    a.rounds.join(a)
    b.rounds.join(b)
    register(redis_client, "a", "b")
    first = [threading.Thread(target=x.train_step) for x in (a, b)]  # round 1 together
    for t in first:
        t.start()
    for t in first:
        t.join(timeout=60)
    waited = a.rounds.waited_s
    redis_client.hset(state.key(CLUSTER, "lineage_members"), "b",  # b's heartbeat as its entry left it
                      json.dumps({"hb": float(redis_client.time()[0]), "joined": 1}))
    for _ in range(3):  # b is waited for and computes nothing: each round closes at its deadline
        a.train_step()
    assert a.rounds.next == 5 and 0 < a.rounds.waited_s - waited < 5.0
    # b's next gradient was for round 2, long closed: it goes into the open round, where a catches b up (b's entry
    # waits there, or moves on with it, for a round a is in)
    run_together(a, b, steps=2)
    assert b.rounds.late >= 1 and a.rounds.failed == b.rounds.failed == 0
    assert all(torch.equal(trainable(a)[n], trainable(b)[n]) for n in trainable(a))
    a.merge(final=True)
    b.merge(final=True)
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    assert lin.head().steps == 2 + 3 + 4 == a.merged_steps + b.merged_steps
    assert {k: v for k, v in lin.contributions().items() if v} == {"a": a.merged_steps, "b": b.merged_steps}


def test_a_joiner_is_not_waited_for_before_its_first_entry(tmp_path, redis_client):
    a = session(tmp_path, redis_client, "a", round_wait=50.0, merge_every_steps=100)
    b = session(tmp_path, redis_client, "b", round_wait=50.0, merge_every_steps=100)
    a.rounds.join(a)
    b.rounds.join(b)  # caught up, computing nothing yet: a's rounds close at a's own entries
    for _ in range(2):
        a.train_step()
    assert a.rounds.next == 3 and a.rounds.waited_s < 1.0


def test_an_entry_without_the_lease_is_refused(tmp_path, redis_client):
    s = session(tmp_path, redis_client, "a")
    s.lineage.fence = Fence("n0", 0, 7)  # no such lease in Redis
    res = s.run(max_steps=3)
    assert s.fenced_out and res.merged_steps == 0
    assert Lineage(tmp_path / "lineage", redis_client, CLUSTER).head().steps == 0


def test_rounds_need_redis_and_the_torch_backend(tmp_path):
    # deferred: the Rounds constructor is what refuses; the session never builds one without Redis
    from tailspec.drafter_trainer.rounds import Rounds

    with pytest.raises(ValueError, match="needs Redis"):
        Rounds(Lineage(tmp_path / "l"), "a", rounds_cfg(tmp_path))


def test_a_round_log_lost_with_redis_continues_from_the_head(tmp_path, redis_client):
    a = session(tmp_path, redis_client, "a", merge_every_steps=100)
    head0 = {n: w.clone() for n, w in trainable(a).items()}
    a.rounds.join(a)
    a.train_step()  # round 1, applied, not published (merge_every 100)
    assert not all(torch.equal(head0[n], w) for n, w in trainable(a).items())
    redis_client.delete(state.key(CLUSTER, "lineage_rounds"))  # Redis restarted without the log
    a.train_step()  # its entry is for round 2, the log restarts at 1: continue from the head (round 0)
    assert a.rounds.next == 1 and all(torch.equal(head0[n], w) for n, w in trainable(a).items())
    assert a.rounds._await(a, 7) is None  # a round that is not in the log is not waited for
    assert a.rounds.next == 1


def test_a_round_whose_collective_fails_is_lost_whole_within_its_timeout(tmp_path, redis_client):
    """b's entry is in the round, then b never meets the group (as if SIGKILLed there): a's rendezvous times out, the
    round is decided failed, a's weights are those before it, and a's next round goes on."""
    # round_wait 5 x a step: b's entry reaches round 1 even when its thread starts late on a loaded machine, so the
    # round cannot close on a's entry alone
    a = session(tmp_path, redis_client, "a", round_wait=5.0, round_timeout_s=1.0, merge_every_steps=100)
    b = session(tmp_path, redis_client, "b", round_wait=5.0, round_timeout_s=1.0, merge_every_steps=100)
    a.rounds.join(a)
    b.rounds.join(b)
    register(redis_client, "a", "b")
    b.rounds._exchange = lambda *args: time.sleep(3.0)  # in the round, never in its collective
    w0 = trainable(a)
    tb = threading.Thread(target=b.train_step)
    tb.start()
    t0 = time.monotonic()
    a.train_step()
    took = time.monotonic() - t0
    tb.join(timeout=30)
    rounds = state.key(CLUSTER, "lineage_rounds")
    assert redis_client.hget(rounds, "1:commit") == b"0" and a.rounds.failed == 1 and a.rounds.next == 2
    assert all(torch.equal(w0[n], w) for n, w in trainable(a).items())
    assert took < 1.0 + 1.0 + 10.0  # rendezvous timeout + vote timeout + a step on a loaded machine
    b.rounds.leave(b)
    a.train_step()  # alone now: round 2 applies
    assert a.rounds.rounds == 1 and a.rounds.next == 3
    assert not all(torch.equal(w0[n], w) for n, w in trainable(a).items())


def test_a_leaving_members_rounds_decided_lost_are_not_counted_as_merged(tmp_path, redis_client):
    """a applies rounds 1..3 alone (head at round 2) and leaves, as on a revocation; before its last publish, b's
    first round finds no live holder of round 3, decides it lost and publishes a head from round 2 that covers
    round 3's number without holding it. a's merged steps are then what the lineage credits it with."""
    a = session(tmp_path, redis_client, "a", merge_every_steps=2)
    a.rounds.join(a)
    for _ in range(3):  # the only member: rounds 1 and 2 published, round 3 applied only
        a.train_step()
    b = session(tmp_path, redis_client, "b", merge_every_steps=2)  # from the head at round 2
    a.rounds.leave(a)
    b.train_step()  # round 4: round 3's holder is gone, so it is lost; b publishes from the head
    rounds = state.key(CLUSTER, "lineage_rounds")
    assert redis_client.hget(rounds, "4:mode") == b"lost" and redis_client.hget(rounds, "3:commit") == b"2"
    a.merge(final=True)  # finds b's head past its rounds
    b.merge(final=True)
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    assert lin.head().steps == 3 == a.merged_steps + b.merged_steps
    assert {k: v for k, v in lin.contributions().items() if v} == {"a": 2, "b": 1} == \
        {"a": a.merged_steps, "b": b.merged_steps}


def test_a_leaving_member_does_not_publish_a_round_decided_lost(tmp_path, redis_client):
    """a applies rounds 1..3 alone (head at round 2) and leaves; the next member's round decides round 3 lost
    (_MODE marks its commit 2) before a's last publish. a must not publish weights that hold round 3, which the
    others went on without: it takes the head, and the lineage credits it rounds 1 and 2 only."""
    a = session(tmp_path, redis_client, "a", merge_every_steps=2)
    a.rounds.join(a)
    for _ in range(3):
        a.train_step()
    lin = Lineage(tmp_path / "lineage", redis_client, CLUSTER)
    assert lin.head().round == 2
    a.rounds.leave(a)
    redis_client.hset(state.key(CLUSTER, "lineage_rounds"), "3:commit", 2)  # what _MODE writes for a lost round
    a.merge(final=True)
    assert lin.head().round == 2 and lin.head().steps == 2
    assert a.merged_steps == 2 == lin.contributions()["a"]
