"""tailspec attached to verl (the pinned release, `make test-verl`), driven on CPU with verl's own classes: its
Hydra config tree and config dataclasses, its router factory starting `TailspecLoadBalancer` as a Ray actor
from the router file, its `LLMServerClient` routing requests through it to replica server actors, its
`AgentLoopManager.generate_sequences` chunking a real `DataProto` over agent-loop workers. The vLLM server
replicas are stand-in Ray actors (vLLM's engine needs a GPU under verl); where a GPU is present,
`test_verl_gpu_worker_extension_in_a_real_vllm_engine` runs the adapter's worker extension in a real vLLM engine."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import torch
from omegaconf import OmegaConf
from tailspec.core import state
from tailspec.core.state import DrafterVersion, PhaseInfo, Progress
from tailspec.scheduler.attach import node_name
from tailspec.scheduler.client import TailspecClient
from test_vllm_checks import write_drafter, write_target
from verl.protocol import DataProto
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from tailspec.integrations import verl_config as vc
from tailspec.integrations.verl import TailspecAgentLoopManager, attach_from_config
from tailspec.integrations.verl_attach import VerlAttach

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]
CLUSTER = "verl"
K, DRAFTS = 3, 8  # the stand-in replicas' draft length and drafts per request


def test_pinned_release_is_installed():
    assert verl.__version__ == vc.VERL_VERSION


@ray.remote
class FakeServer:
    """Stands in for verl's vLLMHttpServer: the GPUs verl gives it in CUDA_VISIBLE_DEVICES, a `generate` that
    waits at a gate (so requests stay in flight), and the two calls tailspec's reload makes. Its spec-decode
    counters are Prometheus counters of vLLM's names and labels in the actor's process, as vLLM's stat logger
    keeps them when verl runs it with `disable_log_stats=False`: each request drafts `DRAFTS` times `K` tokens
    and accepts `accept` per draft (set by the drafter loaded; `break_drafter` zeroes it)."""

    def __init__(self, devices: str, n_tokens: int = 3):
        import os

        from prometheus_client import Counter

        os.environ["CUDA_VISIBLE_DEVICES"] = devices  # as vLLMHttpServer.__init__ does
        self.gate, self.n_tokens, self.rpcs = asyncio.Event(), n_tokens, []
        self.accept, self.accept_by_path = 2, {}
        self.c = {n: Counter(f"vllm:spec_decode_num_{n}", n, labelnames=["model_name", "engine"]).labels("m", "0")
                  for n in ("drafts", "draft_tokens", "accepted_tokens")}

    async def generate(self, request_id, prompt_ids, sampling_params, **kw):
        await self.gate.wait()
        self.c["drafts"].inc(DRAFTS)
        self.c["draft_tokens"].inc(DRAFTS * K)
        self.c["accepted_tokens"].inc(DRAFTS * self.accept)
        return TokenOutput(token_ids=[7] * self.n_tokens, stop_reason="completed")

    def break_drafter(self):
        self.accept = 0

    def set_accept_by_path(self, by_path):
        self.accept_by_path = dict(by_path)

    def open(self):
        self.gate.set()

    def close(self):
        self.gate.clear()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, list(args)))
        if method == "tailspec_reload_drafter":
            self.accept = self.accept_by_path.get(args[0], 2)

    async def clear_kv_cache(self):
        self.rpcs.append(("clear_kv_cache", []))

    def calls(self):
        return self.rpcs


def _settings(redis_url: str, tmp: Path, **kw) -> vc.VerlSettings:
    return vc.VerlSettings(redis_url=redis_url, cluster=CLUSTER, policy_root=str(tmp / "policy"), **kw)


def _verl_config(router_file: Path, model: Path, ckpt: Path):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False, "max_num_seqs": 8,
                                          "router_config_path": str(router_file), "response_length": 8},
                              "model": {"path": str(model)}},
        "trainer": {"default_local_dir": str(ckpt)}})


def _progress(r) -> dict[str, Progress]:
    out = {}
    for k in r.scan_iter(match=state.key(CLUSTER, "progress", worker="*")):
        p = state.decode(Progress, r.get(k), where=k.decode())
        out[p.worker] = p
    return out


def _wait(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def replicas(ray_cluster):
    servers = {"10.0.0.1:8000": FakeServer.remote("0,1"), "10.0.0.2:8000": FakeServer.remote("2,3")}
    yield servers
    for h in servers.values():
        ray.kill(h)


@pytest.fixture
def balancer(redis_url, tmp_path, replicas):
    """verl's own router factory starts tailspec's balancer from the router file, as main_ppo does."""
    path = vc.write_router_file(tmp_path / "router.yaml", _settings(redis_url, tmp_path))
    handle = get_router_handle(servers=replicas, router_config_path=str(path))
    yield handle, path
    ray.kill(handle)


async def _route(client: LLMServerClient, n: int) -> list[TokenOutput]:
    return await asyncio.gather(*[client.generate(f"req{i}", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 4})
                                  for i in range(n)])


def test_router_reports_in_flight_requests_per_replica(balancer, replicas, redis_client):
    handle, path = balancer
    cfg = _verl_config(path, Path("/unused"), Path("/unused"))
    ray.get(handle.tailspec_begin.remote(5))
    client = LLMServerClient(cfg, load_balancer_handle=handle)  # verl's own client: acquire -> generate -> release

    async def run():
        task = asyncio.ensure_future(_route(client, 6))
        got = await asyncio.to_thread(_wait, lambda: (p := _progress(redis_client)) and
                                      sum(x.active for x in p.values()) == 6 and p)
        for h in replicas.values():
            await h.open.remote()
        return got, await task

    during, outs = asyncio.run(run())
    assert [len(o.token_ids) for o in outs] == [3] * 6
    node = node_name(ray.get_runtime_context().get_node_id())
    assert {w: (p.node, p.gpus) for w, p in during.items()} == {"verl-replica-0": (node, [0, 1]),
                                                                "verl-replica-1": (node, [2, 3])}
    assert all(p.step == 5 and p.phase == "rollout" and p.active == 3 for p in during.values())  # least-loaded
    loads = ray.get(handle.tailspec_end.remote())
    after = _wait(lambda: (p := _progress(redis_client)) and all(x.active == 0 for x in p.values()) and p)
    assert sorted((p.finished, p.total) for p in after.values()) == [(3, 3), (3, 3)]
    assert sum(v["finished"] for v in loads.values()) == 6


class FakeAgentLoopWorker:
    """Stands in for verl's AgentLoopWorker actor: routes each row through verl's LLMServerClient (so the
    balancer counts it) and returns the batch keys verl's agent loop returns, rewards included."""

    def __init__(self, client: LLMServerClient):
        self.client = client
        self.generate_sequences = self  # `worker.generate_sequences.remote(chunk)`, as on a Ray actor

    async def remote(self, chunk: DataProto) -> DataProto:
        n = len(chunk)
        outs = await _route(self.client, n)
        prompts = chunk.batch["input_ids"]
        responses = torch.tensor([o.token_ids + [0] for o in outs])
        mask = torch.cat([chunk.batch["attention_mask"], (responses != 0).long()], dim=1)
        rm = torch.zeros(responses.shape)
        rm[:, 0] = torch.arange(n, dtype=torch.float32)
        metric = {"generate_sequences": 0.1, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": 0}
        return DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                                            "rm_scores": rm}, meta_info={"metrics": [metric] * n})


