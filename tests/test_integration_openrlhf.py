"""tailspec attached to OpenRLHF (the pinned release, `make test-openrlhf`), driven on CPU with OpenRLHF's own
classes: its `SamplesGenerator` (prompt batches, load-balanced dispatch by unfinished requests, wake-up / sleep,
experiences built from the engines' responses, its sample buffer, evaluation), its hierarchical config
(`hierarchize`), its `RolloutRayActor` class under tailspec's subclass and its `create_vllm_engines` /
placement group. The vLLM engine actors are stand-in Ray actors where vLLM itself would have to run; OpenRLHF's
`PPOTrainer` module imports DeepSpeed and flash-attn (CUDA builds), so the trainer mixin is driven over a
stand-in base with the same methods, and `test_openrlhf_gpu_engine_actor` runs the real engine where a GPU is."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest

openrlhf = pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")
pytest.importorskip("vllm")  # OpenRLHF's engine and generator modules import vLLM at the top

from openrlhf.trainer.ray import vllm_engine
from openrlhf.utils.config import hierarchize
from tailspec.core import state
from tailspec.core.state import DrafterVersion, PhaseInfo, Progress
from tailspec.scheduler.attach import node_name
from tailspec.scheduler.client import TailspecClient
from test_vllm_checks import write_drafter, write_target

from tailspec.integrations import openrlhf_config as oc
from tailspec.integrations.openrlhf import TailspecRolloutActor, engine_actor_class, install_engines
from tailspec.integrations.openrlhf_attach import OpenRLHFAttach, newest_hf_checkpoint
from tailspec.integrations.openrlhf_mixin import TailspecSamplesGenerator, TailspecTrainerMixin

pytestmark = [pytest.mark.openrlhf, pytest.mark.timeout(300)]
CLUSTER = "orlhf"
PROMPT, RESPONSE = [1, 2, 3], [7, 8, 9]
K, DRAFTS = 3, 8  # the stand-in engines' draft length and drafts per sample


def test_pinned_release_is_installed():
    assert version("openrlhf") == oc.OPENRLHF_VERSION


@ray.remote
class FakeEngine:
    """Stands in for OpenRLHF's vLLM engine actor (vLLM's engine would need a GPU here): the GPUs Ray gives it,
    `generate_responses` waiting at a gate (so requests stay unfinished) and returning its executor's response
    dicts, the unfinished-request count OpenRLHF balances by, wake-up / sleep, and tailspec's two methods. Its
    spec-decode counters are Prometheus counters of vLLM's names and labels in the actor's process, as vLLM's
    stat logger keeps them: each sample drafts `DRAFTS` times `K` tokens and accepts `accept` of them per draft
    (set by the drafter path loaded; `break_drafter` zeroes it, as a failed weight sync would)."""

    def __init__(self, devices: str):
        from prometheus_client import Counter

        self.devices, self.gate, self.unfinished, self.log = devices, asyncio.Event(), 0, []
        self.accept, self.accept_by_path = 2, {}
        labels = ["model_name", "engine"]
        self.c = {n: Counter(f"vllm:spec_decode_num_{n}", n, labelnames=labels).labels("m", "0")
                  for n in ("drafts", "draft_tokens", "accepted_tokens")}
        pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", labelnames=labels + ["position"])
        self.per_pos = [pos.labels("m", "0", str(j)) for j in range(K)]

    def _count(self, samples: int) -> None:
        drafts = DRAFTS * samples
        self.c["drafts"].inc(drafts)
        self.c["draft_tokens"].inc(drafts * K)
        self.c["accepted_tokens"].inc(drafts * self.accept)
        for j in range(self.accept):
            self.per_pos[j].inc(drafts)

    def break_drafter(self):
        self.accept = 0

    def set_accept_by_path(self, by_path: dict):
        self.accept_by_path = dict(by_path)

    async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1,
                                 images=None):
        self.unfinished += num_samples
        await self.gate.wait()
        self.unfinished -= num_samples
        self._count(num_samples)
        self.log.append(("generate", prompt))
        reward = float(prompt[1:])  # prompts are "p<i>"
        return [{"prompt": prompt, "label": label, "observation_tokens": PROMPT + RESPONSE,
                 "action_ranges": [(3, 6)], "reward": reward, "scores": reward, "rollout_log_probs": None,
                 "extra_logs": {}} for _ in range(num_samples)]

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def open(self):
        self.gate.set()

    def wake_up(self, tags=None):
        self.log.append(("wake_up", None))

    def sleep(self, level=1):
        self.log.append(("sleep", None))

    def tailspec_where(self):
        return node_name(ray.get_runtime_context().get_node_id()), [int(d) for d in self.devices.split(",")]

    def tailspec_reload_drafter(self, path):
        self.log.append(("tailspec_reload_drafter", path))
        self.accept = self.accept_by_path.get(path, 2)
        return [{"ok": True}]

    def calls(self):
        """(the calls other than generate, in order; the paths reloaded)"""
        return [c for c, _ in self.log if c != "generate"], [p for c, p in self.log if c == "tailspec_reload_drafter"]


def _strategy(enable_sleep: bool = True, batch: int = 4, gen_batch: int | None = None):
    """OpenRLHF's own nested args, built the way its launcher builds them (flat dotted flags -> hierarchize)."""
    flat = {"rollout.batch_size": batch, "rollout.n_samples_per_prompt": 2,
            "rollout.vllm_generate_batch_size": gen_batch, "vllm.enable_sleep": enable_sleep,
            "algo.dynamic_filtering_enable": False, "algo.dynamic_filtering_range": [0.0, 1.0],
            "algo.advantage.is_correction_level": "off", "ckpt.path": "/unused"}
    return argparse.Namespace(args=hierarchize(argparse.Namespace(**flat)))


