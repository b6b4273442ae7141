"""A warm session process reads ahead between lends (tailspec/warm.py, scheduler/warm_wait.py): the newest policy
into its kept teacher and the lineage head's checkpoint into host memory, so the next lend starts on them without
reading a file; what it serves is what the files hold, and a directory changed since is read afresh."""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest
import torch
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import PhaseInfo
from tailspec.drafter_trainer import checkpoint
from tailspec.drafter_trainer.checkpoint import load_checkpoint, stage_checkpoint
from tailspec.drafter_trainer.lineage import Lineage
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
from tailspec.scheduler.cpu_quota import CGROUP_ENV
from tailspec.scheduler.placement import CPUS_ENV
from tailspec.scheduler.session_process import FunctionEntry, SessionContext, SessionEntry, load_entry
from tailspec.scheduler.warm_wait import WarmWait

from tailspec import warm

torch.set_num_threads(1)


def _state(ck) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ck.drafter.state_dict().items()}


def _seed(root, redis, cluster, teacher) -> Eagle3Module:
    torch.manual_seed(1)
    d = Eagle3Module(Eagle3Config.from_target(teacher.config), teacher.embedding())
    Lineage(root, redis, cluster).seed(d, {"step": 0, "tokens": 0, "backend": "torch"})
    return d


def test_prestage_reads_the_policy_and_the_head_so_the_next_lend_reads_no_file(tmp_path, redis_client, redis_url,
                                                                            monkeypatch):
    from tailspec.benchmarks.vllm_kit import perturbed_policy
    from tailspec.drafter_trainer.teacher import Teacher

    from tailspec.tasks.policy import get_policy

    cluster = "wp"
    p0 = get_policy("micro", progress=False)
    p1 = perturbed_policy(p0, tmp_path / "p1", scale=0.2)  # the policy the next step publishes
    cfg = TailspecConfig.model_validate({"cluster": {"name": cluster, "redis_url": redis_url},
                                         "trainer": {"checkpoint_dir": str(tmp_path / "drafter")}})
    ctx = SessionContext(session_id="s0", node="n0", gpu=0, lease_token=1, redis_url=redis_url, cluster=cluster,
                         config=cfg.model_dump(mode="json"), lease_ttl_s=5.0, require_heartbeat=False)
    warm._KEPT.clear()
    checkpoint._STAGED.clear()
    warm.prestage()  # no lend served yet: nothing known, nothing read
    assert not warm._KEPT and not checkpoint._STAGED
    t0 = warm.load_teacher(p0, "cpu", torch.float32, 0)  # the last lend's teacher, kept
    warm.keep_teacher(t0)
    root = tmp_path / "drafter" / "lineage"
    _seed(root, redis_client, cluster, t0)
    state.put(redis_client, state.key(cluster, "phase"),
              PhaseInfo(phase="rollout", step=1, started_at=time.time(), policy_version=1, policy_path=str(p1)))
    warm.remember(ctx)
    warm.prestage()

    # The next lend: nothing is read from disk, neither the teacher's weights nor the head's checkpoint.
    def no_read(*a, **k):
        raise AssertionError("read from disk although read ahead")

    monkeypatch.setattr(warm, "load_weights_in_place", no_read)
    monkeypatch.setattr(checkpoint.Eagle3Module, "load", no_read)
    teacher = warm.load_teacher(p1, "cpu", torch.float32, 1)
    assert teacher.model is t0.model and teacher.policy_version == 1
    head, ck = Lineage(root, redis_client, cluster).pull(teacher.embedding())
    assert ck.drafter.embed_tokens is teacher.embedding()
    monkeypatch.undo()
    # ... and what it holds is what the files hold (independent references: loaded afresh)
    ref = Teacher.from_dir(p1)
    assert all(torch.equal(a, b) for a, b in zip(teacher.model.state_dict().values(), ref.model.state_dict().values()))
    fresh = load_checkpoint(head.path, ref.embedding())
    assert _state(ck).keys() == _state(fresh).keys()
    assert all(torch.equal(v, _state(fresh)[k]) for k, v in _state(ck).items())
    assert ck.optimizer_state is None and fresh.optimizer_state is None
    # served once: the next pull reads the files
    assert str(head.path) not in checkpoint._STAGED


def test_a_staged_checkpoint_is_not_served_once_its_directory_changed(tmp_path, redis_client):
    from tailspec.drafter_trainer.checkpoint import write_checkpoint_dir

    from tests.test_lineage import tiny_drafter

    d = tiny_drafter()
    path = write_checkpoint_dir(tmp_path / "ck", d, None, {"step": 3})
    checkpoint._STAGED.clear()
    stage_checkpoint(path)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(1.0)
    time.sleep(0.01)  # a later modification time where the filesystem's clock is coarse
    write_checkpoint_dir(tmp_path / "ck2", d, None, {"step": 4})
    shutil.rmtree(path)
    os.replace(tmp_path / "ck2", path)  # the same name, other files (a head directory is never reused so; still)
    got = load_checkpoint(path)
    assert got.step == 4
    assert all(torch.equal(v, d.state_dict()[k]) for k, v in got.drafter.state_dict().items())
    stage_checkpoint(path)  # a staged directory that is gone is not served either
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(path)


