"""`tailspec.session_entry.run_session` (what `ENTRY.run` runs) under a real lease: trains from the cluster's
samples, reports, stops on revoke within the deadline, checkpoints, and proposes candidates to the version store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import DrafterVersion, LineageHead, PhaseInfo, Sample, SessionInfo
from tailspec.scheduler.leases import Leases
from tailspec.scheduler.session_process import SessionContext

from tailspec.session_entry import run_session

torch.set_num_threads(1)
# Long enough to cover loading the teacher on a busy 2-core machine (start-up renews between phases).
TTL_S = 10.0


@pytest.fixture(scope="module")
def micro_samples():
    from tests.trainer_data import policy_samples

    return policy_samples("micro", n=96, seed=3)


def test_run_session_trains_until_revoked(redis_client, redis_url, tmp_path, micro_samples):
    path, samples = micro_samples
    cluster = "rs"
    cfg = TailspecConfig.model_validate({
        "cluster": {"name": cluster, "redis_url": redis_url},
        "trainer": {"checkpoint_dir": str(tmp_path / "drafter"), "batch_size": 8, "lr": 3e-3,
                    "validate_every_s": 1.0, "validation_samples": 16, "holdout_fraction": 0.2},
    })
    state.put(redis_client, state.key(cluster, "phase"),
              PhaseInfo(phase="rollout", step=1, started_at=time.time(), policy_version=1, policy_path=str(path)))
    for s in samples:
        state.append(redis_client, state.key(cluster, "samples"), s)
    leases = Leases(redis_client, cluster)

    def one_session(sid: str, min_steps: int, extra_s: float) -> tuple[dict, float]:
        lease = leases.acquire("n0", 0, sid, ttl_s=TTL_S)
        assert lease is not None
        ctx = SessionContext(session_id=sid, node="n0", gpu=0, lease_token=lease.token, redis_url=redis_url,
                             cluster=cluster, config=cfg.model_dump(mode="json"), lease_ttl_s=TTL_S,
                             require_heartbeat=False)
        revoked_at = []

        def revoke():
            # Revoke once the session has trained a while (start-up time varies on a busy machine).
            key = state.key(cluster, "session", session_id=sid)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                info = state.get(redis_client, key, SessionInfo)
                if info is not None and info.step >= min_steps:
                    break
                time.sleep(0.05)
            time.sleep(extra_s)
            revoked_at.append(time.monotonic())
            leases.revoke("n0", 0, lease.token)

        t = threading.Thread(target=revoke)
        t.start()
        out = run_session(ctx)
        done = time.monotonic()
        t.join()
        return out, done - revoked_at[0]

    out, latency = one_session("s1", 5, 1.5)
    assert out["steps"] > 0 and out["stop_reason"] == "should_continue"
    # It stopped on the revoke (checkpoint saved, run_session returned), not when its lease would have expired.
    # How fast (the stop deadline, 1 s by default) is a benchmark figure (bench trainer / bench scheduler's stop
    # latency): a clean-clone run at load average 5 on 2 cores took 1.31 s here, mid-validation.
    assert latency < TTL_S / 2, latency
    info = state.get(redis_client, state.key(cluster, "session", session_id="s1"), SessionInfo)
    assert info is not None and info.step > 0 and info.loss is not None and info.tokens > 0
    # The session's work is in the lineage head, counted in the same atomic step as the merge.
    head = state.get(redis_client, state.key(cluster, "lineage_head"), LineageHead)
    assert head is not None and head.steps == out["steps"] == out["merged_steps"] and out["merges"] >= 1
    # It gave the GPU back before its last merge (tests/test_session_release.py: the order): the record says so,
    # and the trainer's wait_reclaimed stops waiting there.
    assert info.status == "stopping" and info.released_at is not None
    assert redis_client.hget(state.key(cluster, "lineage_contributions"), "s1:steps") == str(out["steps"]).encode()
    # A second session starts from the head where the first stopped, and validates that head first.
    out2, _ = one_session("s2", 1, 0.2)
    assert out2["total_steps"] == out["total_steps"] + out2["merged_steps"]
    history = [state.decode(DrafterVersion, x) for x in
               redis_client.lrange(state.key(cluster, "drafter_versions"), 0, -1)]
    assert history and history[0].promoted
    current = state.get(redis_client, state.key(cluster, "drafter_current"), DrafterVersion)
    assert current is not None and current.acceptance_length > 1.0
    # Where the two sessions' seconds went, in the cluster's counters: training steps, the validation the second
    # one ran, start-up; the parts add up to no more than the whole.
    c = {k.decode(): float(v) for k, v in redis_client.hgetall(state.key(cluster, "counters")).items()}
    assert c["session_train_seconds"] > 0 and c["session_validate_seconds"] > 0 and c["session_ready_seconds"] > 0
    assert c["session_ready_seconds"] + c["session_train_seconds"] + c["session_validate_seconds"] \
        <= c["session_seconds"] + 1e-6


def test_run_session_without_policy_says_so(redis_client, redis_url, tmp_path):
    cfg = TailspecConfig.model_validate({"cluster": {"name": "np", "redis_url": redis_url},
                                         "trainer": {"checkpoint_dir": str(tmp_path)}})
    ctx = SessionContext(session_id="x", node="n0", gpu=0, lease_token=1, redis_url=redis_url, cluster="np",
                         config=cfg.model_dump(mode="json"), require_heartbeat=False)
    with pytest.raises(ValueError, match="policy_path"):
        run_session(ctx)


def test_a_head_is_proposed_once_and_only_with_enough_new_steps():
    from tailspec.drafter_trainer.promotion import worth_proposing

    assert worth_proposing(3, 7, (0, 0), 1)
    assert not worth_proposing(3, 7, (3, 7), 1)  # proposed already
    assert not worth_proposing(1, 0, (0, 0), 1)  # no training
    assert not worth_proposing(5, 11, (3, 7), 5) and worth_proposing(6, 12, (3, 7), 5)


def test_one_validation_at_a_time_and_only_its_holder_releases_it(redis_client):
    from tailspec.core import state
    from tailspec.drafter_trainer.promotion import claim_validation, release_validation

    assert claim_validation(redis_client, "c", 17, "node0-g1-t4")
    assert not claim_validation(redis_client, "c", 17, "node0-g2-t5")  # the same head: train instead
    assert not claim_validation(redis_client, "c", 18, "node0-g2-t5")  # a newer head waits its turn too
    assert not release_validation(redis_client, "c", "node0-g2-t5")  # not its claim
    assert not release_validation(redis_client, "c", "g1-t4")  # a suffix of the holder's id is not the holder
    assert redis_client.get(state.key("c", "drafter_validating")) == b"17 node0-g1-t4"
    assert 0 < redis_client.pttl(state.key("c", "drafter_validating")) <= 30_000  # a killed holder's claim expires
    assert release_validation(redis_client, "c", "node0-g1-t4")
    assert claim_validation(redis_client, "c", 18, "node0-g2-t5")


def test_a_warm_process_reuses_its_teacher_module_with_the_new_weights(tmp_path):
    """A warm session process keeps the last teacher module (on the host) and loads the next policy's weights into
    it: the same outputs as that policy loaded afresh (the independent reference), bit for bit."""
    from tailspec.benchmarks.vllm_kit import perturbed_policy
    from tailspec.drafter_trainer.teacher import Teacher, collate

    from tailspec.tasks.policy import get_policy
    from tailspec.warm import _KEPT, keep_teacher, load_teacher

    _KEPT.clear()
    p0 = get_policy("tiny", progress=False)
    p1 = perturbed_policy(p0, tmp_path / "p1", scale=0.2)  # the next policy version: same config, new weights
    t0 = load_teacher(p0, "cpu", torch.float32, 0)
    keep_teacher(t0)
    t1 = load_teacher(p1, "cpu", torch.float32, 1)
    assert t1.model is t0.model and t1.policy_version == 1 and t1.path == str(p1)
    batch = collate([Sample(prompt_ids=[1, 5, 6, 7], response_ids=[8, 9, 10, 2], reward=1.0, policy_version=1)])
    got, ref = t1(batch), Teacher.from_dir(p1, aux_layer_ids=t1.aux_layer_ids)(batch)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.aux, ref.aux)
    assert not torch.equal(got.logits, Teacher.from_dir(p0)(batch).logits)  # the weights really moved
    keep_teacher(t1)
    other = load_teacher(get_policy("micro", progress=False), "cpu", torch.float32, 0)  # another config: built anew
    assert other.model is not t1.model and "teacher" not in _KEPT


def test_weights_that_do_not_fit_are_refused_before_anything_is_copied(tmp_path):
    """A policy file whose tensors differ from the module's (a shape, an unknown name) is refused whole: False, and
    the module keeps every weight it had (the caller then loads the directory afresh)."""
    from safetensors.torch import load_file, save_file

    from tailspec.tasks.policy import get_policy, load_policy
    from tailspec.tasks.policy_sync import load_weights_in_place

    p0 = get_policy("tiny", progress=False)
    model, _ = load_policy(p0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = load_file(p0 / "model.safetensors")
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    for i, change in enumerate(({name: torch.zeros(3, 3)}, {"model.extra.weight": torch.zeros(2)})):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        save_file({**{k: v + 1.0 for k, v in tensors.items()}, **change}, str(bad / "model.safetensors"))
        assert not load_weights_in_place(model, bad)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_warm_process_builds_the_warm_policy_for_its_first_session(tmp_path, monkeypatch):
    """scheduler.warm_policy reaches a warm process as an environment variable: ENTRY.warm_up() builds that
    policy's modules as the kept teacher, so the first session's load_teacher of another version of it reuses
    them. A relative path is refused by the config; a missing directory costs nothing but the build."""
    from tailspec.benchmarks.vllm_kit import perturbed_policy
    from tailspec.core.config import SchedulerConfig
    from tailspec.scheduler.session_process import WARM_POLICY_ENV

    from tailspec.session_entry import ENTRY
    from tailspec.tasks.policy import get_policy
    from tailspec.warm import _KEPT, load_teacher

    p0 = get_policy("tiny", progress=False)
    p1 = perturbed_policy(p0, tmp_path / "p1", scale=0.2)
    _KEPT.clear()
    monkeypatch.setenv(WARM_POLICY_ENV, str(p0))
    ENTRY.warm_up()
    kept = _KEPT["teacher"][1]
    assert load_teacher(p1, "cpu", torch.float32, 1).model is kept
    with pytest.raises(ValueError, match="absolute"):
        SchedulerConfig(warm_policy="policies/v0")
    _KEPT.clear()
    monkeypatch.setenv(WARM_POLICY_ENV, str(tmp_path / "gone"))
    ENTRY.warm_up()
    assert "teacher" not in _KEPT