def _prompts(n: int) -> list:
    return [(["ds"], [f"p{i}"], [f"l{i}"], [None]) for i in range(n)]  # OpenRLHF's collate: one prompt a batch


def _settings(redis_url: str, tmp: Path, **kw) -> oc.OpenRLHFSettings:
    return oc.OpenRLHFSettings(redis_url=redis_url, cluster=CLUSTER, policy_root=str(tmp / "policy"),
                               progress_interval_s=0.1, **kw)


def _progress(r) -> dict[str, Progress]:
    out = {}
    for k in r.scan_iter(match=state.key(CLUSTER, "progress", worker="*")):
        p = state.decode(Progress, r.get(k), where=k.decode())
        out[p.worker] = p
    return out


def _samples(r) -> list[dict]:
    return [json.loads(f[b"data"]) for _, f in r.xrange(state.key(CLUSTER, "samples"))]


def _wait(pred, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


GEN = {"temperature": 1.0, "max_new_tokens": 8, "max_len": 64, "n_samples_per_prompt": 2}


@pytest.fixture
def engines(ray_cluster):
    handles = [FakeEngine.remote("0,1"), FakeEngine.remote("2,3")]
    yield handles
    for h in handles:
        ray.kill(h)


def _generator(attach, engines, strategy, n_prompts: int = 4, eval_prompts: int = 0):
    return TailspecSamplesGenerator(strategy, _prompts(n_prompts), _prompts(eval_prompts) or None, None, engines,
                                    tailspec=attach)


def test_generator_reports_engines_progress_phases_and_samples(engines, redis_url, redis_client, tmp_path):
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    model = write_target(tmp_path / "model")
    attach = OpenRLHFAttach(_settings(redis_url, tmp_path), client, model_dir=model, checkpoint_root=tmp_path / "ckpt",
                            engines=engines, slept=True)
    gen = _generator(attach, engines, _strategy())
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=gen.generate_samples(**GEN)))
    t.start()
    during = _wait(lambda: (p := _progress(redis_client)) and sum(x.active for x in p.values()) == 8 and p)
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.phase, phase.step, phase.policy_version) == ("rollout", 1, 0)
    assert phase.policy_path == str(tmp_path / "policy" / "policy-v00000000")
    node = node_name(ray.get_runtime_context().get_node_id())
    assert {w: (p.node, p.gpus, p.active, p.total) for w, p in during.items()} == {
        "openrlhf-engine-0": (node, [0, 1], 4, 4), "openrlhf-engine-1": (node, [2, 3], 4, 4)}  # balanced by OpenRLHF
    assert all(p.mem_released is None for p in during.values())  # the engines hold their memory until the sleep
    for h in engines:
        ray.get(h.open.remote())
    t.join(60)
    experiences = result["out"][0]
    assert len(experiences) == 8 and experiences[0].sequences[0].tolist() == PROMPT + RESPONSE  # OpenRLHF's own

    after = _progress(redis_client)
    assert {w: (p.active, p.finished, p.total, p.mem_released) for w, p in after.items()} == {
        "openrlhf-engine-0": (0, 4, 4, True), "openrlhf-engine-1": (0, 4, 4, True)}
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.phase, phase.step) == ("train", 1) and attach.stats.waits[-1]["reclaimed"] is True
    assert [ray.get(h.calls.remote())[0] for h in engines] == [["wake_up", "sleep"]] * 2
    client.flush(5.0)
    rows = _wait(lambda: len(s := _samples(redis_client)) == 8 and s)
    assert sorted(r["reward"] for r in rows) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert all(r["prompt_ids"] == PROMPT and r["response_ids"] == RESPONSE and r["policy_version"] == 0 for r in rows)
    client.close()


