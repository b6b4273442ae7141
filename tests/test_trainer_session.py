"""Sessions: train, checkpoint, resume; stop within the deadline at every point of a step; drafter versions."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tailspec.core import state
from tailspec.core.config import TrainerConfig
from tailspec.core.state import DrafterVersion, Sample
from tailspec.drafter_trainer.checkpoint import list_checkpoints, load_latest
from tailspec.drafter_trainer.samples import SampleBuffer, SampleReader
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.versions import VersionStore

from tests.test_trainer_model import make_target

torch.set_num_threads(1)
DEADLINE_S = 1.0


def synthetic_samples(n: int, seed: int = 0, version: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(4, 21)
        resp = [(start + j * rng.choice((1, 2))) % 17 + 4 for j in range(rng.randrange(8, 20))]
        out.append(Sample(prompt_ids=[1, rng.randrange(4, 21), rng.randrange(4, 21)], response_ids=resp,
                          reward=float(rng.random() < 0.5), policy_version=version, group_id=str(i // 4)))
    return out


def frozen_teacher() -> Teacher:
    """A 4-layer random target, frozen, as the teacher (aux layers 1, 2, 3)."""
    target = make_target(layers=4)
    for p in target.parameters():
        p.requires_grad_(False)
    return Teacher(target, (1, 2, 3))


@pytest.fixture
def teacher():
    return frozen_teacher()


def make_buffer(n=64, holdout=0.0) -> SampleBuffer:
    buf = SampleBuffer(capacity=1000, holdout_fraction=holdout)
    for s in synthetic_samples(n):
        buf.add(s)
    return buf


def cfg(tmp_path, **kw) -> TrainerConfig:
    base = dict(batch_size=4, lr=1e-3, checkpoint_dir=str(tmp_path / "ck"), draft_vocab_size=16)
    return TrainerConfig(**{**base, **kw})


def params(d) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in d.state_dict().items()}


def test_train_checkpoint_resume_is_the_same_as_uninterrupted(tmp_path, teacher):
    buf = make_buffer()
    a = TrainingSession(cfg(tmp_path / "a"), teacher, buf)
    r1 = a.run(max_steps=3)
    assert r1.steps == 3 and r1.checkpoint is not None and r1.stop_reason == "max_steps"
    b = TrainingSession(cfg(tmp_path / "a"), teacher, buf)  # resumes from the checkpoint
    assert b.step == 3 and b.resumed_from == r1.checkpoint
    b.run(max_steps=2)
    ref = TrainingSession(cfg(tmp_path / "ref"), teacher, buf)
    ref.run(max_steps=5)
    # Same data order (seeded per step) and the optimizer state restored → bitwise the same weights.
    pa, pr = params(b.drafter), params(ref.drafter)
    for k in pr:
        assert torch.equal(pa[k], pr[k]), k
    assert len(list_checkpoints(tmp_path / "a" / "ck")) <= 2
    assert load_latest(tmp_path / "a" / "ck").step == 5


def count_checks(session: TrainingSession) -> int:
    n = 0
    orig = session._check

    def counting():
        nonlocal n
        n += 1
        orig()

    session._check = counting
    session.train_step()
    session._check = orig
    return n


def test_stop_is_honoured_at_every_check_point(tmp_path, teacher):
    buf = make_buffer()
    probe = TrainingSession(cfg(tmp_path / "probe", ttt_length=3), teacher, buf)
    per_step = count_checks(probe)
    assert per_step >= 3 + 3  # after teacher, each unroll step, after loss, after backward
    # Reference weights after 1 and 2 whole steps.
    refs = {}
    for n in (1, 2):
        ref = TrainingSession(cfg(tmp_path / f"ref{n}", ttt_length=3), teacher, buf)
        ref.run(max_steps=n)
        refs[n] = params(ref.drafter)
    # run() checks once at the top of each iteration, then per_step times inside the step: stop at every
    # check point of the 2nd iteration (→ 1 whole step) and at the top of the 3rd (→ 2 whole steps).
    for at in range(per_step + 2, 2 * per_step + 4):
        s = TrainingSession(cfg(tmp_path / f"s{at}", ttt_length=3), teacher, buf)
        calls = 0
        orig = s._check

        def check():
            nonlocal calls
            calls += 1
            if calls == at:
                s.request_stop("test")
            orig()

        s._check = check
        res = s.run(max_steps=5)
        assert res.stop_reason == "test", at
        assert res.stop_latency_s is not None and res.stop_latency_s < DEADLINE_S
        # The interrupted step left no trace: the saved weights are those of the whole steps.
        done = res.total_steps
        assert done == (2 if at == 2 * per_step + 3 else 1), at
        ck = load_latest(tmp_path / f"s{at}" / "ck")
        assert ck.step == done
        for k, v in refs[done].items():
            assert torch.equal(ck.drafter.state_dict()[k], v), (at, k)


def test_stop_from_another_thread_within_deadline(tmp_path, teacher):
    buf = make_buffer()
    rng = random.Random(1)
    latencies = []
    for i in range(8):
        s = TrainingSession(cfg(tmp_path / f"t{i}"), teacher, buf)
        timer = threading.Timer(rng.uniform(0.0, 0.3), s.request_stop, args=("revoked",))
        timer.start()
        res = s.run(max_seconds=30)
        timer.join()
        assert res.stop_reason == "revoked"
        latencies.append(res.stop_latency_s)
        s.close()
    assert max(latencies) < DEADLINE_S, latencies


def test_should_continue_false_stops_the_session(tmp_path, teacher):
    go = True
    reports = []

    def on_step(step, loss, tokens):
        nonlocal go
        reports.append((step, loss, tokens))
        go = step < 2

    s = TrainingSession(cfg(tmp_path), teacher, make_buffer(), should_continue=lambda: go, on_step=on_step,
                        report_every_s=0)
    res = s.run(max_steps=100)
    assert res.stop_reason == "should_continue" and res.steps == 2
    assert [r[0] for r in reports][-1] == 2 and all(r[1] > 0 and r[2] > 0 for r in reports)
    assert res.stop_latency_s < DEADLINE_S


def test_should_continue_is_asked_inside_a_step(tmp_path, teacher):
    """A lease revoked mid-step is noticed at the step's next check point (every check point reads
    should_continue(), a local flag): the step is abandoned (no optimizer update) instead of running to its end
    past the deadline."""
    calls = 0

    def should_continue():
        nonlocal calls
        calls += 1
        return calls <= 1  # True at the top of the first step, False at its first check point inside

    s = TrainingSession(cfg(tmp_path), teacher, make_buffer(), should_continue=should_continue)
    before = [p.detach().clone() for p in s.params]
    res = s.run(max_steps=100)
    assert res.stop_reason == "should_continue" and res.steps == 0 and calls >= 2
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, s.params))  # the step left no update


def test_session_reads_the_stream_and_waits_for_samples(tmp_path, teacher, redis_client):
    buf = SampleBuffer(capacity=1000, holdout_fraction=0.0)
    reader = SampleReader(redis_client, "c", buf, vocab_size=21, max_seq_len=64)
    key = state.key("c", "samples")

    def feed():
        time.sleep(0.3)
        for smp in synthetic_samples(20):
            state.append(redis_client, key, smp)
        redis_client.xadd(key, {"data": b"garbage"})

    threading.Thread(target=feed).start()
    s = TrainingSession(cfg(tmp_path), teacher, buf, reader=reader, poll_every_steps=1)
    res = s.run(max_steps=3)  # the buffer is empty at first: the session waits instead of failing
    assert res.steps == 3 and len(buf) == 20
    assert redis_client.hget(state.key("c", "dropped"), "trainer_malformed") == b"1"


def test_versions_promote_only_better_candidates(tmp_path, teacher, redis_client):
    buf = make_buffer(200, holdout=0.2)
    holdout = list(buf.holdout)
    store = VersionStore(tmp_path / "versions", redis_client, "c")
    s = TrainingSession(cfg(tmp_path, lr=3e-3), teacher, buf)
    untrained = s.drafter
    v1 = store.propose(untrained, teacher, holdout, k=3, session_id="s0")
    assert v1.promoted and v1.baseline_acceptance_length is None  # nothing to beat yet
    s.run(max_steps=40)
    # every held-out sample scored (the interim look at min_pairs would compare on a subset of them)
    v2 = store.propose(s.drafter, teacher, holdout, k=3, session_id=s.session_id, min_pairs=len(holdout))
    assert v2.acceptance_length > v1.acceptance_length
    assert v2.promoted and v2.baseline_acceptance_length == pytest.approx(v1.acceptance_length)
    # A worse candidate (the untrained one again) is recorded but not promoted.
    v3 = store.propose(untrained, teacher, holdout, k=3)
    assert not v3.promoted
    assert store.current().version == v2.version
    assert [v.version for v in store.history()] == [1, 2, 3]
    raw = redis_client.get(state.key("c", "drafter_current"))
    assert state.decode(DrafterVersion, raw).version == 2
    loaded, info = store.load(2, teacher.embedding())
    assert info.version == 2 and torch.equal(loaded.fc.weight, s.drafter.fc.weight)
    # Without Redis the same records live in the directory.
    local = VersionStore(tmp_path / "local")
    local.propose(untrained, teacher, holdout, k=3)
    assert local.current().version == 1 and len(local.history()) == 1


def test_a_loaded_optimizer_state_keeps_this_sessions_hyperparameters():
    """A head's optimizer state carries its writer's lr; the session's own config wins."""
    import torch
    from tailspec.core.config import TrainerConfig
    from tailspec.drafter_trainer.backends import TorchBackend

    p = [torch.nn.Parameter(torch.ones(3))]
    writer = TorchBackend(p, TrainerConfig(lr=5e-2, beta1=0.5))
    p[0].grad = torch.ones(3)
    writer.optimizer.step()
    reader = TorchBackend([torch.nn.Parameter(torch.ones(3))], TrainerConfig(lr=1e-3))
    reader.load_state_dict(writer.state_dict())
    g = reader.optimizer.param_groups[0]
    assert g["lr"] == 1e-3 and g["betas"] == (0.9, 0.95)
    assert int(reader.optimizer.state[reader.params[0]]["step"]) == 1  # the moments came along


