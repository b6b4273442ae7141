"""tailspec's part of OpenRLHF's PPO trainer (openrlhf==0.11.2): `TailspecTrainerMixin`, put before the class under
OpenRLHF's `@ray.remote PPOTrainer` (openrlhf_trainer.py), and the `TailspecSamplesGenerator` it puts in place of
the trainer's `SamplesGenerator` (tailspec.integrations.openrlhf's doc says what each call does).

Importable without DeepSpeed and flash-attn, which OpenRLHF's trainer module needs: the mixin is tested here, with
stand-in trainers, and put on the real class only where a job runs.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from tailspec.integrations.openrlhf_attach import OpenRLHFAttach
from tailspec.integrations.openrlhf_config import OpenRLHFSettings
from tailspec.scheduler.attach import ray_node_name
from tailspec.scheduler.client import TailspecClient


class TailspecSamplesGenerator(SamplesGenerator):
    """OpenRLHF's `SamplesGenerator` with tailspec's calls around each training batch's generation
    (tailspec.integrations.openrlhf's doc). It generates through the attachment's counted engine handles (per-engine progress)."""

    def __init__(self, strategy: Any, prompts_dataloader: Any, eval_dataloader: Any, tokenizer: Any,
                 vllm_engines: list | None, *, tailspec: OpenRLHFAttach):
        self.tailspec = tailspec
        engines = tailspec.counted_engines() if vllm_engines else vllm_engines
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, engines)
        self._tailspec_batch = False

    def generate_samples(self, **generate_kwargs: Any) -> Any:
        self._tailspec_batch = True
        try:
            out = super().generate_samples(**generate_kwargs)
        finally:
            self._tailspec_batch = False
        self.tailspec.after_rollout(out[0])  # nothing when the batch came from OpenRLHF's buffer
        return out

    def _generate_vllm(self, dataloader_iter: Any, num_prompts: int, dynamic_filtering: Any,
                       **generate_kwargs: Any) -> Any:
        # OpenRLHF's private method (hence the exact pin): called after the engines were woken, before the
        # first request goes out — the one moment a drafter reload reaches awake engines between batches
        if self._tailspec_batch:
            first = next(dataloader_iter, None)  # an epoch's end draws no prompt: no rollout to announce
            if first is not None:
                dataloader_iter = itertools.chain([first], dataloader_iter)
                self.tailspec.before_rollout()
            else:
                dataloader_iter = iter(())
        return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)


class TailspecTrainerMixin:
    """tailspec's part of the PPO trainer, put before OpenRLHF's `PPOTrainer` class (openrlhf_trainer.py). The
    settings are a class attribute of the per-run subclass the launcher makes."""

    tailspec_settings: ClassVar[dict] = {}

    def __init__(self, pretrain: str, strategy: Any, *groups: Any, **generate_kwargs: Any):
        super().__init__(pretrain, strategy, *groups, **generate_kwargs)
        args, engines = strategy.args, self.vllm_engines
        settings = OpenRLHFSettings.from_mapping(dict(self.tailspec_settings))
        client = TailspecClient(settings.redis_url, cluster=settings.cluster, node=ray_node_name())
        self.tailspec = OpenRLHFAttach(settings, client, model_dir=pretrain, checkpoint_root=args.ckpt.path,
                                       engines=engines, slept=bool(args.vllm.enable_sleep))
        self.samples_generator = TailspecSamplesGenerator(strategy, self.prompts_dataloader, self.eval_dataloader,
                                                          self.tokenizer, engines, tailspec=self.tailspec)

    def fit(self, global_step: int = 0) -> None:
        # a resumed run starts from its checkpoint's step (OpenRLHF reads it again inside fit)
        self.tailspec.updated(self.init_checkpoint_states()["global_step"] or global_step)
        return super().fit(global_step)

    def train_step(self, rollout_samples: Any, global_step: int) -> Any:
        status, step = super().train_step(rollout_samples, global_step)
        self.tailspec.updated(step)
        return status, step