def test_buffered_and_evaluation_batches_make_no_phase_calls(engines, redis_url, redis_client, tmp_path):
    """OpenRLHF serves the second training batch from its buffer (vllm_generate_batch_size = 2 batches) and
    generates evaluation batches through the same engines: neither is a tailspec rollout."""
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    attach = OpenRLHFAttach(_settings(redis_url, tmp_path), client, model_dir=write_target(tmp_path / "m"),
                            checkpoint_root=tmp_path / "ckpt", engines=engines)
    for h in engines:
        ray.get(h.open.remote())
    gen = _generator(attach, engines, _strategy(enable_sleep=False, batch=2, gen_batch=4), eval_prompts=2)
    first = gen.generate_samples(**GEN)
    assert len(first[0]) == 4 and len(attach.stats.waits) == 1 and first[2] == 4  # 4 prompts drawn at once
    second = gen.generate_samples(**GEN)
    assert len(second[0]) == 4 and second[2] == 0 and len(attach.stats.waits) == 1  # from the buffer
    attach.updated(1)
    evals = gen.generate_eval_samples(**GEN)
    assert len(evals) == 4 and len(attach.stats.waits) == 1
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.phase, phase.step) == ("train", 1)
    assert sum(e["finished"] for e in attach.stats.loads[-1]) == 8
    client.close()


def _promote(r, v: int, path: Path) -> None:
    state.put(r, state.key(CLUSTER, "drafter_current"), DrafterVersion(
        version=v, path=str(path), policy_version=0, acceptance_length=2.0, promoted=True, created_at=time.time()))


def _attach_with_drafter(engines, redis_url, redis_client, tmp_path, drafter) -> tuple[TailspecClient, OpenRLHFAttach]:
    """An attachment whose engines started with `drafter`, promoted as version 1; the engines' gates open."""
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    _promote(redis_client, 1, drafter)
    attach = OpenRLHFAttach(_settings(redis_url, tmp_path, drafter_path=str(drafter), drafter_version=1), client,
                            model_dir=write_target(tmp_path / "model"), checkpoint_root=tmp_path / "ckpt",
                            engines=engines, slept=True)
    for h in engines:
        ray.get(h.open.remote())
    return client, attach


def test_promotion_reloads_every_engine_after_wake_up(engines, redis_url, redis_client, tmp_path):
    first, second = write_drafter(tmp_path / "d1"), write_drafter(tmp_path / "d2")
    wrong = write_drafter(tmp_path / "wrong", hidden=32)
    client, attach = _attach_with_drafter(engines, redis_url, redis_client, tmp_path, first)
    gen = _generator(attach, engines, _strategy(batch=2), n_prompts=6)
    gen.generate_samples(**GEN)  # the version the engines started with: nothing to load
    assert [ray.get(h.calls.remote())[0] for h in engines] == [["wake_up", "sleep"]] * 2

    _promote(redis_client, 2, second)
    attach.updated(1)
    gen.generate_samples(**GEN)
    for h in engines:  # after OpenRLHF woke the engine, before its first request of the batch
        assert ray.get(h.calls.remote()) == (["wake_up", "sleep", "wake_up", "tailspec_reload_drafter", "sleep"],
                                             [str(second)])
    _promote(redis_client, 3, wrong)  # another target's drafter: refused before any engine sees it
    attach.updated(2)
    gen.generate_samples(**GEN)
    assert all(ray.get(h.calls.remote())[1] == [str(second)] for h in engines)
    assert attach.live.version.version == 2 and 3 in attach.live.refused
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.step, phase.policy_version) == (3, 2)
    client.close()