def _batch(n: int, step: int, validate: bool = False) -> DataProto:
    ids = torch.tensor([[0, 5, 6, 7]] * n)
    mask = torch.tensor([[0, 1, 1, 1]] * n)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               meta_info={"global_steps": step, "validate": validate})


def _samples(r) -> list[dict]:
    return [json.loads(f[b"data"]) for _, f in r.xrange(state.key(CLUSTER, "samples"))]


def test_manager_phases_policy_and_samples_around_generation(balancer, redis_url, redis_client, tmp_path):
    handle, path = balancer
    model = write_target(tmp_path / "model")
    cfg = _verl_config(path, model, tmp_path / "ckpt")
    llm = LLMServerClient(cfg, load_balancer_handle=handle)
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    attach = attach_from_config(cfg, handle, client=client)
    manager = TailspecAgentLoopManager(cfg, llm, tailspec=attach)
    manager.agent_loop_workers = [FakeAgentLoopWorker(llm), FakeAgentLoopWorker(llm)]
    for h in ray.get(handle.tailspec_servers.remote()).values():
        ray.get(h.open.remote())

    out = manager.generate_sequences(_batch(4, step=1))  # verl's sync call from fit()
    assert out.batch["responses"].shape == (4, 4) and "timing" in out.meta_info  # verl's own concat + metrics
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.phase, phase.step, phase.policy_version) == ("train", 1, 0)
    assert attach.stats.published == [0] and (tmp_path / "policy" / "policy-v00000000" / "config.json").is_file()
    assert attach.stats.waits[-1]["reclaimed"] is True
    assert sum(v["finished"] for v in attach.stats.loads[-1].values()) == 4

    hf = tmp_path / "ckpt" / "global_step_1" / "actor" / "huggingface"  # what verl writes with hf_model
    write_target(hf)
    manager.generate_sequences(_batch(2, step=2))
    assert attach.stats.published == [0, 1]
    client.flush(5.0)
    rows = _wait(lambda: len(s := _samples(redis_client)) == 6 and s)
    assert [(r["policy_version"], r["reward"]) for r in rows] == [(0, 0.0), (0, 1.0), (0, 0.0), (0, 1.0),
                                                                    (1, 0.0), (1, 0.0)]
    assert all(r["prompt_ids"] == [5, 6, 7] and r["response_ids"] == [7, 7, 7] for r in rows)  # padding dropped
    assert attach.stats.samples == 6

    before = list(attach.stats.waits)
    manager.generate_sequences(_batch(2, step=3, validate=True))  # validation: no phase calls at all
    assert attach.stats.waits == before
    client.close()


