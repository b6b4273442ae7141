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
import logging
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tailspec.core.atomic import link_or_copy, write_dir_atomic, write_text_atomic
from tailspec.drafter_trainer.files import (
    DrafterFileError,
    file_crc32,
    finite_number,
    read_json_object,
    read_tensors,
)
from tailspec.drafter_trainer.model import CONFIG_NAME, WEIGHTS_NAME, Eagle3Module

LATEST = "LATEST"
OPTIMIZER_NAME = "optimizer.safetensors"
TRAINER_STATE_NAME = "trainer_state.json"
_OPT_KEY = re.compile(r"^state\.(\d{1,9})\.[A-Za-z_][A-Za-z0-9_]{0,63}$")
log = logging.getLogger(__name__)
_CKPT = re.compile(r"^ckpt-(\d{8})$")


@dataclass
class Checkpoint:
    path: Path
    drafter: Eagle3Module
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


def write_checkpoint_dir(path: str | Path, drafter: Eagle3Module, optimizer_state: dict | None, trainer_state: dict,
                         tensors: dict[str, torch.Tensor] | None = None, optimizer_from: Path | None = None) -> Path:
    """Write one checkpoint directory atomically (the lineage's heads use the same format). `tensors`
    replaces the drafter's own state_dict (a merged head's weights), same names. `optimizer_from`: a checkpoint
    directory whose optimizer state this one carries instead of `optimizer_state`, hard-linked (a file is never
    changed once its directory is in place, so the link shares it; copied where links are not supported); its
    trainer state must record the same backend. Raises OSError or DrafterFileError when it cannot be carried."""
    if tensors is None:
        tensors = drafter.state_dict()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    carried = _carried_optimizer(optimizer_from, trainer_state) if optimizer_from is not None else None
    opt_tensors, opt_meta = flatten_optimizer_state(optimizer_state) if optimizer_state and carried is None else ({}, carried)
    meta = {"format_version": 1, "config": drafter.config.to_dict(), "extra": {}}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME))
        meta["weights_crc32"] = file_crc32(tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
        if carried is not None:
            link_or_copy(optimizer_from / OPTIMIZER_NAME, tmp / OPTIMIZER_NAME)
        elif opt_meta is not None:
            save_file(opt_tensors, str(tmp / OPTIMIZER_NAME))
            opt_meta["crc32"] = file_crc32(tmp / OPTIMIZER_NAME)
        (tmp / TRAINER_STATE_NAME).write_text(json.dumps({**trainer_state, "optimizer": opt_meta}, indent=2,
                                                         allow_nan=False))

    return write_dir_atomic(Path(path), write)


def _carried_optimizer(src: Path, trainer_state: dict) -> dict:
    """The optimizer metadata (with its file's CRC-32) of checkpoint `src`, for a directory that links its file."""
    ts = read_json_object(src / TRAINER_STATE_NAME)
    opt_meta = ts.get("optimizer")
    if not isinstance(opt_meta, dict) or not isinstance(opt_meta.get("crc32"), int):
        raise DrafterFileError(f"{src / TRAINER_STATE_NAME}: no optimizer state with a CRC-32 to carry")
    if file_crc32(src / OPTIMIZER_NAME) != opt_meta["crc32"]:  # never pass a damaged file on to every later head
        raise DrafterFileError(f"{src / OPTIMIZER_NAME}: CRC-32 does not match its trainer state")
    if ts.get("backend", "torch") != trainer_state.get("backend", "torch"):
        raise DrafterFileError(f"{src}: optimizer state of backend {ts.get('backend')!r}, this checkpoint's is "
                               f"{trainer_state.get('backend')!r}")
    return opt_meta


def save_checkpoint(root: str | Path, drafter: Eagle3Module, optimizer_state: dict | None, trainer_state: dict,
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
    """One checkpoint directory. Missing: FileNotFoundError; damaged (any file missing, truncated, altered, or
    not what the format says): DrafterFileError naming the file. A directory staged ahead (`stage_checkpoint`)
    is served from host memory, once."""
    path = Path(path)
    staged = _STAGED.pop(str(path), None) if map_location == "cpu" else None
    if staged is not None and staged[0] == _files_id(path):
        if target_embedding is not None:
            staged[1].drafter.set_target_embedding(target_embedding)
        return staged[1]
    drafter = Eagle3Module.load(path, target_embedding, map_location)
    ts = read_json_object(path / TRAINER_STATE_NAME)
    check_trainer_state(path / TRAINER_STATE_NAME, ts)
    opt_meta = ts.pop("optimizer", None)
    opt = None
    if opt_meta is not None:
        f = path / OPTIMIZER_NAME
        tensors = read_tensors(f, map_location, crc=opt_meta.get("crc32") if isinstance(opt_meta, dict) else None)
        # torch's AdamW holds the drafter's trainable parameters in order; DeepSpeed's inner optimizer flat ones
        params = [p for p in drafter.parameters() if p.requires_grad] if ts.get("backend", "torch") == "torch" else None
        opt = check_optimizer_state(f, tensors, opt_meta, params)
    return Checkpoint(path, drafter, opt, ts)


def stage_checkpoint(path: str | Path, target_embedding: Any = None) -> None:
    """Read a checkpoint directory into host memory ahead of a `load_checkpoint` of it (a warm session process
    between lends: tailspec/warm.py), replacing whatever was staged before. What is served later is checked
    against the files' sizes and times then, so a directory rewritten since is read afresh."""
    key, files = str(Path(path)), _files_id(Path(path))
    if key in _STAGED and _STAGED[key][0] == files:
        return
    ck = load_checkpoint(path, target_embedding, "cpu")
    _STAGED.clear()
    _STAGED[key] = (files, ck)


_STAGED: dict[str, tuple[tuple, Checkpoint]] = {}  # path → (its files' identity, the checkpoint read)


def _files_id(path: Path) -> tuple:
    try:
        return tuple((f.name, st.st_mtime_ns, st.st_size) for f in sorted(path.iterdir()) for st in [f.stat()])
    except OSError:
        return ()


def check_trainer_state(f: Path, ts: dict) -> None:
    """The counters a session resumes from: `step` (always written) and the others where present, non-negative
    integers."""
    if "step" not in ts:
        raise DrafterFileError(f"{f}: field step is missing (a session would resume at step 0)")
    for name in ("step", "tokens", "samples_seen", "policy_version"):
        if name in ts:
            finite_number(f, name, ts[name], 0, 2**62, integer=True)
    if not isinstance(ts.get("backend", "torch"), str):
        raise DrafterFileError(f"{f}: field backend must be a string")
    if "lineage" in ts and not isinstance(ts["lineage"], dict):
        raise DrafterFileError(f"{f}: field lineage must be an object")


def check_optimizer_state(f: Path, tensors: dict[str, torch.Tensor], meta: Any,
                          params: list[torch.Tensor] | None) -> dict:
    """The optimizer state as torch's load_state_dict takes it, checked: integer parameter ids, finite
    hyperparameters, tensors named state.<id>.<name>; with `params` (the optimizer's parameters in order)
    also groups covering them once and every moment tensor of parameter i shaped like parameter i."""
    if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list) \
            or not isinstance(meta.get("scalars", {}), dict):
        raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer must be an object with a param_groups "
                               "list and a scalars object")
    seen: list[int] = []
    for g in meta["param_groups"]:
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer param_groups entries need a params "
                                   "list of integers")
        for k, v in g.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer param_groups.{k} is {v}")
        seen += ids
    n = len(params) if params is not None else (max(seen) + 1 if seen else 0)
    if len(seen) != len(set(seen)) or (params is not None and sorted(seen) != list(range(n))):
        raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer param_groups name parameters "
                               f"{sorted(seen)[:10]}..., the drafter has {n} trainable ones")
    for sc in meta.get("scalars", {}).values():
        if not isinstance(sc, dict):
            raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer scalars must be objects")
    for key, t in tensors.items():
        m = _OPT_KEY.match(key)
        if m is None or int(m.group(1)) not in seen:
            raise DrafterFileError(f"{f}: tensor {key[:80]!r} is not state.<parameter>.<name> of a trainable parameter")
        if params is not None and t.dim() > 0 and tuple(t.shape) != tuple(params[int(m.group(1))].shape):
            p = params[int(m.group(1))]
            raise DrafterFileError(f"{f}: tensor {key} has shape {list(t.shape)}, its parameter {list(p.shape)}")
    for idx in meta.get("scalars", {}):
        if not (str(idx).isascii() and str(idx).isdigit()) or int(idx) not in seen:
            raise DrafterFileError(f"{f.parent / TRAINER_STATE_NAME}: optimizer scalars name parameter {str(idx)[:20]!r}")
    clean = {k: v for k, v in meta.items() if k != "crc32"}
    return unflatten_optimizer_state(tensors, clean)


def load_latest(root: str | Path, target_embedding: Any = None, map_location: str = "cpu") -> Checkpoint | None:
    """The checkpoint LATEST names, else the newest whole one; a damaged one is skipped (logged, naming it) for
    the one before. None when there is none; DrafterFileError naming each when none loads."""
    root = Path(root)
    candidates = list(reversed(list_checkpoints(root)))
    latest = root / LATEST
    if latest.is_file():
        try:
            named = root / latest.read_text().strip()
        except (OSError, UnicodeDecodeError, ValueError):
            named = None  # a damaged pointer: the newest directory that loads
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    errors = []
    for c in candidates:
        try:
            ck = load_checkpoint(c, target_embedding, map_location)
        except (DrafterFileError, OSError) as e:  # damaged (or removed meanwhile): the previous one
            errors.append(f"{c.name}: {e}")
            log.warning("checkpoint %s not loaded, trying the previous one: %s", c, e)
            continue
        return ck
    if errors:
        raise DrafterFileError(f"no checkpoint in {root} loads: " + "; ".join(errors))
    return None