def _guard_status(r) -> dict:
    return {k.decode(): state.decode(state.GuardStatus, v) for k, v in
            r.hgetall(state.key(CLUSTER, "drafter_guard")).items()}


def test_health_guard_per_engine_repairs_a_sync_broken_drafter_and_rolls_back_a_broken_version(
        engines, redis_url, redis_client, tmp_path):
    """Each engine's counters per batch feed its own guard: one engine whose drafter a weight sync broke trips
    alone and gets the same drafter reloaded before the next batch; a promoted version that is broken
    everywhere trips every engine and the last healthy drafter comes back."""
    good, bad = write_drafter(tmp_path / "good"), write_drafter(tmp_path / "bad")
    client, attach = _attach_with_drafter(engines, redis_url, redis_client, tmp_path, good)
    for h in engines:
        ray.get(h.set_accept_by_path.remote({str(bad): 0}))
    gen = _generator(attach, engines, _strategy(batch=2), n_prompts=10)  # five batches
    verdicts = lambda: [(v["event"], v["tripped"], round(v["live"], 3)) for v in attach.stats.verdicts]  # noqa: E731

    gen.generate_samples(**GEN)  # 2 samples an engine, 8 drafts each: 3 tokens a forward, validated 2.0 at k = 4
    assert verdicts() == [("load", False, 3.0)] * 2

    ray.get(engines[1].break_drafter.remote())  # the next weight sync breaks engine 1's drafter
    attach.updated(1)
    gen.generate_samples(**GEN)
    assert verdicts()[2:] == [("policy_sync", False, 3.0), ("policy_sync", True, 1.0)]
    status = _guard_status(redis_client)
    assert status["openrlhf-engine-1"].tripped and not status["openrlhf-engine-0"].tripped
    assert int(redis_client.hget(state.key(CLUSTER, "counters"), "drafter_guard_trips")) == 1

    attach.updated(2)
    gen.generate_samples(**GEN)  # the same drafter reloaded into every engine before the batch: repaired
    assert all(ray.get(h.calls.remote())[1] == [str(good)] for h in engines)
    assert verdicts()[4:] == [("rollback", False, 3.0)] * 2

    _promote(redis_client, 2, bad)  # validated, yet broken in every engine
    attach.updated(3)
    gen.generate_samples(**GEN)
    assert verdicts()[6:] == [("reload", True, 1.0)] * 2 and 2 in attach.live.refused
    attach.updated(4)
    gen.generate_samples(**GEN)  # the last healthy drafter back before the batch; v2 is not loaded again
    assert [ray.get(h.calls.remote())[1] for h in engines] == [[str(good), str(bad), str(good)]] * 2
    assert verdicts()[8:] == [("rollback", False, 3.0)] * 2
    assert not any(s.tripped for s in _guard_status(redis_client).values())
    client.close()


def test_policy_versions_follow_openrlhf_hf_checkpoints(redis_url, tmp_path):
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    ckpt = tmp_path / "ckpt"
    attach = OpenRLHFAttach(_settings(redis_url, tmp_path), client, model_dir=write_target(tmp_path / "m"),
                            checkpoint_root=ckpt)
    assert attach.publish_policy()[0] == 0
    write_target(ckpt / "global_step2_hf")  # what --ckpt.save_hf writes at --ckpt.save_steps
    write_target(ckpt / "best_global_step9_hf")  # a best-metric save: not a step of the run's sequence
    (ckpt / "global_step4_hf").mkdir()  # being written (no config.json yet)
    assert newest_hf_checkpoint(ckpt) == (2, ckpt / "global_step2_hf")
    assert attach.publish_policy()[0] == 2 and attach.stats.published == [0, 2]
    assert (tmp_path / "policy" / "policy-v00000002" / "config.json").is_file()
    client.close()