def _promote(r, version: int, path: Path) -> None:
    info = DrafterVersion(version=version, path=str(path), policy_version=0, acceptance_length=2.0,
                          promoted=True, created_at=time.time())
    state.put(r, state.key(CLUSTER, "drafter_current"), info)


def test_promotion_reloads_every_replica_between_batches(balancer, replicas, redis_url, redis_client, tmp_path):
    handle, path = balancer
    model = write_target(tmp_path / "model")
    first, second = write_drafter(tmp_path / "d1"), write_drafter(tmp_path / "d2")
    wrong = write_drafter(tmp_path / "wrong", hidden=32)
    cfg = _verl_config(path, model, tmp_path / "ckpt")
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    settings = _settings(redis_url, tmp_path, drafter_path=str(first), drafter_version=1)
    _promote(redis_client, 1, first)
    attach = attach_from_config(cfg, handle, settings=settings, client=client)
    attach.before_rollout(1)  # the version the replicas started with: nothing to load
    assert all(ray.get(h.calls.remote()) == [] for h in replicas.values())

    _promote(redis_client, 2, second)
    attach.before_rollout(2)
    for h in replicas.values():
        assert ray.get(h.calls.remote()) == [("tailspec_reload_drafter", [str(second)]), ("clear_kv_cache", [])]
    _promote(redis_client, 3, wrong)  # another target's drafter: refused before any replica sees it
    attach.before_rollout(3)
    assert all(len(ray.get(h.calls.remote())) == 2 for h in replicas.values())
    assert attach.live.version.version == 2 and 3 in attach.live.refused
    client.close()


def test_health_guard_per_replica_repairs_a_drafter_a_weight_sync_broke(balancer, replicas, redis_url,
                                                                        redis_client, tmp_path):
    """Each replica's counters per batch (read inside its server actor) feed its own guard: the replica whose
    drafter verl's weight sync broke trips alone, and the same drafter is reloaded before the next batch."""
    handle, path = balancer
    model, good = write_target(tmp_path / "model"), write_drafter(tmp_path / "good")
    cfg = _verl_config(path, model, tmp_path / "ckpt")
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    _promote(redis_client, 1, good)
    settings = _settings(redis_url, tmp_path, drafter_path=str(good), drafter_version=1, submit_samples=False)
    attach = attach_from_config(cfg, handle, settings=settings, client=client)
    llm = LLMServerClient(cfg, load_balancer_handle=handle)
    servers = ray.get(handle.tailspec_servers.remote())

    def batch(step: int) -> list:
        """Four requests held until both replicas have two in flight (an even split), then released."""
        attach.before_rollout(step)

        async def run():
            task = asyncio.ensure_future(_route(llm, 4))
            await asyncio.to_thread(_wait, lambda: (p := _progress(redis_client)) and
                                    [x.active for x in p.values() if x.step == step] == [2, 2])
            for h in servers.values():
                await h.open.remote()
            await task

        asyncio.run(run())
        for h in servers.values():
            ray.get(h.close.remote())
        attach.after_rollout(step, None)
        return [(v["event"], v["tripped"], round(v["live"], 3)) for v in attach.stats.verdicts]

    assert batch(1) == [("load", False, 3.0)] * 2  # 3 tokens a forward against 2.0 validated at k = 4
    broken = servers["10.0.0.2:8000"]
    ray.get(broken.break_drafter.remote())  # verl's weight sync into that replica breaks its drafter
    assert batch(2)[2:] == [("policy_sync", False, 3.0), ("policy_sync", True, 1.0)]
    status = redis_client.hgetall(state.key(CLUSTER, "drafter_guard"))
    assert {k.decode(): state.decode(state.GuardStatus, v).tripped for k, v in status.items()} == {
        "verl-replica-0": False, "verl-replica-1": True}
    assert batch(3)[4:] == [("rollback", False, 3.0)] * 2  # the same drafter reloaded into every replica first
    assert all(ray.get(h.calls.remote())[:2] == [("tailspec_reload_drafter", [str(good)]), ("clear_kv_cache", [])]
               for h in servers.values())
    client.close()


