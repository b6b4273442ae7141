"""OpenRLHF's PPO trainer with tailspec attached (openrlhf==0.11.2): `TailspecTrainerMixin` put before the class
under OpenRLHF's `@ray.remote PPOTrainer`, and the monkey-patch that makes OpenRLHF's launcher start it (no
hook exists for it in 0.11.2; tailspec.integrations.openrlhf says why).

OpenRLHF's trainer module imports DeepSpeed and flash-attn, so this module is imported only where a real job
runs (the launcher, on a GPU cluster); the mixin's logic lives, and is tested, in
tailspec.integrations.openrlhf_mixin.
"""

from __future__ import annotations

from typing import Any

import ray
from openrlhf.trainer import ppo_trainer

from tailspec.integrations.openrlhf_mixin import TailspecTrainerMixin


class TailspecPPOTrainer(TailspecTrainerMixin, ppo_trainer.PPOTrainer.__ray_actor_class__):
    """OpenRLHF's `PPOTrainer` with tailspec's calls (TailspecTrainerMixin)."""


def install_trainer(settings: dict) -> Any:
    """Monkey-patch: `openrlhf.trainer.ppo_trainer.PPOTrainer`, which OpenRLHF's `train()` imports by name, becomes
    a Ray actor class of `TailspecPPOTrainer` carrying the run's settings (made per run: pickled by value)."""
    cls = type("TailspecPPOTrainerForRun", (TailspecPPOTrainer,), {"tailspec_settings": dict(settings)})
    actor = ray.remote(cls)
    ppo_trainer.PPOTrainer = actor
    return actor