class FakePPOTrainerBase:
    """Stands in for the class under OpenRLHF's `@ray.remote PPOTrainer` (its module imports DeepSpeed and
    flash-attn): the constructor's arguments and attributes, `init_checkpoint_states`, `train_step`, and a `fit`
    running `generate_samples` then `train_step` as OpenRLHF's does."""

    def __init__(self, pretrain, strategy, actor, critic, reward, ref, vllm_engines, **generate_kwargs):
        self.strategy, self.vllm_engines, self.generate_kwargs = strategy, vllm_engines, generate_kwargs
        self.prompts_dataloader, self.eval_dataloader, self.tokenizer = _prompts(4), None, None
        self.samples_generator = "OpenRLHF's generator"

    def init_checkpoint_states(self):
        return {"global_step": 5}  # a resumed run

    def train_step(self, rollout_samples, global_step):
        return {"n": len(rollout_samples)}, global_step + 1

    def fit(self, global_step=0):
        step = self.init_checkpoint_states()["global_step"] or global_step
        while True:
            samples, _, _, _ = self.samples_generator.generate_samples(**self.generate_kwargs)
            if not samples:
                break
            _, step = self.train_step(samples, step)


def test_trainer_mixin_numbers_steps_from_the_resumed_checkpoint(engines, redis_url, redis_client, tmp_path):
    strategy = _strategy(enable_sleep=False, batch=2)
    strategy.args.ckpt.path = str(tmp_path / "ckpt")
    trainer_cls = type("T", (TailspecTrainerMixin, FakePPOTrainerBase), {
        "tailspec_settings": {"redis_url": redis_url, "cluster": CLUSTER, "progress_interval_s": 0.1}})
    trainer = trainer_cls(str(write_target(tmp_path / "m")), strategy, None, None, None, None, engines, **GEN)
    assert isinstance(trainer.samples_generator, TailspecSamplesGenerator)
    for h in engines:
        ray.get(h.open.remote())
    trainer.fit()
    assert [w["step"] for w in trainer.tailspec.stats.waits] == [6, 7] and trainer.tailspec.updates == 7
    trainer.tailspec.client.close()


def test_engine_actor_class_adds_tailspec_engine_arguments(tmp_path):
    model, drafter = write_target(tmp_path / "model"), write_drafter(tmp_path / "d")
    settings = oc.OpenRLHFSettings(redis_url="redis://x", drafter_path=str(drafter), drafter_k=3)
    original = vllm_engine.RolloutRayActor
    try:
        actor = install_engines(settings, model)
        assert vllm_engine.RolloutRayActor is actor  # what OpenRLHF's create_vllm_engines starts
        cls = actor.__ray_actor_class__
        assert issubclass(cls, TailspecRolloutActor) and issubclass(cls, original.__ray_actor_class__)
        kw = cls.tailspec_engine_kwargs
        assert kw["worker_extension_cls"] == oc.WORKER_EXTENSION
        assert kw["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3, "model": str(drafter),
                                            "draft_tensor_parallel_size": 1}
    finally:
        vllm_engine.RolloutRayActor = original
    wrong = write_drafter(tmp_path / "wrong", hidden=32)
    with pytest.raises(ValueError, match="does not fit|hidden"):
        engine_actor_class(oc.OpenRLHFSettings(redis_url="redis://x", drafter_path=str(wrong)), model)


def test_settings_file_round_trip_and_refusals(tmp_path, redis_url):
    model, drafter = write_target(tmp_path / "model"), write_drafter(tmp_path / "d")
    out = tmp_path / "tailspec-openrlhf.yaml"
    assert oc.main(["--redis", redis_url, "--cluster", CLUSTER, "--policy-root", str(tmp_path / "policy"),
                    "--model", str(model), "--drafter", str(drafter), "--k", "3", "--out", str(out)]) == 0
    assert oc.load_settings(out) == oc.OpenRLHFSettings(redis_url=redis_url, cluster=CLUSTER,
                                                        policy_root=str(tmp_path / "policy"),
                                                        drafter_path=str(drafter), drafter_k=3)
    with pytest.raises(ValueError, match="unknown tailspec settings"):
        oc.OpenRLHFSettings.from_mapping({"redis_url": "redis://x", "polcy_root": "/p"})
    with pytest.raises(ValueError, match="absolute"):
        oc.OpenRLHFSettings(redis_url="redis://x", policy_root="rel/policy")


def test_the_worker_extension_keeps_openrlhfs_methods():
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    from tailspec.integrations.openrlhf_worker_ext import TailspecOpenRLHFWorkerExtension as Ext

    for name in ("init_process_group", "update_weight", "update_weight_cuda_ipc"):
        assert getattr(Ext, name) is getattr(WorkerWrap, name)
    assert callable(Ext.tailspec_reload_drafter)


