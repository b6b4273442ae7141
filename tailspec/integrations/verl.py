"""tailspec attached to verl's PPO trainer (verl==0.9.1, the `verl` extra; the recipe: docs/verl.md).

verl names the classes it runs in its configuration, so tailspec attaches through configuration alone, with
verl's code unchanged:

- `actor_rollout_ref.rollout.router_config_path` -> a YAML file whose `router_class` is
  `tailspec.integrations.verl_router.TailspecLoadBalancer` (per-replica in-flight requests -> progress) and
  whose `tailspec:` section holds the settings (`tailspec.integrations.verl_config`);
- `actor_rollout_ref.rollout.agent.agent_loop_manager_class` -> `TailspecAgentLoopManager` (this module): a
  subclass of verl's `AgentLoopManager` whose `generate_sequences` calls the original unchanged between
  `VerlAttach.before_rollout` (publish the policy, reload a promoted drafter into every replica, phase
  "rollout", the balancer's counts reset) and `VerlAttach.after_rollout` (phase "train", wait until every lent
  GPU is back, submit the batch's samples). verl's `RayPPOTrainer.fit` calls it once per training batch,
  before the replicas sleep and before log-probs, the critic and the actor update use the GPUs; validation
  batches (`meta_info["validate"]`) pass through untouched;
- `actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config` -> the drafter export's vLLM config, and
  `...engine_kwargs.vllm.worker_extension_cls` -> `tailspec.integrations.verl_worker_ext.
  TailspecVerlWorkerExtension` (verl's own extension plus tailspec's reload method).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.experimental.agent_loop import AgentLoopManager
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await

from tailspec.integrations.verl_attach import VerlAttach
from tailspec.integrations.verl_config import VERL_VERSION, VerlSettings, settings_from_verl_config
from tailspec.scheduler.attach import ray_node_name
from tailspec.scheduler.client import TailspecClient

log = logging.getLogger(__name__)

__all__ = ["VERL_VERSION", "TailspecAgentLoopManager", "attach_from_config"]


def attach_from_config(config: Any, balancer: Any, settings: VerlSettings | None = None,
                       client: Any = None, **kw: Any) -> VerlAttach:
    """The driver's `VerlAttach` for a verl trainer config: settings from its router file, the policy's HF
    directory, verl's checkpoint root (`trainer.default_local_dir`) and the replicas' `max_num_seqs`."""
    settings = settings or settings_from_verl_config(config)
    if client is None:  # the driver runs inside verl's Ray job: its node's name
        client = TailspecClient(settings.redis_url, cluster=settings.cluster, node=ray_node_name())
    rollout = config.actor_rollout_ref.rollout
    if balancer is None:
        log.warning("tailspec: verl's client has no load balancer handle: no per-replica progress, no reloads")
    return VerlAttach(settings, client, model_dir=config.actor_rollout_ref.model.path,
                      checkpoint_root=config.trainer.default_local_dir, balancer=balancer,
                      max_num_seqs=int(rollout.get("max_num_seqs") or 256), **kw)


class TailspecAgentLoopManager(AgentLoopManager):
    """verl's `AgentLoopManager` with tailspec's calls around each training batch (module doc). verl builds it
    with its own arguments (`AgentLoopManager.create`); the load balancer is the one verl's client routes
    through."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, *, tailspec: VerlAttach | None = None):
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        # verl 0.9.1 keeps the balancer actor on its client (`LLMServerClient._load_balancer`) and offers
        # no accessor; read once here, so a verl that renames it fails at start, not mid-run.
        self.tailspec = tailspec or attach_from_config(config, getattr(llm_client, "_load_balancer", None))

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        if prompts.meta_info.get("validate", False):
            return await super().generate_sequences(prompts)
        step = int(prompts.meta_info.get("global_steps", 0))
        # the calls block (Redis, Ray, file copies): off the event loop verl's agent loops run on
        await asyncio.to_thread(self.tailspec.before_rollout, step)
        out = await super().generate_sequences(prompts)
        await asyncio.to_thread(self.tailspec.after_rollout, step, out)
        return out
