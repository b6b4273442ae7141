"""vLLM worker extension: drafter hot reload and weight digests, run inside vLLM's workers.

vLLM imports this class by its dotted name in each worker (`LLM(worker_extension_cls=...)`) and mixes it
into the worker class; `llm.collective_rpc("tailspec_reload_drafter", args=(path,))` then calls the method
by name there. Only a path string goes in and plain dicts come back: no function is pickled, so
`VLLM_ALLOW_INSECURE_SERIALIZATION` stays off.

This module imports nothing of tailspec: it runs in vLLM's process with vLLM's imports only.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from safetensors.torch import load_file

# Tensors of an exported drafter that a reload never writes: `t2d` is not a vLLM parameter, and the token
# embedding is the target's (vLLM shares the module when the drafter ships none or an identical copy).
_SKIP_ALWAYS = ("t2d", "embed_tokens")


def _weights_file(path: str) -> str:
    f = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no drafter weights at {f}")
    return f


def _digest(module) -> dict:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) of `module`."""
    h = hashlib.sha256()
    n = nonempty = 0
    for name, t in sorted(list(module.named_parameters()) + list(module.named_buffers()), key=lambda x: x[0]):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            nonempty += 1
        n += 1
    return {"sha256": h.hexdigest(), "tensors": n, "nonempty": nonempty}


def draft_model(runner):
    """The live draft model of a vLLM model runner. vLLM 0.32 has `get_draft_model()`; before it (verl 0.9.1 pins
    vLLM 0.24, OpenRLHF 0.11.2 0.29) the runner's proposer holds it as `drafter.model`, wrapped by a CUDA graph
    wrapper when captured (`unwrap()`), which is what `get_draft_model` itself returns. None without a draft model
    (ngram, or no speculation)."""
    get = getattr(runner, "get_draft_model", None)
    if callable(get):
        return get()
    model = getattr(getattr(runner, "drafter", None), "model", None)
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


class TailspecWorkerExtension:
    """Methods vLLM mixes into its worker (`self` is the worker: `self.model_runner`, `self.vllm_config`)."""

    def _tailspec_draft_model(self):
        model = draft_model(self.model_runner)
        if model is None:
            raise RuntimeError("this LLM has no draft model to reload (speculative method ngram or none)")
        return model

    def tailspec_reload_drafter(self, path: str) -> dict:
        """Load drafter weights from `path` (a directory with model.safetensors, or the file) into the live
        draft model, in place. The target's modules are never written: tensors of modules the drafter shares
        with the target (embedding; lm_head when the export shipped none) are refused or skipped."""
        # deferred: vLLM (an optional extra, seconds to import): loaded already in the vLLM worker this runs
        # in, and the module stays importable without it
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        model = self._tailspec_draft_model()
        target = self.model_runner.get_model()
        weights = load_file(_weights_file(path))
        skipped = sorted(k for k in weights if any(s in k for s in _SKIP_ALWAYS))
        # vLLM has a d2t parameter only when the draft vocabulary is smaller than the target's.
        if getattr(model, "draft_id_to_target_id", None) is None:
            skipped += [k for k in weights if k == "d2t"]
        shared_head = getattr(model, "lm_head", None) is not None and model.lm_head is getattr(target, "lm_head", None)
        if shared_head and "lm_head.weight" in weights:
            raise ValueError("the live drafter shares the target's lm_head (its export shipped none, or a copy of "
                             "the target's): reloading lm_head.weight would overwrite the target; re-export the "
                             "drafter with its own lm_head and restart the LLM")
        items = [(k, v) for k, v in weights.items() if k not in set(skipped)]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            # A plain load_weights fails on CPU: oneDNN packed the linear weights and emptied `.weight`.
            # The layerwise reload restores the layers' parameters, loads, and re-runs the packing.
            initialize_layerwise_reload(model)
            model.load_weights(items)
            finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        return {"loaded": len(items), "skipped": skipped, "seconds": time.perf_counter() - t0}

    def tailspec_where(self) -> dict:
        """Where this worker computes: its Ray node id (None outside Ray) and the physical GPU index behind its
        device (vLLM's device index counts within CUDA_VISIBLE_DEVICES; None on a CPU worker or where the
        list names GPUs by UUID). An engine actor whose workers vLLM's Ray executor placed (tensor parallelism)
        holds no GPU itself; its workers say where the engine runs."""
        device = getattr(self, "device", None)
        gpu = None
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            if not visible:
                gpu = device.index
            elif device.index < len(visible) and visible[device.index].isdigit():
                gpu = int(visible[device.index])
        node_id = None
        try:
            # deferred: Ray is there only where an executor or framework runs the worker as a Ray actor
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node_id": node_id, "gpu": gpu}

    def tailspec_target_digest(self) -> dict:
        """Digest of the target's parameters and buffers (on CPU, linear layers keep their weights packed
        outside the module, so this covers embeddings, norms and lm_head; outputs cover the rest)."""
        return _digest(self.model_runner.get_model())

    def tailspec_drafter_digest(self) -> dict:
        return _digest(self._tailspec_draft_model())