def _grads_of_one_step(tmp_path, teacher, buf, **kw) -> tuple[dict[str, torch.Tensor], float]:
    """The (scaled) gradient the optimizer would step on in the session's first step, and its loss."""
    s = TrainingSession(cfg(tmp_path, batch_size=8, **kw), teacher, buf)
    seen = {}

    def apply(scale=1.0, lr_scale=1.0):
        seen.update({n: p.grad.detach().clone() * scale for n, p in s.drafter.named_parameters() if p.grad is not None})

    s.backend.apply = apply
    loss, _, _ = s.train_step()
    return seen, loss


def test_micro_batches_step_on_the_whole_batchs_gradient(tmp_path, teacher):
    """Length-sorted micro-batches of 2 accumulate the gradient and loss of the batch of 8 taken at once
    (the reference: the same session code with micro_batch_size 0)."""
    buf = make_buffer()
    whole, loss_whole = _grads_of_one_step(tmp_path / "whole", teacher, buf)
    micro, loss_micro = _grads_of_one_step(tmp_path / "micro", teacher, buf, micro_batch_size=2)
    assert whole and whole.keys() == micro.keys()
    assert loss_micro == pytest.approx(loss_whole, rel=1e-5)
    for n in whole:
        torch.testing.assert_close(micro[n], whole[n], rtol=1e-4, atol=1e-7, msg=n)


