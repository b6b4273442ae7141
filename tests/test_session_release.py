"""A session gives its GPU back before its last merge (drafter_trainer/training_session.py, "Giving the GPU back"): the
release comes after the last optimizer step and before the merge that lands it, the merge loses nothing, and a
chunk that ends on `max_seconds` (the session goes on) does not release."""

from __future__ import annotations

import pytest
import torch
from tailspec.core.config import TrainerConfig
from tailspec.core.state import Sample
from tailspec.drafter_trainer.lineage import Lineage
from tailspec.drafter_trainer.samples import SampleBuffer
from tailspec.drafter_trainer.training_session import TrainingSession

torch.set_num_threads(1)


def cfg(tmp_path, **kw) -> TrainerConfig:
    return TrainerConfig(**{"batch_size": 4, "lr": 1e-3, "checkpoint_dir": str(tmp_path / "ck"), "draft_vocab_size": 16,
                            **kw})


def make_buffer(n: int = 32) -> SampleBuffer:
    # self-contained (no tests.* imports): the GPU checks run this file with pytest from outside the checkout
    buf = SampleBuffer(capacity=1000, holdout_fraction=0.0)
    for i in range(n):
        buf.add(Sample(prompt_ids=[1, 4 + i % 9, 5], response_ids=[(i + 3 * j) % 17 + 4 for j in range(8 + i % 9)],
                       reward=float(i % 2), policy_version=0, group_id=str(i // 4)))
    return buf


def frozen_teacher():
    from tests.test_trainer_session import frozen_teacher

    return frozen_teacher()


def _session(tmp_path, redis, teacher, released: list) -> TrainingSession:
    lineage = Lineage(tmp_path / "lineage", redis, "rel")
    s = TrainingSession(cfg(tmp_path, merge_rule="async"), teacher, make_buffer(), lineage=lineage, session_id="s1",
                        on_release=lambda: released.append((lineage.head().steps, s.step)))
    return s


def test_the_gpu_is_released_before_the_last_merge_and_the_merge_is_whole(redis_client, tmp_path):
    released: list = []
    s = _session(tmp_path, redis_client, frozen_teacher(), released)
    res = s.run(max_steps=3)
    # at the release the 3 steps were taken and none merged yet; the merge after it landed all 3
    assert released == [(0, 3)]
    assert res.merged_steps == 3 and s.lineage.head().steps == 3
    assert s.lineage.contributions() == {"seed": 0, "s1": 3}


def test_a_chunk_that_ends_on_time_keeps_the_gpu(redis_client, tmp_path):
    released: list = []
    s = _session(tmp_path, redis_client, frozen_teacher(), released)
    res = s.run(max_seconds=0.0)
    assert res.stop_reason == "max_seconds" and released == []
    s.request_stop("revoked")
    s.run()
    assert len(released) == 1 and s.released_after_s is not None and s.released_after_s >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_frees_the_device_memory_before_the_merge(tmp_path):
    from tailspec.drafter_trainer.eagle3_config import default_aux_layer_ids
    from tailspec.drafter_trainer.teacher import Teacher

    from tailspec.tasks.policy import build_model

    model = build_model("micro").to("cuda").eval().requires_grad_(False)
    teacher = Teacher(model, default_aux_layer_ids(model.config.num_hidden_layers))
    seen: list = []
    lineage = Lineage(tmp_path / "lineage")  # the file-backed lineage: no redis-server on the GPU machine
    s = TrainingSession(cfg(tmp_path), teacher, make_buffer(), lineage=lineage, session_id="g1",
                        on_release=lambda: seen.append(torch.cuda.memory_allocated()))
    for _ in range(2):
        assert s.train_step() is not None
    held = torch.cuda.memory_allocated()
    s.request_stop("revoked")
    res = s.run()
    assert seen and seen[0] < held / 10, (seen, held)  # the teacher, the drafter and AdamW's moments are off it
    assert res.merged_steps == 2 and lineage.head().steps == 2


def test_the_host_path_merges_the_weights_and_moments_it_moved(redis_client, tmp_path):
    """What release does on a GPU (TrainingSession._to_host), run on the CPU: the optimizer's state is copied before
    the optimizer is cleared, the teacher's module goes to the meta device, and the merge after it writes the
    trained weights and AdamW's moments as they were."""
    from tailspec.drafter_trainer.checkpoint import load_checkpoint

    teacher = frozen_teacher()
    lineage = Lineage(tmp_path / "lineage", redis_client, "host")
    s = TrainingSession(cfg(tmp_path, merge_rule="async"), teacher, make_buffer(), lineage=lineage, session_id="h1")
    for _ in range(2):
        assert s.train_step() is not None
    weights = {n: p.detach().clone() for n, p in s.drafter.named_parameters() if p.requires_grad}
    moments = {i: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
               for i, st in s.backend.state_dict()["state"].items()}
    s._to_host()
    assert not s.backend.state_dict()["state"]  # the optimizer's own state is freed
    assert teacher.device.type == "meta"
    s.save()
    head = lineage.head()
    assert head.steps == 2
    ck = load_checkpoint(head.path)
    got = ck.drafter.state_dict()
    for n, w in weights.items():
        assert torch.equal(got[n], w), n
    assert ck.optimizer_state is not None
    for i, st in moments.items():
        for k, v in st.items():
            assert torch.equal(ck.optimizer_state["state"][i][k], v), (i, k)


def _nice() -> int:
    import os
    import threading

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_merge_after_the_release_runs_at_host_niceness_and_the_caller_keeps_its_own(redis_client, tmp_path):
    """Pinned to a simulated GPU's cores (host_nice > 0), the merge after the release is host work: it runs on a
    thread at that niceness and lands whole; the session's own thread, which serves the next lend, keeps its own."""
    released: list = []
    s = _session(tmp_path, redis_client, frozen_teacher(), released)
    s.host_nice = 19
    seen: list = []
    save = s.save
    s.save = lambda: (seen.append(_nice()), save())[1]
    before = _nice()
    res = s.run(max_steps=2)
    assert released == [(0, 2)] and seen == [19]
    assert res.merged_steps == 2 and s.lineage.head().steps == 2
    assert _nice() == before
    s2 = _session(tmp_path / "b", redis_client, frozen_teacher(), [])
    seen.clear()
    save2 = s2.save
    s2.save = lambda: (seen.append(_nice()), save2())[1]
    s2.run(max_steps=1)
    assert seen == [before]  # host_nice 0 (real GPUs): the merge stays on the caller's thread and priority


def test_an_error_in_the_niced_merge_reaches_the_caller():
    from tailspec.core.niceness import at_niceness

    def boom():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        at_niceness(boom, 19)
    assert at_niceness(lambda: 7, 19) == 7