def test_a_tensor_parallel_engine_is_located_by_its_workers(monkeypatch):
    """With tensor parallelism OpenRLHF's engine actor holds no GPU (vLLM's Ray executor places the workers):
    it asks its workers, each of which maps vLLM's device index through CUDA_VISIBLE_DEVICES."""
    from types import SimpleNamespace

    import torch
    from tailspec.rollout.vllm_worker_ext import TailspecWorkerExtension as Ext

    from tailspec.integrations.openrlhf_progress import workers_where

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [Ext.tailspec_where(SimpleNamespace(device=torch.device("cuda", i)))["gpu"] for i in (2, 3)] == [6, 7]
    assert Ext.tailspec_where(SimpleNamespace(device=torch.device("cpu")))["gpu"] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3f2a,GPU-77b1")  # UUIDs: no index to lend by
    assert Ext.tailspec_where(SimpleNamespace(device=torch.device("cuda", 1)))["gpu"] is None

    a, b = "a" * 40, "b" * 40
    workers = [{"node_id": a, "gpu": 7}, {"node_id": a, "gpu": 6}, {"node_id": b, "gpu": 0}]
    assert workers_where(workers, "n0") == (node_name(a), [6, 7])  # the first worker's node only
    assert workers_where([{"node_id": None, "gpu": None}], "n0") == ("n0", [])

    actor = TailspecRolloutActor.__new__(TailspecRolloutActor)  # OpenRLHF's constructor needs vLLM on a GPU

    async def rpc(method):
        assert method == "tailspec_where"
        return workers

    actor.llm = SimpleNamespace(collective_rpc=rpc)
    actor._tailspec_where = ("n0", [])  # what the constructor read: the actor itself has no GPU
    assert asyncio.run(actor.tailspec_where()) == (node_name(a), [6, 7])
    actor._tailspec_where = ("n0", [2])  # a single-GPU engine: its own GPU, no question asked
    assert asyncio.run(actor.tailspec_where()) == ("n0", [2])


def test_launcher_refuses_the_async_trainer_before_patching(tmp_path):
    from tailspec.integrations import openrlhf as launcher

    path = oc.write_settings(tmp_path / "s.yaml", oc.OpenRLHFSettings(redis_url="redis://x"))
    original = vllm_engine.RolloutRayActor
    with pytest.raises(SystemExit, match="async"):
        launcher.main(["--tailspec", str(path), "--actor.model_name_or_path", str(tmp_path), "--train.async_enable"])
    assert vllm_engine.RolloutRayActor is original
    a, rest = launcher._args(["--tailspec", str(path), "--actor.model_name_or_path", "/m", "--vllm.num_engines", "2"])
    assert (a.tailspec, a.model, rest) == (str(path), "/m", ["--vllm.num_engines", "2"])


@pytest.mark.gpu
def test_openrlhf_gpu_engine_actor(ray_cluster, tmp_path):
    """GPU only, never run on the CPU machine this was written on: OpenRLHF's own `create_vllm_engines` starts
    tailspec's engine actor (a real vLLM engine with the EAGLE-3 drafter and the combined worker extension);
    the drafter reload reaches its worker and greedy outputs stay identical across it."""
    from vllm import SamplingParams
    from vllm_helpers import drafters, prompts, tiny

    d = drafters()
    settings = oc.OpenRLHFSettings(redis_url="redis://unused", drafter_path=str(d["untrained"]), drafter_k=3)
    original = vllm_engine.RolloutRayActor
    try:
        install_engines(settings, tiny())
        (engine,) = vllm_engine.create_vllm_engines(1, 1, str(tiny()), 0, False, False, True, 256)
        sp = SamplingParams(temperature=0.0, max_tokens=32)
        before = [ray.get(engine.generate.remote(p, sp)).outputs[0].token_ids for p in prompts()[:4]]
        assert ray.get(engine.get_num_unfinished_requests.remote()) == 0
        assert ray.get(engine.tailspec_where.remote())[1]  # the engine's GPU
        res = ray.get(engine.tailspec_reload_drafter.remote(str(d["trained"])))
        assert res and all(r["loaded"] for r in res)
        after = [ray.get(engine.generate.remote(p, sp)).outputs[0].token_ids for p in prompts()[:4]]
        assert before == after
    finally:
        vllm_engine.RolloutRayActor = original
