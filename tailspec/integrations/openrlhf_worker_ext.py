"""The vLLM worker extension for OpenRLHF's engines: OpenRLHF's own extension (`WorkerWrap`: the weight sync from
its DeepSpeed actor) and tailspec's (`tailspec_reload_drafter`, the digests) in one class, since vLLM takes one
`worker_extension_cls`. `TailspecRolloutActor` passes it in place of OpenRLHF's (openrlhf==0.11.2).

Imported only inside vLLM's worker processes (OpenRLHF's extension module imports vLLM through its package).
"""

from __future__ import annotations

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from tailspec.rollout.vllm_worker_ext import TailspecWorkerExtension


class TailspecOpenRLHFWorkerExtension(WorkerWrap, TailspecWorkerExtension):
    """OpenRLHF's methods first; tailspec's names all start with `tailspec_` and `_tailspec_`, so nothing of
    OpenRLHF's is shadowed."""