class _SeenTeacher:
    """The session's teacher, keeping the batches it is called on."""

    def __init__(self, teacher: Teacher, seen: list):
        self.inner, self.seen = teacher, seen

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, batch, check=None):
        self.seen.append(batch)
        return self.inner(batch, check)


def test_a_step_cut_short_is_a_random_part_of_the_batch_at_a_proportional_lr(tmp_path, teacher):
    """A stop after the first micro-batch steps on a random part of the batch (the micro-batches are formed by
    length but run in random order, so short responses are not favoured), at lr x that part's share of the
    batch's tokens; the next step is back at the configured lr."""
    from tailspec.drafter_trainer.loss import step_token_counts
    from tailspec.drafter_trainer.teacher import collate

    buf = make_buffer()
    firsts, shortest = [], []
    for i in range(8):
        s = TrainingSession(cfg(tmp_path / f"r{i}", batch_size=8, micro_batch_size=2, seed=i), teacher, buf)
        lrs, parts = [], []
        step = s.backend.optimizer.step
        s.backend.optimizer.step = lambda *a, **k: (lrs.append(s.backend.optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
        s.teacher = _SeenTeacher(s.teacher, parts)
        accumulate = s.backend.accumulate
        s.backend.accumulate = lambda loss, _a=accumulate, _s=s: (_a(loss), _s.request_stop("test"))
        s.train_step()
        samples, w = buf.batch(8, random.Random((s.cfg.seed * 1_000_003 + 0) * 1009))
        whole = collate(samples, w)
        done = step_token_counts(parts[0].lengths, parts[0].prompt_lens, s.cfg.ttt_length)[0]
        total = step_token_counts(whole.lengths, whole.prompt_lens, s.cfg.ttt_length)[0]
        assert s.partial_steps == 1 and lrs == [pytest.approx(s.cfg.lr * done / total)]
        assert s.backend.optimizer.param_groups[0]["lr"] == s.cfg.lr
        firsts.append(sorted(parts[0].lengths.tolist()))
        shortest.append(sorted(whole.lengths.tolist())[:2])
    assert any(f != sh for f, sh in zip(firsts, shortest))  # not always the two shortest


def test_a_stop_after_a_micro_batch_still_takes_the_step(tmp_path, teacher):
    """A lend shorter than a step still trains: stopped after the first of four micro-batches, the session
    steps on it, saves that step and leaves within the deadline; stopped before any, nothing changes."""
    buf = make_buffer()
    s = TrainingSession(cfg(tmp_path / "a", batch_size=8, micro_batch_size=2), teacher, buf)
    before = params(s.drafter)
    accumulate = s.backend.accumulate

    def accumulate_then_stop(loss):
        accumulate(loss)
        s.request_stop("test")

    s.backend.accumulate = accumulate_then_stop
    res = s.run(max_steps=5)
    assert res.stop_reason == "test" and res.total_steps == 1 and s.partial_steps == 1
    assert res.stop_latency_s is not None and res.stop_latency_s < DEADLINE_S
    ck = load_latest(tmp_path / "a" / "ck")
    assert ck.step == 1
    assert any(not torch.equal(ck.drafter.state_dict()[k], v) for k, v in before.items())

    calls = 0

    def should_continue():
        nonlocal calls
        calls += 1
        return calls <= 1

    t = TrainingSession(cfg(tmp_path / "b", batch_size=8, micro_batch_size=2), teacher, buf,
                        should_continue=should_continue)
    start = [p.detach().clone() for p in t.params]
    res = t.run(max_steps=5)
    assert res.steps == 0 and t.partial_steps == 0
    assert all(torch.equal(a, p.detach()) for a, p in zip(start, t.params))


def test_a_stop_inside_the_teachers_forward_leaves_at_the_next_layer(tmp_path, teacher):
    """A stop requested while the teacher's first decoder layer runs is seen before the second one: the rest of
    the forward does not run, and the step in flight leaves no update."""
    s = TrainingSession(cfg(tmp_path), teacher, make_buffer())
    layers = teacher.model.model.layers
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda _m, _i, _o, j=j: ran.append(j)) for j, layer in enumerate(layers)]
    stop = layers[0].register_forward_hook(lambda *_: s.request_stop("revoked"))
    before = params(s.drafter)
    try:
        res = s.run(max_steps=5)
    finally:
        for h in (*handles, stop):
            h.remove()
    assert res.stop_reason == "revoked" and res.steps == 0
    assert ran == [0], ran  # layers 1-3 never ran
    assert all(torch.equal(s.drafter.state_dict()[k], v) for k, v in before.items())


