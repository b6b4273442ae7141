"""tailspec attached to OpenRLHF's Ray PPO / GRPO trainer (openrlhf==0.11.2, the `openrlhf` extra; the recipe:
docs/openrlhf.md).

OpenRLHF 0.11.2 has no registry and no option naming the classes its launcher (`openrlhf.cli.train_ppo_ray`)
runs: `train()` builds its vLLM engines with `create_vllm_engines`, which starts the module-level
`openrlhf.trainer.ray.vllm_engine.RolloutRayActor` with a fixed vLLM worker extension and no way to add engine
arguments, and it imports `openrlhf.trainer.ppo_trainer.PPOTrainer` by name. So attaching replaces those two
module attributes with subclasses of the same classes before OpenRLHF's own launcher runs unchanged — that
is monkey-patching, the only way in; no OpenRLHF function or method body is replaced:

- `TailspecRolloutActor` (a subclass of `RolloutRayActor`'s class): adds tailspec's engine arguments
  (`speculative_config` from the drafter export, the worker extension `TailspecOpenRLHFWorkerExtension` =
  OpenRLHF's `WorkerWrap` + tailspec's reload) before OpenRLHF's constructor builds vLLM, and two methods:
  `tailspec_reload_drafter` (`collective_rpc` into the engine's workers, then a prefix-cache reset) and
  `tailspec_where` (its node and GPUs, read before OpenRLHF's constructor changes `CUDA_VISIBLE_DEVICES`;
  with tensor parallelism, where vLLM's Ray executor placed its workers, asked through `collective_rpc`);
- the PPO trainer (`openrlhf_trainer.TailspecPPOTrainer` = `TailspecTrainerMixin` + `PPOTrainer`'s class) builds
  an `OpenRLHFAttach` and replaces its `SamplesGenerator` with `TailspecSamplesGenerator`, whose
  `generate_samples` and `_generate_vllm` call OpenRLHF's unchanged between `before_rollout` (after OpenRLHF woke
  the engines: policy, drafter reload, phase "rollout", per-engine progress) and `after_rollout` (after it put
  them back to sleep: phase "train", `wait_reclaimed`, samples); its `train_step` tells the attachment how many
  PPO updates are done. Evaluation batches pass through untouched.

`python -m tailspec.integrations.openrlhf --tailspec FILE <train_ppo_ray's flags>` does the replacing and then
runs OpenRLHF's launcher as `__main__` with the remaining flags.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import runpy
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.trainer.ray import vllm_engine

from tailspec.integrations.openrlhf_attach import OpenRLHFAttach
from tailspec.integrations.openrlhf_config import (
    OPENRLHF_VERSION,
    OpenRLHFSettings,
    engine_kwargs,
    load_settings,
)
from tailspec.integrations.openrlhf_progress import workers_where
from tailspec.scheduler.attach import ray_node_name
from tailspec.scheduler.client import TailspecClient

__all__ = ["OPENRLHF_VERSION", "TailspecRolloutActor", "TailspecSamplesGenerator", "TailspecTrainerMixin",
           "engine_actor_class", "install_engines", "main"]

log = logging.getLogger(__name__)

_RolloutActorBase = vllm_engine.RolloutRayActor.__ray_actor_class__  # the class under OpenRLHF's @ray.remote


def _visible_gpus() -> list[int]:
    return [int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()]


class TailspecRolloutActor(_RolloutActorBase):
    """OpenRLHF's vLLM engine actor with tailspec's engine arguments and methods (module doc). The arguments
    are a class attribute of the per-run subclass `engine_actor_class` makes."""

    tailspec_engine_kwargs: ClassVar[dict] = {}

    async def __init__(self, *args: Any, **kwargs: Any):
        # before OpenRLHF's constructor: with tensor parallelism it clears CUDA_VISIBLE_DEVICES for vLLM's Ray
        # executor (this actor then holds no GPU of its own: `tailspec_where` asks the workers)
        self._tailspec_where = (ray_node_name(), _visible_gpus())
        await super().__init__(*args, **{**kwargs, **self.tailspec_engine_kwargs})

    async def tailspec_where(self) -> tuple[str, list[int]]:
        """Its node and GPUs; with tensor parallelism (no GPU of its own) those its vLLM workers run on."""
        node, gpus = self._tailspec_where
        if gpus:
            return node, gpus
        try:
            return workers_where(await self.llm.collective_rpc("tailspec_where"), node)
        except Exception as e:  # noqa: BLE001 - an engine that cannot say is reported on no GPU, never lent
            log.warning("tailspec: the engine's workers did not say where they run (%s)", e)
            return node, gpus

    async def tailspec_reload_drafter(self, path: str) -> list:
        """Load the drafter at `path` into every worker of this engine; its prefix cache is reset after, so no
        state computed with the old drafter is reused."""
        res = await self.llm.collective_rpc("tailspec_reload_drafter", args=(str(path),))
        await self.llm.reset_prefix_cache()
        return res


def engine_actor_class(settings: OpenRLHFSettings, model_dir: str | Path) -> Any:
    """The Ray actor class OpenRLHF's `create_vllm_engines` starts for this run: `TailspecRolloutActor` with the
    run's engine arguments, checked against the policy here (a drafter that does not fit is refused before any
    engine starts). A class made per run is pickled by value, so the arguments travel with it to every node."""
    kwargs = engine_kwargs(settings, model_dir)
    cls = type("TailspecRolloutActorForRun", (TailspecRolloutActor,), {"tailspec_engine_kwargs": kwargs})
    return ray.remote(cls)


def install_engines(settings: OpenRLHFSettings, model_dir: str | Path) -> Any:
    """Monkey-patch (OpenRLHF 0.11.2 offers no hook): the engine actor class `create_vllm_engines` starts."""
    actor = engine_actor_class(settings, model_dir)
    vllm_engine.RolloutRayActor = actor
    return actor


class TailspecSamplesGenerator(SamplesGenerator):
    """OpenRLHF's `SamplesGenerator` with tailspec's calls around each training batch's generation (module
    doc). It generates through the attachment's counted engine handles (per-engine progress)."""

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


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m tailspec.integrations.openrlhf", description=__doc__.split("\n")[0],
                                epilog="Every other flag goes to openrlhf.cli.train_ppo_ray unchanged.")
    p.add_argument("--tailspec", required=True, help="the settings file (tailspec.integrations.openrlhf_config)")
    p.add_argument("--actor.model_name_or_path", dest="model", required=True, help="OpenRLHF's own flag")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    a, rest = _args(argv)
    if "--train.async_enable" in rest:
        raise SystemExit("tailspec: OpenRLHF's async trainer (--train.async_enable) is not attached; "
                         "run the synchronous one")
    settings = load_settings(a.tailspec)
    install_engines(settings, a.model)
    # deferred: OpenRLHF's trainer module imports DeepSpeed and flash-attn (CUDA builds), present only where the
    # launcher runs a real job; the rest of this module stays importable without them
    from tailspec.integrations.openrlhf_trainer import install_trainer

    install_trainer(asdict(settings))
    sys.argv = ["openrlhf.cli.train_ppo_ray", "--actor.model_name_or_path", a.model, *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # through the package's module, so the classes handed to Ray are importable ones, not __main__'s copies
    from tailspec.integrations.openrlhf import main as _main

    _main()
