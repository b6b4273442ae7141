"""What an OpenRLHF run needs to attach tailspec: one settings file, read by the launcher
(`python -m tailspec.integrations.openrlhf`) on the Ray job's driver and carried from there into the engine and
trainer actors it starts (docs/openrlhf.md).

    python -m tailspec.integrations.openrlhf_config --redis redis://sched:6379/0 --cluster run7 \\
        --policy-root /shared/run7/policy --model /shared/models/qwen --drafter /shared/run7/drafter-eagle3 \\
        --k 4 --out /shared/run7/tailspec-openrlhf.yaml

checks the drafter against the model (before any engine starts), writes the file and prints the vLLM
`speculative_config` the engines will get.

This module imports neither OpenRLHF nor vLLM: the file can be made on any machine.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from tailspec.integrations.framework import drafter_speculative_config, guard_policy, refuse_unknown

OPENRLHF_VERSION = "0.11.2"  # the release the adapter's hooks were read from and tested against (the openrlhf extra)
WORKER_EXTENSION = "tailspec.integrations.openrlhf_worker_ext.TailspecOpenRLHFWorkerExtension"


@dataclass
class OpenRLHFSettings:
    """tailspec's side of an OpenRLHF run (the settings file)."""

    redis_url: str
    cluster: str = "default"
    policy_root: str | None = None  # absolute, shared by the nodes that run sessions; None: no policy published
    reclaim_timeout_s: float = 30.0  # how long the update waits for lent GPUs to come back
    submit_samples: bool = True  # rollouts with their executor rewards go to the sample stream
    drafter_path: str | None = None  # the EAGLE-3 directory the vLLM engines start with (None: no speculation)
    drafter_version: int | None = None  # its version in the lineage (None: not a promoted version)
    drafter_k: int = 4
    worker_prefix: str = "openrlhf-engine"  # progress is reported as worker "<prefix>-<n>" per vLLM engine
    progress_interval_s: float = 0.5  # how often the engines' unfinished requests are read during a rollout
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
        if self.progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s must be > 0, got {self.progress_interval_s}")
        if self.drafter_k < 1:
            raise ValueError(f"drafter_k must be >= 1, got {self.drafter_k}")

    @classmethod
    def from_mapping(cls, data: Any) -> OpenRLHFSettings:
        """From the file's mapping; unknown keys are refused by name."""
        if not isinstance(data, dict):
            raise TypeError("the tailspec settings file must hold a mapping (write it with "
                             "tailspec.integrations.openrlhf_config)")
        refuse_unknown(cls, data)
        return cls(**data)


def load_settings(path: str | Path) -> OpenRLHFSettings:
    return OpenRLHFSettings.from_mapping(yaml.safe_load(Path(path).read_text()))


def write_settings(path: str | Path, settings: OpenRLHFSettings) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(asdict(settings), sort_keys=False))
    return path


def engine_kwargs(settings: OpenRLHFSettings, model_dir: str | Path) -> dict:
    """What tailspec adds to the vLLM engine arguments OpenRLHF's engine actor builds: its worker extension
    (OpenRLHF's weight-sync methods plus tailspec's reload) and, with a drafter, the `speculative_config`."""
    out: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
    if settings.drafter_path is not None:
        out["speculative_config"] = drafter_speculative_config(settings.drafter_path, model_dir, settings.drafter_k)
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tailspec.integrations.openrlhf_config",
                                description=__doc__.split("\n")[0])
    p.add_argument("--redis", required=True, help="the scheduler's Redis URL")
    p.add_argument("--cluster", default="default")
    p.add_argument("--policy-root", help="absolute shared directory the policy versions are published in")
    p.add_argument("--model", required=True, help="the policy's HF directory (--actor.model_name_or_path)")
    p.add_argument("--drafter", help="an EAGLE-3 export to start the engines with (none: no speculation)")
    p.add_argument("--drafter-version", type=int, help="the lineage version that export is")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--reclaim-timeout", type=float, default=30.0)
    p.add_argument("--out", required=True, help="where to write the settings file (readable by the Ray driver)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    settings = OpenRLHFSettings(redis_url=a.redis, cluster=a.cluster, policy_root=a.policy_root,
                                reclaim_timeout_s=a.reclaim_timeout, drafter_version=a.drafter_version,
                                drafter_k=a.k, drafter_path=str(Path(a.drafter).resolve()) if a.drafter else None)
    kwargs = engine_kwargs(settings, a.model)  # refuses a drafter that does not fit, before the file exists
    write_settings(a.out, settings)
    print(json.dumps(kwargs.get("speculative_config")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