def test_a_validation_stops_inside_the_teachers_forward(teacher):
    """Validation batches check inside the teacher's forward too: a check that raises at the third call (two
    before the batch and its first layer, then the second layer) leaves the forward after one layer."""
    from tailspec.drafter_trainer.loss import StopRequested
    from tailspec.drafter_trainer.validation import validate

    s = TrainingSession(TrainerConfig(batch_size=4, draft_vocab_size=16), teacher, make_buffer())
    layers = teacher.model.model.layers
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda _m, _i, _o, j=j: ran.append(j)) for j, layer in enumerate(layers)]
    calls = 0

    def check():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise StopRequested("revoked")

    try:
        with pytest.raises(StopRequested):
            validate(s.drafter, teacher, synthetic_samples(8, seed=3), k=2, batch_size=4, check=check)
    finally:
        for h in handles:
            h.remove()
    assert ran == [0], ran


def test_a_sessions_merges_write_its_moments_every_nth_time_and_when_it_stops(tmp_path, teacher):
    """merge_moments_every = 2, a merge every 2 steps, 5 steps: the merges after steps 2 and 4 carry the head's
    moments and write the session's own on the second; the stop merges step 5 and writes them, so the head it
    leaves holds this session's AdamW state, bit for bit."""
    # deferred: only this test needs the lineage and its checkpoint reader
    from tailspec.drafter_trainer.checkpoint import load_checkpoint
    from tailspec.drafter_trainer.lineage import Lineage

    lin = Lineage(tmp_path / "lineage")
    carried: list[bool] = []
    merge = lin.merge

    def spy(*a, **kw):
        if "carry_moments" in kw:  # a session's merge (seeding the lineage is the other caller)
            carried.append(kw["carry_moments"])
        return merge(*a, **kw)

    lin.merge = spy
    s = TrainingSession(cfg(tmp_path, merge_moments_every=2), teacher, make_buffer(), lineage=lin, merge_every_steps=2)
    s.run(max_steps=5)
    assert carried == [True, False, False]
    head = load_checkpoint(lin.head().path, teacher.embedding())
    own = s.backend.state_dict()["state"]
    for i, st in head.optimizer_state["state"].items():
        assert torch.equal(st["exp_avg"], own[i]["exp_avg"]) and torch.equal(st["exp_avg_sq"], own[i]["exp_avg_sq"])


