"""What a verl run needs to attach tailspec: one settings file and the Hydra overrides that name it.

Everything verl runs of tailspec is reached through verl's own configuration (docs/verl.md): the rollout's
router plugin file (`actor_rollout_ref.rollout.router_config_path`) names tailspec's load balancer as its
`router_class` and carries tailspec's settings under `tailspec:`; the agent-loop manager class and the vLLM
engine arguments (`speculative_config`, `worker_extension_cls`) are overrides. The driver-side manager reads
the same file through `router_config_path`, so the settings live in one place.

    python -m tailspec.integrations.verl_config --redis redis://sched:6379/0 --cluster run7 \\
        --policy-root /shared/run7/policy --model /shared/models/qwen --drafter /shared/run7/drafter-eagle3 \\
        --k 4 --out /shared/run7/tailspec-verl.yaml

writes the file and prints the overrides, one per line, to append to verl's launch command.

This module imports neither verl nor vLLM: the file and the overrides can be made on any machine.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from tailspec.integrations.framework import drafter_speculative_config, guard_policy, refuse_unknown

VERL_VERSION = "0.9.1"  # the release the adapter's hooks were read from and tested against (pyproject: verl extra)
ROUTER_CLASS = "tailspec.integrations.verl_router.TailspecLoadBalancer"
MANAGER_CLASS = "tailspec.integrations.verl.TailspecAgentLoopManager"
WORKER_EXTENSION = "tailspec.integrations.verl_worker_ext.TailspecVerlWorkerExtension"


@dataclass
class VerlSettings:
    """tailspec's side of a verl run (the `tailspec:` section of the router file)."""

    redis_url: str
    cluster: str = "default"
    policy_root: str | None = None  # absolute, shared by the nodes that run sessions; None: no policy published
    reclaim_timeout_s: float = 30.0  # how long the update waits for lent GPUs to come back
    submit_samples: bool = True  # rollouts with their agent-loop rewards go to the sample stream
    drafter_path: str | None = None  # the EAGLE-3 directory the vLLM replicas were started with
    drafter_version: int | None = None  # its version in the lineage (None: not a promoted version)
    drafter_k: int = 4
    worker_prefix: str = "verl-replica"  # progress is reported as worker "<prefix>-<n>" per server replica
    # the drafter health guard (rollout.health_guard) over each engine's spec-decode counters, batch by batch
    guard: bool = True
    guard_window_drafts: int = 16  # drafts a verdict needs (one batch holds hundreds)
    guard_floor: float = 1.05  # tokens per forward at or below which a drafter is broken
    guard_min_gain_share: float = 0.5  # live gain below this share of the validated gain: broken

    def __post_init__(self) -> None:
        if self.policy_root is not None and not Path(self.policy_root).is_absolute():
            raise ValueError(f"policy_root {self.policy_root!r} must be an absolute path on a shared filesystem")
        if self.reclaim_timeout_s <= 0:
            raise ValueError(f"reclaim_timeout_s must be > 0, got {self.reclaim_timeout_s}")
        guard_policy(self)  # its bounds, named (GuardPolicy)

    @classmethod
    def from_mapping(cls, data: Any) -> VerlSettings:
        """From the `tailspec:` section (a dict or an OmegaConf node); unknown keys are refused by name."""
        if data is None:
            raise ValueError("the router file has no `tailspec:` section (write it with tailspec.integrations.verl_config)")
        d = dict(data.items()) if hasattr(data, "items") else data
        refuse_unknown(cls, d)
        return cls(**d)


def load_router_file(path: str | Path) -> dict:
    """The router file as a plain dict (what verl hands the load balancer's constructor)."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise TypeError(f"router file {path} is not a mapping")
    return data


def settings_from_verl_config(config: Any) -> VerlSettings:
    """The settings of a verl trainer config: its rollout's `router_config_path` names the tailspec file."""
    path = config.actor_rollout_ref.rollout.get("router_config_path")
    if not path:
        raise ValueError("actor_rollout_ref.rollout.router_config_path is not set: tailspec's settings live in that "
                         "file (see docs/verl.md)")
    return VerlSettings.from_mapping(load_router_file(path).get("tailspec"))


def write_router_file(path: str | Path, settings: VerlSettings) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"router_class": ROUTER_CLASS, "tailspec": asdict(settings)}, sort_keys=False))
    return path


def _hydra_value(v: Any) -> str:
    """A value in Hydra's override grammar: dict keys bare, strings single-quoted (so paths and dots stay one
    string), lists and numbers as written."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_overrides(router_file: str | Path, spec_conf: dict | None) -> list[str]:
    """The overrides that attach tailspec to verl's PPO trainer (main_ppo), for the pinned verl's config tree.
    Keys verl's YAML defaults do not list (`agent.agent_loop_manager_class` is only in its dataclass;
    `engine_kwargs.vllm` is an empty mapping) take Hydra's `++` (add, or override if present)."""
    out = [
        f"actor_rollout_ref.rollout.router_config_path={Path(router_file).resolve()}",
        f"++actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_CLASS}",
        f"++actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={WORKER_EXTENSION}",
        # vLLM's per-request spec-decode counters (verl's spec metrics) need the engine's stats on
        "actor_rollout_ref.rollout.disable_log_stats=False",
    ]
    if spec_conf is not None:
        out.append(f"++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={_hydra_value(spec_conf)}")
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tailspec.integrations.verl_config", description=__doc__.split("\n")[0])
    p.add_argument("--redis", required=True, help="the scheduler's Redis URL")
    p.add_argument("--cluster", default="default")
    p.add_argument("--policy-root", help="absolute shared directory the policy versions are published in")
    p.add_argument("--model", required=True, help="the policy's HF directory (actor_rollout_ref.model.path)")
    p.add_argument("--drafter", help="an EAGLE-3 export to start the replicas with (none: no speculation)")
    p.add_argument("--drafter-version", type=int, help="the lineage version that export is")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--reclaim-timeout", type=float, default=30.0)
    p.add_argument("--out", required=True, help="where to write the router file (readable on every node)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    spec = drafter_speculative_config(a.drafter, a.model, a.k) if a.drafter else None
    settings = VerlSettings(redis_url=a.redis, cluster=a.cluster, policy_root=a.policy_root,
                            reclaim_timeout_s=a.reclaim_timeout, drafter_version=a.drafter_version, drafter_k=a.k,
                            drafter_path=str(Path(a.drafter).resolve()) if a.drafter else None)
    path = write_router_file(a.out, settings)
    print("\n".join(hydra_overrides(path, spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
