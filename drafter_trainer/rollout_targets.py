"""Training targets the rollout shipped with its samples: the aux hidden states and logits the engine computed
while generating (rollout/states.py), so a session trains without running the policy's forward over the sample.

On the shared filesystem, one directory per rollout worker and policy version, written whole
(`core.atomic.write_dir_atomic`): `DIR/v<policy version>-<worker>/targets.safetensors` with tensors
`aux.<key>` [n-1, A] (positions 0..n-2) and `logits.<key>` [G, V] (positions P-1..n-2) per request, and metadata
naming the aux layer ids. A sample points at its entry with `states_path` (the directory) and `states_key`; the
stream carries ids and numbers only. safetensors holds plain tensors: nothing is unpickled.

Trade-off: the targets are those of the policy version that generated the sample, one version behind the
teacher a session loads (the stream's newest samples are the step before the rollout under way); the teacher's
forward is over half of a session's step on the deep miniature. `trainer.target_source: teacher` recomputes
them instead. A batch whose targets cannot all be read (no reference, a pruned or unreadable file, other aux
layers, a shape that does not fit the sample) falls back to the teacher's forward, whole.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tailspec.core.atomic import write_dir_atomic
from tailspec.core.state import Sample
from tailspec.drafter_trainer.teacher import TeacherOutput

log = logging.getLogger(__name__)

FILE = "targets.safetensors"


def _layer_ids(aux_layer_ids: Sequence[int]) -> str:
    """The aux layer ids as the file's metadata names them (written and compared the same way)."""
    return ",".join(str(int(j)) for j in aux_layer_ids)


def targets_dir(root: str | Path, policy_version: int, worker: str) -> Path:
    return Path(root) / f"v{policy_version}-{worker}"


def write_targets(root: str | Path, policy_version: int, worker: str,
                  states: dict[str, tuple[torch.Tensor, torch.Tensor]], aux_layer_ids: Sequence[int]) -> Path:
    """Write one rollout's targets ({key: (aux [n-1, A], logits [G, V])}) whole; returns the directory, absolute
    (what a sample's `states_path` must be)."""
    tensors = {}
    for key, (aux, logits) in states.items():
        tensors[f"aux.{key}"] = aux.contiguous()
        tensors[f"logits.{key}"] = logits.contiguous()
    meta = {"aux_layer_ids": _layer_ids(aux_layer_ids), "policy_version": str(policy_version)}
    out = targets_dir(Path(root).resolve(), policy_version, worker)
    return write_dir_atomic(out, lambda d: save_file(tensors, str(d / FILE), meta))


def prune_targets(root: str | Path, keep_from_version: int) -> int:
    """Remove the directories of policy versions below `keep_from_version` (their samples left the buffers);
    returns how many. A session reading one as it goes falls back to the teacher for that batch."""
    removed = 0
    for d in Path(root).glob("v*-*"):
        try:
            version = int(d.name[1:].split("-", 1)[0])
        except ValueError:
            continue
        if version < keep_from_version and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)  # a failed removal must not stop the RL loop
            removed += 1
    return removed


def load_targets(samples: Sequence[Sample], aux_layer_ids: Sequence[int], width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", dims: tuple[int, int] | None = None) -> TeacherOutput | None:
    """The batch's targets laid out as the teacher's forward gives them ([B, width, A], [B, width, V]; positions
    the loss never reads are 0), or None when any sample's cannot be used (the caller runs the teacher). `dims`:
    the (A, V) the drafter and its target need (len(aux_layer_ids) x hidden size, the target's vocabulary)."""
    if not samples or any(s.states_path is None or s.states_key is None for s in samples):
        return None
    want = _layer_ids(aux_layer_ids)
    try:
        by_path: dict[str, list[int]] = {}
        for b, s in enumerate(samples):
            by_path.setdefault(s.states_path, []).append(b)
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, rows in by_path.items():
            with safe_open(str(Path(path) / FILE), framework="pt") as f:
                if (f.metadata() or {}).get("aux_layer_ids") != want:
                    return None
                for b in rows:
                    k = samples[b].states_key
                    found[b] = (f.get_tensor(f"aux.{k}"), f.get_tensor(f"logits.{k}"))
        got = [found[b] for b in range(len(samples))]
    except (OSError, SafetensorError, KeyError) as e:
        log.info("rollout targets unreadable (%s); the teacher's forward instead", e)
        return None
    if any(a.ndim != 2 or lg.ndim != 2 for a, lg in got):
        return None
    found_dims = {(a.shape[-1], lg.shape[-1]) for a, lg in got}
    if len(found_dims) != 1 or (dims is not None and found_dims != {tuple(dims)}):
        return None
    (adim, vocab), = found_dims
    aux = torch.zeros(len(samples), width, adim, dtype=dtype)
    logits = torch.zeros(len(samples), width, vocab, dtype=torch.float32)
    for b, (s, (a, lg)) in enumerate(zip(samples, got)):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        if a.shape[0] != n - 1 or lg.shape[0] != n - p or n > width:
            return None
        aux[b, : n - 1] = a.to(dtype)
        logits[b, p - 1 : n - 1] = lg.float()
    return TeacherOutput(aux=aux.to(device), logits=logits.to(device))
