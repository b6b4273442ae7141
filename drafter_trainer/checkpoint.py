"""Session checkpoints: drafter + optimizer state + trainer counters, crash-safe.

Layout: `DIR/ckpt-<step>/` (the drafter's own format, `optimizer.safetensors`, `trainer_state.json`) and
`DIR/LATEST` naming the newest. A checkpoint directory is written under a temporary name, every file
fsynced, then renamed into place; `LATEST` is replaced atomically afterwards (temp file, fsync, rename).
So after a crash at any moment every `ckpt-*` directory is whole, the previous one stays until a newer
one is whole, and `load_latest` falls back to the newest whole directory if `LATEST` is missing or
points at a pruned one. Optimizer tensors go to safetensors and the rest to JSON: nothing is pickled.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tailspec.drafter_trainer.model import Eagle3Drafter

from tailspec.core.atomic import write_dir_atomic, write_text_atomic

LATEST = "LATEST"
_CKPT = re.compile(r"^ckpt-(\d{8})$")


@dataclass
class Checkpoint:
    path: Path
    drafter: Eagle3Drafter
    optimizer_state: dict | None
    trainer_state: dict

    @property
    def step(self) -> int:
        return int(self.trainer_state.get("step", 0))


def flatten_optimizer_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """torch optimizer state_dict → (tensors for safetensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{name}"] = v.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = v
    for idx, sc in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(sc)
    return {"state": state, "param_groups": meta["param_groups"]}


def write_checkpoint_dir(path: str | Path, drafter: Eagle3Drafter, optimizer_state: dict | None, trainer_state: dict,
                         tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write one checkpoint directory atomically (the lineage's heads use the same format). `tensors`
    replaces the drafter's own state_dict (a merged head's weights), same names."""
    if tensors is None:
        tensors = drafter.state_dict()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    opt_tensors, opt_meta = flatten_optimizer_state(optimizer_state) if optimizer_state else ({}, None)
    meta = {"format_version": 1, "config": drafter.config.to_dict(), "extra": {}}

    def write(tmp: Path) -> None:
        from tailspec.drafter_trainer.model import CONFIG_NAME, WEIGHTS_NAME

        save_file(tensors, str(tmp / WEIGHTS_NAME))
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
        if opt_meta is not None:
            save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "optimizer": opt_meta}, indent=2))

    return write_dir_atomic(Path(path), write)


def save_checkpoint(root: str | Path, drafter: Eagle3Drafter, optimizer_state: dict | None, trainer_state: dict,
                    keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    step = int(trainer_state["step"])
    path = write_checkpoint_dir(root / f"ckpt-{step:08d}", drafter, optimizer_state, trainer_state)
    write_text_atomic(root / LATEST, path.name)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _CKPT.match(p.name))


def load_checkpoint(path: str | Path, target_embedding: Any = None, map_location: str = "cpu") -> Checkpoint:
    path = Path(path)
    drafter = Eagle3Drafter.load(path, target_embedding, map_location)
    ts = json.loads((path / "trainer_state.json").read_text())
    opt_meta = ts.pop("optimizer", None)
    opt = None
    if opt_meta is not None:
        opt = unflatten_optimizer_state(load_file(str(path / "optimizer.safetensors"), device=map_location), opt_meta)
    return Checkpoint(path, drafter, opt, ts)


def load_latest(root: str | Path, target_embedding: Any = None, map_location: str = "cpu") -> Checkpoint | None:
    """The checkpoint LATEST names, else the newest whole one; None when there is none."""
    root = Path(root)
    candidates = list(reversed(list_checkpoints(root)))
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    errors = []
    for c in candidates:
        try:
            return load_checkpoint(c, target_embedding, map_location)
        except Exception as e:  # a damaged directory (disk error): try the previous one, say so if none load
            errors.append(f"{c.name}: {e}")
    if errors:
        raise RuntimeError(f"no checkpoint in {root} loads: " + "; ".join(errors))
    return None
