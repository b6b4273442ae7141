"""Attaching tailspec to an RL framework it did not write (docs/integrations.md).

Any framework attaches with the client's calls (`tailspec.scheduler.client.TailspecClient`): `set_phase` at
rollout start with the policy version and the directory its weights are published in, `report_progress` from
every rollout worker while it decodes (and `mem_released=True` once it gave its GPU memory back),
`set_phase("train")` and `wait_reclaimed()` before the update, `submit_samples` with the framework's rewards.
This package holds what every framework needs around those calls (`policy`: publishing the policy as a whole
directory on a shared filesystem; `progress`: counting finished sequences at every decoding step) and the
adapters: TRL's `GRPOTrainer` (`trl`, needs the `trl` extra; `trl_vllm`: its colocated vLLM engine with tailspec's
drafter), verl (`verl*`) and OpenRLHF (`openrlhf*`), with what those two share in `framework`.

Integrations are part of the roof: they may import every component; no component imports them.
"""
