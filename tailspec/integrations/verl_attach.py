"""The driver side of tailspec attached to verl: phase calls, the policy the teacher loads, drafter reloads into
every vLLM replica, and the batch's samples. `tailspec.integrations.verl.TailspecAgentLoopManager` calls
`before_rollout` and `after_rollout` around each training batch's generation; this module needs no verl
import (it reads verl's output batch by its documented keys), so its logic runs anywhere.

- **Policy for the teacher.** verl's actor weights live sharded in its training workers; verl itself writes a
  whole HF directory (`<trainer.default_local_dir>/global_step_<M>/actor/huggingface`) at every checkpoint
  whose `actor.checkpoint.save_contents` includes `hf_model`. Before each batch the newest such directory not
  yet published is published as policy version M (`PolicyPublisher`: temp dir, fsync, rename; files are
  hard-linked where the filesystem allows, so verl's checkpoint rotation cannot pull them from under a
  session); before the first checkpoint, the base model (`actor_rollout_ref.model.path`) is version 0. The
  teacher therefore lags the actor by up to `trainer.save_freq` steps.
- **Drafter reload.** `LiveVllm` (rollout.vllm_live) is the promotion watcher, over `VerlReplicas`: a
  promoted version is exported once (`load_drafter`), checked against the live drafter, and loaded into every
  replica through tailspec's vLLM worker extension (`collective_rpc("tailspec_reload_drafter")` on verl's
  server actor), then each replica's prefix cache is reset — before the batch's first request, never during
  one. verl's engine core runs in its own process, so the k schedule stays as started.
- **Health guard.** Each replica's spec-decode counters are read inside its server actor before a batch and
  when it is back (`BatchWatch`); `LiveVllm.observe_engines` judges each replica's difference with its own
  guard, armed after every load, reload and weight sync ("policy_sync": verl's `update_weights` before the
  batch). A trip is handled by a reload before the next batch (docs/verl.md).
- **Phases.** "rollout" with the generating policy version (step − 1: verl's step N generates with the weights
  of N − 1 updates) and the newest published policy; when the batch is back, "train", then `wait_reclaimed`
  before verl's next GPU work (log-probs, the actor update).
- **Samples.** With agent-loop rewards (`rm_scores` in the batch: verl's streaming reward loop), each
  trajectory's prompt and response ids (attention mask) and summed reward go to the sample stream.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from tailspec.integrations.framework import (
    AttachStats,
    BatchWatch,
    RemoteCall,
    RemoteEngines,
    follow_promotions,
    guard_policy,
    publish_newest,
    wait_reclaimed,
)
from tailspec.integrations.policy import PolicyPublisher
from tailspec.integrations.verl_config import VerlSettings
from tailspec.rollout.vllm_live import LiveVllm

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class VerlReplicas(RemoteEngines):
    """verl's vLLM server replicas as `LiveVllm`'s reload target: a reload goes to every replica's server actor
    (`servers()`: replica name → actor handle, read from the load balancer at each reload)."""

    def __init__(self, servers: Callable[[], dict[str, Any]], call: RemoteCall, policy_dir: str | Path,
                 drafter_path: str | Path, k: int, max_num_seqs: int):
        super().__init__(call, policy_dir, drafter_path, k, max_num_seqs)
        self.servers = servers

    def handles(self) -> dict[str, Any]:
        return self.servers()

    def _send(self, path: Path) -> dict:
        handles = list(self.servers().values())
        self.call([h.collective_rpc.remote("tailspec_reload_drafter", args=(str(path),)) for h in handles])
        self.call([h.clear_kv_cache.remote() for h in handles])  # no prefix state of the old drafter is reused
        return {"replicas": len(handles)}


def newest_hf_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """verl's newest `global_step_<M>/actor/huggingface` with a config.json under `root`, or None."""
    root = Path(root)
    best = None
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.match(d.name)
            hf = d / "actor" / "huggingface"
            if m and (hf / "config.json").is_file() and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), hf)
    return best


