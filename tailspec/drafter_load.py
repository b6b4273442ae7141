"""The one way a drafter reaches an engine: `load_drafter` turns a drafter directory (a promoted version, or the
demo's bootstrap drafter) into what the engine that serves it takes.

- An engine that runs the drafter in its own process, beside the target (the native engine, through
  rollout/drafters.py's `Eagle3Proposer`: the demo's rollout workers), takes the module, read from tailspec's
  format over the target's token embedding, on the target's device, in the engine's dtype.
- An engine that reads drafter files itself (vLLM: `VllmRollout.reload_drafter`, or a framework's engines
  through `integrations.framework.RemoteEngines`, both driven by `LiveVllm`) takes a directory in the EAGLE-3
  format: an export is served as it is; a version in tailspec's own format is exported once beside it
  (`<its directory>-eagle3`, written whole or not at all) and served from there on.

It lives in the roof because it joins two components: the drafter's formats are drafter_trainer's, and what vLLM
can load is rollout's (`rollout.vllm_checks`). The rollout component never imports drafter_trainer, so a live
vLLM is handed this function as its `prepare` hook (`LiveVllm(..., prepare=load_drafter)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import overload

import torch
from torch import nn

from tailspec.core.state import DrafterVersion
from tailspec.drafter_trainer.export import export
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.rollout.vllm_checks import is_eagle3_export


@overload
def load_drafter(source: DrafterVersion | str | Path, target: nn.Module, *,
                 dtype: torch.dtype | None = None) -> Eagle3Module: ...


@overload
def load_drafter(source: DrafterVersion | str | Path, target: None = None, *,
                 dtype: torch.dtype | None = None) -> Path: ...


def load_drafter(source: DrafterVersion | str | Path, target: nn.Module | None = None, *,
                 dtype: torch.dtype | None = None) -> Eagle3Module | Path:
    """The drafter at `source` (a version record or a directory) for the engine that serves it (the module doc).
    With `target`, the in-process engine's target model: the module over its embedding, on its device, in `dtype`
    (default: the embedding's). Without: the EAGLE-3 directory a vLLM engine loads."""
    path = Path(source.path if isinstance(source, DrafterVersion) else source)
    if target is not None:
        embedding = target.get_input_embeddings()
        drafter = Eagle3Module.load(path, target_embedding=embedding, map_location=embedding.weight.device)
        return drafter.to(dtype=dtype or embedding.weight.dtype)
    if is_eagle3_export(path):
        return path
    out = path.parent / f"{path.name}-eagle3"
    if not (out / "config.json").is_file():
        export(Eagle3Module.load(path), out, "eagle3")
    return out
