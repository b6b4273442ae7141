"""TRL's colocated vLLM engine with tailspec's drafter: speculative decoding in TRL's rollouts, each promoted
version loaded between two generation calls, and the health guard (TRL 1.16, `vllm_mode="colocate"`; vLLM 0.32).

TRL builds its engine inside `VLLMGeneration.__init__` with a fixed argument list (no `speculative_config`, no
worker extension, stats off) and offers no hook. So while `TailspecGRPOTrainer` constructs, `engine_arguments`
replaces the module attribute `trl.generation.vllm_generation.LLM` with a factory that adds tailspec's arguments
to TRL's, and puts TRL's back as soon as the constructor returns (monkey-patching scoped to the constructor; no
TRL function body is replaced):
- `speculative_config` of the EAGLE-3 export, checked against the policy before vLLM starts;
- `worker_extension_cls`: tailspec's (`tailspec_reload_drafter`, run in vLLM's worker by `collective_rpc`);
- `disable_log_stats=False`: the spec-decode counters the guard reads (`process_counters`: the engine runs in
  the trainer's own process).

`TrlVllm` is TRL's live engine as `LiveVllm`'s reload target. The trainer calls `LiveVllm.between_calls()` before
each rollout (a pending rollback, then the promotion watcher) and arms the guards with "policy_sync" when an
optimizer step happened since the last rollout (TRL syncs the weights next, inside its generation; the drafter
is not touched by it and shares the target's embedding, so it sees the synced one).

vLLM's CPU build: TRL's own colocate sync cannot run there (it calls the model's `load_weights` tensor by tensor,
and vLLM's CPU linear layers keep their weights packed for oneDNN: `'Parameter' object has no attribute
'weight_loader'`). `cpu_weight_sync` gives that one `VLLMGeneration` instance a sync through vLLM's in-place
`reload_weights` over TRL's own parameter iterator (its PEFT merge and ZeRO-3 gathering included); set only where
vLLM's platform is the CPU.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tailspec.integrations.framework import RemoteEngines, drafter_speculative_config
from tailspec.rollout.vllm_backend import WORKER_EXTENSION, SpecCounters, process_counters


@contextmanager
def engine_arguments(drafter_path: str | Path, k: int) -> Iterator[None]:
    """While the block runs, TRL's colocated engine is built with tailspec's drafter (module doc)."""
    # deferred: TRL's vLLM module imports vLLM (an optional extra)
    import trl.generation.vllm_generation as vg

    original = vg.LLM

    def build(*args: Any, **kw: Any) -> Any:
        model = kw.get("model", args[0] if args else None)
        spec = drafter_speculative_config(drafter_path, model, k)
        return original(*args, **{**kw, "speculative_config": spec, "worker_extension_cls": WORKER_EXTENSION,
                                  "disable_log_stats": False})

    vg.LLM = build
    try:
        yield
    finally:
        vg.LLM = original


def cpu_weight_sync(generation: Any) -> bool:
    """On vLLM's CPU platform, give TRL's `VLLMGeneration` (colocate mode) a weight sync that works there (module
    doc); True when set."""
    # deferred: vLLM (an optional extra)
    from vllm.platforms import current_platform

    if generation.mode != "colocate" or not current_platform.is_cpu():
        return False
    original = generation.sync_weights

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate" or self.enable_sleep_mode:  # sleep mode is GPU-only: TRL's own path
            return original()
        self.llm.llm_engine.model_executor.driver_worker.reload_weights(
            weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    generation.sync_weights = types.MethodType(sync_weights, generation)
    return True


class TrlVllm(RemoteEngines):
    """TRL's colocated `LLM` (read through `llm()` at each use) as `LiveVllm`'s reload target: a reload goes through
    `collective_rpc` into its worker, then a prefix-cache reset; the counters are this process's, under `name`
    (the worker name its guard verdicts are recorded as)."""

    def __init__(self, llm: Callable[[], Any], policy_dir: str | Path, drafter_path: str | Path, k: int,
                 max_num_seqs: int = 256, name: str = "trl-vllm"):
        super().__init__(lambda refs: refs, policy_dir, drafter_path, k, max_num_seqs)
        self.llm, self.name = llm, name

    def _send(self, path: Path) -> dict:
        llm = self.llm()
        res = llm.collective_rpc("tailspec_reload_drafter", args=(str(path),))
        llm.reset_prefix_cache()
        return {"workers": len(res), "loaded": [r.get("loaded") for r in res]}

    def handles(self) -> dict[str, Any]:
        return {self.name: None}

    def counters(self) -> dict[str, SpecCounters]:
        return {self.name: SpecCounters.from_dict(process_counters())}
