"""What a warm session process keeps between lends, and reads ahead of the next one.

A warm process (`scheduler.warm_sessions`) serves one lend after another. Between them it keeps the teacher
module (built once per config.json; each policy version's weights are loaded into it in place), and while it
waits for its next lend it reads ahead what that lend will start from (`prestage`): the newest policy's weights
into the kept teacher, the lineage head's checkpoint (drafter_trainer/checkpoint.py: `stage_checkpoint`), and the
session's memory footprint. A lend then begins with its start-up in host memory already, instead of reading
the teacher's weights and the head at the start of every lend.

Reading ahead is host work, as it is on a GPU node, where a process reads checkpoints on the node's own CPUs
while the GPU rolls out: the warm loop (scheduler/session_process.py, scheduler/warm_wait.py) calls `prestage` only after leaving the
last GPU's cores and quota, and only where the placement leaves the host a share of its own (a CPU quota, or no
placement), never on a simulated GPU's whole cores. Only a teacher on the host is kept or read ahead: a GPU's
teacher is never kept (`keep_teacher`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tailspec.core import state
from tailspec.core.state import PhaseInfo
from tailspec.drafter_trainer.checkpoint import stage_checkpoint
from tailspec.drafter_trainer.eagle3_config import default_aux_layer_ids
from tailspec.drafter_trainer.footprint import session_footprint
from tailspec.drafter_trainer.lineage import Lineage
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.tasks.policy_sync import load_weights_in_place

# The teacher module a warm session process keeps between sessions (on the host), by (config.json, dtype), and
# "weights": which policy file's weights it holds (path, time, size), so reading the same version again is free.
_KEPT: dict[str, Any] = {}
_LAST: dict[str, Any] = {}  # "ctx": the last session's context (the cluster and Redis to read ahead from)


def device_and_dtype() -> tuple[str, torch.dtype]:
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def weights_id(path: str | Path) -> tuple | None:
    f = Path(path) / "model.safetensors"
    try:
        st = f.stat()
    except OSError:
        return None
    return str(f.resolve()), st.st_mtime_ns, st.st_size


def load_teacher(path: str | Path, device: str, dtype: torch.dtype, policy_version: int) -> Teacher:
    """The policy at `path` as this session's teacher. A warm session process serves one lend after another,
    each with the newest policy: when the previous session's teacher module has the same config.json, only the
    new weights are loaded into it (in place, so tied weights stay tied), and none when it holds that file's
    already (read ahead by `prestage`). Building the modules is most of a small policy's `from_pretrained`, and
    it would come out of every lend; a large policy's
    load is its weights either way (and on a GPU nothing is kept: `keep_teacher`). A checkpoint in several
    files, or one whose tensors do not match the module, is loaded by `from_pretrained`."""
    path = Path(path)
    key = ((path / "config.json").read_text(), str(dtype))
    kept, held = _KEPT.pop("teacher", None), _KEPT.pop("weights", None)
    if kept is not None and kept[0] == key and (
            (held is not None and held == weights_id(path)) or load_weights_in_place(kept[1], path)):
        model = kept[1] if next(kept[1].parameters()).device == torch.device(device) else kept[1].to(device)
        return Teacher(model, default_aux_layer_ids(model.config.num_hidden_layers), policy_version, str(path))
    return Teacher.from_dir(path, device=device, dtype=dtype, policy_version=policy_version)


def keep_teacher(teacher: Teacher) -> None:
    """Keep this session's teacher module for the next session of this process, where it ran on the host. A
    teacher on a GPU is not kept: copying it to the host would lengthen the stop, and the GPU's memory is all
    given back."""
    if teacher.path is None or teacher.device.type != "cpu":
        return
    dtype = next(teacher.model.parameters()).dtype
    _KEPT["teacher"] = (((Path(teacher.path) / "config.json").read_text(), str(dtype)), teacher.model)
    _KEPT["weights"] = weights_id(teacher.path)


def remember(ctx: Any) -> None:
    """The session context `prestage` reads the cluster through (the last lend's: same cluster, same Redis). A
    lend takes what was staged, so the next `prestage` looks again."""
    _LAST["ctx"] = ctx
    _LAST.pop("seen", None)


def prestage() -> None:
    """Between lends (the warm loop's hook): read the newest policy into the kept teacher, stage the lineage
    head's checkpoint, remember the footprint. Each is skipped when what it would read is held already, so an
    idle process polling this costs a few Redis reads and file stats. Nothing before this process's first
    lend (it knows no cluster yet), nothing outside a rollout, nothing where the teacher lives on a GPU, and
    nothing with `scheduler.warm_read_ahead` off."""
    ctx = _LAST.get("ctx")
    device, dtype = device_and_dtype()
    if ctx is None or device != "cpu":
        return
    cfg = ctx.tailspec_config()
    if not cfg.scheduler.warm_read_ahead:
        return
    phase = state.get(ctx.redis, state.key(cfg.cluster.name, "phase"), PhaseInfo)
    if phase is None or phase.phase != "rollout" or not phase.policy_path:
        return  # during the update the cores are the trainer's; the next rollout's start publishes the policy
    head = Lineage(Path(cfg.trainer.checkpoint_dir) / "lineage", ctx.redis, cfg.cluster.name).head()  # as a lend's pull
    seen = (phase.policy_path, phase.policy_version, head.path if head is not None else None)
    if _LAST.get("seen") == seen and "teacher" in _KEPT:
        return  # read ahead already: a poll that finds nothing new costs two Redis reads
    teacher = load_teacher(phase.policy_path, device, dtype, phase.policy_version)
    keep_teacher(teacher)
    session_footprint(phase.policy_path, cfg.trainer, dtype)
    if head is not None:
        stage_checkpoint(head.path, teacher.embedding())
    _LAST["seen"] = seen
