"""The vLLM worker extension for verl's rollout replicas: verl's own extension (its weight sync from the
actor) and tailspec's (`tailspec_reload_drafter`, the digests) in one class, since vLLM takes one
`worker_extension_cls`. Named by `actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls`, which
verl's server passes after its own default (verl==0.9.1, vLLMHttpServer.launch_server).

Imported only inside vLLM's worker processes (it needs vLLM: verl's extension module imports it).
"""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from tailspec.rollout.vllm_worker_ext import TailspecWorkerExtension


class TailspecVerlWorkerExtension(vLLMColocateWorkerExtension, TailspecWorkerExtension):
    """verl's methods first (its `__new__` sets up the weight-sync state); tailspec's names all start with
    `tailspec_` and `_tailspec_`, so nothing of verl's is shadowed."""