def test_overrides_compose_into_verls_config_tree(tmp_path, redis_url):
    """The printed overrides against verl's own Hydra config and dataclasses: each lands where verl reads it."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    model, drafter = write_target(tmp_path / "model"), write_drafter(tmp_path / "d")
    out = tmp_path / "tailspec-verl.yaml"
    assert vc.main(["--redis", redis_url, "--cluster", CLUSTER, "--policy-root", str(tmp_path / "policy"),
                    "--model", str(model), "--drafter", str(drafter), "--k", "3", "--out", str(out)]) == 0
    spec = vc.drafter_speculative_config(drafter, model, 3)
    overrides = vc.hydra_overrides(out, spec)
    conf_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[*overrides, "actor_rollout_ref.rollout.name=vllm"])
    rollout = cfg.actor_rollout_ref.rollout
    assert OmegaConf.to_container(rollout.engine_kwargs.vllm.speculative_config) == spec
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3 and spec["model"] == str(drafter)
    assert rollout.engine_kwargs.vllm.worker_extension_cls == vc.WORKER_EXTENSION
    assert load_class_from_fqn(rollout.agent.agent_loop_manager_class, "AgentLoopManager") is TailspecAgentLoopManager
    assert omega_conf_to_dataclass(rollout).router_config_path == str(out.resolve())
    assert vc.settings_from_verl_config(cfg) == vc.VerlSettings(
        redis_url=redis_url, cluster=CLUSTER, policy_root=str(tmp_path / "policy"), drafter_path=str(drafter),
        drafter_k=3)
    assert vc.load_router_file(out)["router_class"] == vc.ROUTER_CLASS


def test_settings_refuse_unknown_keys_and_relative_policy_root():
    with pytest.raises(ValueError, match="unknown tailspec settings"):
        vc.VerlSettings.from_mapping({"redis_url": "redis://x", "polcy_root": "/p"})
    with pytest.raises(ValueError, match="absolute"):
        vc.VerlSettings(redis_url="redis://x", policy_root="rel/policy")


def test_attach_without_balancer_still_sets_phases(redis_url, redis_client, tmp_path):
    client = TailspecClient(redis_url, cluster=CLUSTER, node="n0")
    attach = VerlAttach(_settings(redis_url, tmp_path), client, model_dir=write_target(tmp_path / "m"),
                        checkpoint_root=tmp_path / "ckpt")
    attach.before_rollout(4)
    client.flush(5.0)
    phase = state.get(redis_client, state.key(CLUSTER, "phase"), PhaseInfo)
    assert (phase.phase, phase.step, phase.policy_version) == ("rollout", 4, 3)
    assert phase.policy_path == str(tmp_path / "policy" / "policy-v00000000")
    client.close()


@pytest.mark.gpu
@pytest.mark.vllm
def test_verl_gpu_worker_extension_in_a_real_vllm_engine():
    """GPU only, never run on the CPU machine this was written on (verl's extension module imports vLLM, and
    verl drives vLLM on CUDA): the combined worker extension inside a real vLLM engine started with the
    adapter's speculative_config. verl's policy sync leaves the EAGLE-3 drafter alone, and tailspec's reload
    through the same class changes the drafter's weights while greedy outputs stay identical."""
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout, greedy
    from vllm_helpers import drafters, prompts, tiny

    d = drafters()
    assert vc.drafter_speculative_config(d["untrained"], tiny(), 3)["method"] == "eagle3"
    ro = VllmRollout(tiny(), DrafterSpec("eagle3", d["untrained"], k=3), max_model_len=256, max_num_seqs=8,
                     worker_extension_cls=vc.WORKER_EXTENSION)
    try:
        assert ro.llm.collective_rpc("_use_mtp_drafter_weight_sync") == [False]  # verl's method, same worker
        before, digest = ro.generate(prompts(), greedy(32)), ro.drafter_digest()
        ro.reload_drafter(d["trained"])
        after = ro.generate(prompts(), greedy(32))
        assert ro.drafter_digest()["sha256"] != digest["sha256"]
        assert [c.token_ids for c in before.completions] == [c.token_ids for c in after.completions]
    finally:
        ro.close()