def test_a_stop_inside_the_backward_leaves_at_the_next_unroll_step(tmp_path, teacher):
    """The lease is gone once the backward has begun: the backward pass's own check (at each unroll step) raises
    `Preempted` out of it, and the step leaves no update; a micro-batched step cut inside its second micro-batch's
    backward is abandoned whole (its gradient would be partial), not taken on the first."""
    from tailspec.drafter_trainer.training_session import Preempted

    for micro in (0, 2):
        seen: dict = {"bw": False, "raised": None, "calls": 0}

        def should_continue():
            return not seen["bw"]

        s = TrainingSession(cfg(tmp_path / f"m{micro}", batch_size=8, micro_batch_size=micro), teacher,
                            make_buffer(), should_continue=should_continue)
        inner = s.backend.step if not micro else s.backend.accumulate

        def backward(loss, *a):
            seen["calls"] += 1
            seen["bw"] = seen["calls"] >= (2 if micro else 1)  # micro-batched: inside the second micro-batch's
            try:
                inner(loss, *a)
            except Exception as e:
                seen["raised"] = e
                raise

        if micro:
            s.backend.accumulate = backward
        else:
            s.backend.step = backward
        before = [p.detach().clone() for p in s.params]
        res = s.run(max_steps=3)
        assert isinstance(seen["raised"], Preempted), seen
        assert res.steps == 0 and res.stop_reason == "should_continue" and s.partial_steps == 0
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, s.params))
