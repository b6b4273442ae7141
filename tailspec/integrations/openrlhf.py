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
- the PPO trainer (`openrlhf_trainer.TailspecPPOTrainer` = `TailspecTrainerMixin` + `PPOTrainer`'s class; the
  mixin and its generator in openrlhf_mixin.py) builds
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
import logging
import os
import runpy
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import ray
from openrlhf.trainer.ray import vllm_engine

from tailspec.integrations.openrlhf_config import (
    OPENRLHF_VERSION,
    OpenRLHFSettings,
    engine_kwargs,
    load_settings,
)
from tailspec.integrations.openrlhf_progress import workers_where
from tailspec.scheduler.attach import ray_node_name

__all__ = ["OPENRLHF_VERSION", "TailspecRolloutActor", "engine_actor_class", "install_engines", "main"]

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