class VerlAttach:
    """The tailspec side of verl's driver (module doc). `balancer` is the load balancer actor's handle (None:
    no per-replica progress, no reload targets); `call` waits for Ray object refs."""

    def __init__(self, settings: VerlSettings, client: Any, *, model_dir: str | Path, checkpoint_root: str | Path,
                 balancer: Any = None, call: RemoteCall | None = None, max_num_seqs: int = 256):
        self.settings, self.client, self.balancer = settings, client, balancer
        self.call = call or _ray_get
        self.model_dir, self.checkpoint_root = Path(model_dir), Path(checkpoint_root)
        self.publisher = PolicyPublisher(settings.policy_root) if settings.policy_root else None
        self.stats = AttachStats()
        self.live: LiveVllm | None = None
        self.watch: BatchWatch | None = None
        if settings.drafter_path is not None and balancer is not None:
            replicas = VerlReplicas(self._servers, self.call, self.model_dir, settings.drafter_path,
                                    settings.drafter_k, max_num_seqs)
            self.live = follow_promotions(replicas, client, settings.cluster, settings.drafter_version,
                                          worker=settings.worker_prefix, guard=guard_policy(settings))
            self.watch = BatchWatch(self.live, replicas)

    def _servers(self) -> dict[str, Any]:
        return self.call([self.balancer.tailspec_servers.remote()])[0]

    def _balancer(self, method: str, *args: Any) -> Any:
        if self.balancer is None:
            return None
        return self.call([getattr(self.balancer, method).remote(*args)])[0]

    # -- the policy the teacher loads ------------------------------------------------------------------
    def publish_policy(self) -> tuple[int, Path] | None:
        """Publish verl's newest HF checkpoint if it is newer than the last published one (the base model
        before any); returns the latest published (version, path)."""
        if self.publisher is None:
            return None
        return publish_newest(self.publisher, newest_hf_checkpoint(self.checkpoint_root), self.model_dir,
                              self.stats)

    # -- around one batch's generation ------------------------------------------------------------------
    def before_rollout(self, step: int) -> None:
        latest = self.publish_policy()
        if self.watch is not None:
            # replicas idle between two generation calls; after the first batch verl has synced its last update's
            # weights into them (`update_weights` wakes them)
            self.watch.before(max(step - 1, 0))
        self.client.set_phase("rollout", step, policy_version=max(step - 1, 0),
                              policy_path=str(latest[1]) if latest else None)
        self._balancer("tailspec_begin", step)

    def after_rollout(self, step: int, out: Any) -> None:
        loads = self._balancer("tailspec_end")
        if loads is not None:
            self.stats.loads.append(loads)
        if self.watch is not None:
            self.stats.verdicts += self.watch.after({sid: d["worker"] for sid, d in (loads or {}).items()
                                                     if d.get("worker")})
        self.client.set_phase("train", step, policy_version=max(step - 1, 0))
        wait_reclaimed(self.client, self.settings.reclaim_timeout_s, step, self.stats)
        if self.settings.submit_samples:
            self.submit(out, max(step - 1, 0))

    def submit(self, out: Any, policy_version: int) -> int:
        """The batch's trajectories with their agent-loop rewards; without `rm_scores` (rewards computed
        after the batch, e.g. by a reward model on its own pool) nothing is submitted."""
        batch = out.batch
        if "rm_scores" not in batch.keys():  # noqa: SIM118 - TensorDict refuses `in` on itself
            return 0
        prompts, responses, mask = batch["prompts"], batch["responses"], batch["attention_mask"].bool()
        rewards = batch["rm_scores"].sum(dim=-1)
        plen = prompts.shape[1]
        samples = []
        for i in range(prompts.shape[0]):
            r = float(rewards[i])
            if math.isnan(r):  # no reward to learn from
                self.stats.samples_dropped += 1
                continue
            samples.append({"prompt_ids": prompts[i][mask[i, :plen]].tolist(),
                            "response_ids": responses[i][mask[i, plen:]].tolist(),
                            "reward": r, "policy_version": policy_version})
        accepted = self.client.submit_samples(samples) if samples else 0
        self.stats.samples += accepted
        self.stats.samples_dropped += len(samples) - accepted
        return accepted


def _ray_get(refs: list[Any]) -> list[Any]:
    return ray.get(refs)