ENTRY_MODULE = """
calls = []

class Entry:
    def run(self, ctx):
        return {}

    def warm_up(self):
        calls.append("w")

    def prestage(self):
        calls.append("p")
        if calls.count("p") == 2:
            raise OSError("a head collected while it was read")

ENTRY = Entry()

def session(ctx):
    return {}
"""


def _entry(tmp_path, monkeypatch, name: str) -> list[str]:
    """A session entry module: `ENTRY` records its warm_up and prestage calls; `session` is a plain function."""
    (tmp_path / f"{name}.py").write_text(ENTRY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module(name).calls


def test_config_names_an_entry_object_or_a_plain_function(tmp_path, monkeypatch):
    """`scheduler.session_entry` names an object with the SessionEntry protocol, taken as it is, or a plain
    function, wrapped as an entry with nothing to warm up or read ahead; anything else is refused naming the
    value."""
    calls = _entry(tmp_path, monkeypatch, "entry_kinds")
    entry = load_entry("entry_kinds:ENTRY")
    assert isinstance(entry, SessionEntry) and not isinstance(entry, FunctionEntry)
    entry.warm_up()
    assert calls == ["w"]
    plain = load_entry("entry_kinds:session")
    assert isinstance(plain, FunctionEntry) and plain.run(None) == {}
    plain.warm_up()
    plain.prestage()
    assert calls == ["w"]
    for spec, said in [("entry_kinds", "module:attribute"), ("entry_kinds_gone:ENTRY", "cannot import"),
                       ("entry_kinds:nothing", "no attribute 'nothing'"), ("entry_kinds:calls", "neither"),
                       ("entry_kinds:Entry", "neither")]:
        with pytest.raises(ValueError, match=said) as e:
            load_entry(spec)
        assert repr(spec) in str(e.value)


@pytest.mark.parametrize("placement", ["quota", "whole cores", "none"])
def test_the_warm_wait_reads_ahead_between_lends_only_on_the_hosts_share(tmp_path, monkeypatch, placement):
    calls = _entry(tmp_path, monkeypatch, f"entry_{placement.replace(' ', '_')}")
    left = []
    r, w = os.pipe()
    wait = WarmWait(load_entry(f"entry_{placement.replace(' ', '_')}:ENTRY").prestage, leave=lambda: left.append(1),
                    fd=r)
    monkeypatch.delenv(CPUS_ENV, raising=False)
    monkeypatch.delenv(CGROUP_ENV, raising=False)
    os.write(w, b'{"first": 1}\n')
    assert wait.next_line() == '{"first": 1}\n'
    assert not calls  # nothing is read ahead before the first lend: its placement is not known
    if placement != "none":  # what the lend set (the warm loop sets these from the assignment)
        monkeypatch.setenv(CPUS_ENV, "0")
        if placement == "quota":
            monkeypatch.setenv(CGROUP_ENV, "/sys/fs/cgroup/cpu/x")
    import threading

    threading.Timer(1.5, lambda: os.write(w, b'{"second": 2}\n')).start()
    assert wait.next_line() == '{"second": 2}\n'
    if placement == "whole cores":  # a simulated GPU's own cores: no host share to read ahead on
        assert not calls and not left
    else:  # every PRESTAGE_EVERY_S while waiting; the cores left once; a failure does not stop it
        assert len(calls) >= 3 and left == [1]
    os.close(w)
    assert wait.next_line() == ""  # EOF: the dispatcher went away


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a niceness per thread is Linux's")
def test_the_read_ahead_runs_at_low_priority_and_the_lend_thread_keeps_its_own(monkeypatch):
    """Outside the GPUs' cgroups a read-ahead at the default niceness weighs as much as a GPU's whole cgroup and
    would take its time from the rollout workers beside it: it runs on its own thread at PRESTAGE_NICE, and the
    thread that serves the next lend keeps its niceness."""
    import threading

    from tailspec.scheduler.warm_wait import PRESTAGE_NICE

    seen = []

    def hook():
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))

    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    r, w = os.pipe()
    wait = WarmWait(hook, leave=lambda: None, fd=r)
    monkeypatch.delenv(CPUS_ENV, raising=False)  # no placement: the host's CPUs are the host's
    wait.served = True
    threading.Timer(0.8, lambda: os.write(w, b"{}\n")).start()
    assert wait.next_line() == "{}\n"
    assert len(seen) >= 2 and all(n == max(PRESTAGE_NICE, main_nice) for _, n in seen)
    assert {t for t, _ in seen} != {threading.get_native_id()}  # not the main thread
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice
    os.close(w)
    os.close(r)
