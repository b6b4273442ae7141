"""The first drafter of a run: trained offline on the initial policy's own rollouts, as a team would train
an EAGLE-3 head for its base model before RL starts. The frozen baseline keeps it for the whole run (naive
speculative decoding); the co-trained run starts from it and keeps training on idle GPUs.

Cached per (policy directory, trainer settings, budget), so repeated demos and benchmarks reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailspec.core import state
from tailspec.core.config import TailspecConfig, TrainerConfig
from tailspec.core.state import DrafterVersion, Sample
from tailspec.drafter_trainer.checkpoint import flatten_optimizer_state, unflatten_optimizer_state
from tailspec.drafter_trainer.lineage import Lineage
from tailspec.drafter_trainer.model import CONFIG_NAME, Eagle3Module
from tailspec.drafter_trainer.samples import fill_buffer
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.versions import VersionStore
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams
from tailspec.session_entry import make_buffer
from tailspec.tasks.policy import load_policy
from tailspec.tasks.runsum import grade, sample_problems
from tailspec.tasks.tokenizer import decode_response, encode_prompt

log = logging.getLogger("tailspec.demo")
SAMPLES = "bootstrap_samples.jsonl"
BOOTSTRAP_SESSION = "bootstrap"  # the session id version 1 and the lineage's first head are recorded under
OPTIMIZER = "bootstrap_optimizer.safetensors"  # the offline run's AdamW moments (+ OPTIMIZER_META)
OPTIMIZER_META = "bootstrap_optimizer.json"


def load_optimizer(drafter_path: str | Path) -> dict | None:
    """The bootstrap run's optimizer state (torch state_dict), or None for a drafter saved without one."""
    d = Path(drafter_path)
    if not (d / OPTIMIZER).is_file() or not (d / OPTIMIZER_META).is_file():
        return None
    return unflatten_optimizer_state(load_file(str(d / OPTIMIZER)), json.loads((d / OPTIMIZER_META).read_text()))


def load_samples(drafter_path: str | Path) -> list[Sample]:
    f = Path(drafter_path) / SAMPLES
    if not f.is_file():
        return []
    return [Sample.model_validate_json(line) for line in f.read_text().splitlines() if line.strip()]


def rollout_samples(policy_dir: str | Path, cfg: TailspecConfig, n: int, seed: int, max_seq_len: int = 640,
                    device: str = "cpu") -> list[Sample]:
    """`n` graded rollouts of the policy at temperature 1 (native engine, plain decoding) on `device` (bf16 on
    CUDA, as the rollout workers run it)."""
    model, tok = load_policy(policy_dir, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.to(device)
    problems = sample_problems(n, cfg.task, seed=seed + 77_777)  # disjoint from the RL steps' seeds
    prompts = [encode_prompt(tok, p.prompt) for p in problems]
    engine = Engine(model, None, max_batch=64, max_seq_len=max_seq_len, seed=seed)
    params = [SamplingParams(max_tokens=max_seq_len - len(p), temperature=1.0, seed=seed + i) for i, p in enumerate(prompts)]
    outs = engine.generate(prompts, params)
    return [
        Sample(prompt_ids=p, response_ids=o.token_ids, reward=grade(q, decode_response(tok, o.token_ids), cfg.task).reward,
               policy_version=0, group_id=f"boot:{i}")
        for i, (q, p, o) in enumerate(zip(problems, prompts, outs))
    ]


def bootstrap_trainer(cfg: TailspecConfig) -> TrainerConfig:
    """The trainer settings the offline run trains with: the co-training ones at `bootstrap_lr`."""
    return cfg.trainer.model_copy(update={"lr": cfg.trainer.bootstrap_lr or cfg.trainer.lr})


# Trainer settings the offline run does not read: where it checkpoints, where targets come from (below), and how a
# lineage's rounds exchange (it trains alone). Left out of the key, so they never retrain an identical first drafter.
_KEY_EXCLUDED = {"checkpoint_dir", "target_source", "round_timeout_s"}


def _key(policy_dir: Path, cfg: TailspecConfig, n: int, seconds: float, seed: int, steps: int | None = None) -> str:
    """The cache key: what the offline run depends on. Its trainer settings as it runs them, so a co-training lr
    (sessions' `lr` beside a set `bootstrap_lr`) does not retrain an identical first drafter; not
    `target_source`: its samples carry no shipped targets, so it always trains on the teacher's forward."""
    weights = policy_dir / "model.safetensors"
    h = hashlib.sha256()
    h.update(json.dumps({"trainer": bootstrap_trainer(cfg).model_dump(exclude=_KEY_EXCLUDED), "n": n, "s": seconds,
                         "seed": seed, "task": cfg.task.model_dump(), "format": 3,
                         **({"steps": steps} if steps is not None else {})}, sort_keys=True).encode())
    h.update(weights.read_bytes() if weights.is_file() else str(policy_dir).encode())
    return h.hexdigest()[:16]


def bootstrap_drafter(policy_dir: str | Path, cfg: TailspecConfig, n: int = 256, seconds: float = 60.0,
                      seed: int = 0, progress: bool = True, steps: int | None = None, device: str = "cpu") -> str:
    """Path of the first drafter (the project's checkpoint format), trained on first use and cached: for
    `seconds`, or for `steps` optimizer steps (then `seconds` is only a cap) — a step budget gives the same
    drafter on a busy machine as on a quiet one. `device`: where its rollouts and training run (CUDA: the
    teacher in bf16, as sessions hold it); not part of the cache key."""
    policy_dir = Path(policy_dir)
    out = Path(cfg.cache_dir) / "drafters" / f"{policy_dir.name}-{_key(policy_dir, cfg, n, seconds, seed, steps)}"
    if (out / CONFIG_NAME).is_file() and (out / SAMPLES).is_file():
        return str(out)
    t0 = time.time()
    samples = rollout_samples(policy_dir, cfg, n, seed, device=device)
    on_cuda = device.startswith("cuda")
    teacher = Teacher.from_dir(policy_dir, device=device, dtype=torch.bfloat16 if on_cuda else torch.float32)
    buffer = make_buffer(cfg)
    fill_buffer(buffer, samples, teacher.config.vocab_size, cfg.trainer.max_seq_len)
    with tempfile.TemporaryDirectory(prefix="tailspec-boot-") as tmp:
        session = TrainingSession(bootstrap_trainer(cfg), teacher, buffer, checkpoint_dir=Path(tmp) / "ckpt")
        res = session.run(max_seconds=seconds, max_steps=steps)
        drafter: Eagle3Module = session.drafter
        drafter.eval()
        out.parent.mkdir(parents=True, exist_ok=True)
        drafter.save(out, extra={"bootstrap": {"samples": n, "steps": res.steps, "seconds": res.seconds,
                                               "final_loss": res.losses[-1] if res.losses else None}})
        # Its AdamW moments travel with it: the lineage's first head carries them, so the first sessions
        # continue the offline run's optimizer instead of starting Adam afresh, whose first steps move every
        # weight by about the full lr and cost the promoted drafter acceptance.
        if session.backend.name == "torch":
            tensors, meta = flatten_optimizer_state(session.backend.state_dict())
            save_file(tensors, str(out / OPTIMIZER))
            (out / OPTIMIZER_META).write_text(json.dumps(meta))
        # The samples travel with the drafter (ids and rewards as JSON lines): a run seeds its sample
        # stream with them, so sessions in the first step's tail have data to train on. Written last: the
        # cache entry is whole when this file is there.
        (out / SAMPLES).write_text("".join(s.model_dump_json() + "\n" for s in samples))
        session.close()
    log.info("bootstrap drafter: %d samples, %d steps in %.0fs → %s", n, res.steps, time.time() - t0, out)
    return str(out)


def seed_store(drafter_path: str, cfg: TailspecConfig, redis) -> list[bytes]:
    """Make the bootstrap drafter version 1 of the run (promoted) and the lineage's first head, and seed the
    sample stream with its samples; returns their stream entry ids."""
    root = Path(cfg.trainer.checkpoint_dir)
    drafter = Eagle3Module.load(drafter_path)
    Lineage(root / "lineage", redis, cfg.cluster.name).seed(
        drafter, {"step": 0, "tokens": 0, "backend": cfg.trainer.backend, "policy_version": 0}, session_id=BOOTSTRAP_SESSION,
        optimizer_state=load_optimizer(drafter_path))
    store = VersionStore(root / "versions", redis, cfg.cluster.name)
    number = store._next_number()
    dst = store.path(number)
    shutil.copytree(drafter_path, dst, dirs_exist_ok=True)
    info = DrafterVersion(version=number, path=str(dst.resolve()), policy_version=0, acceptance_length=None,
                          promoted=True, created_at=time.time(), session_id=BOOTSTRAP_SESSION,
                          note="bootstrap drafter (trained offline on the initial policy)", decision="the run's first drafter")
    (dst / "version.json").write_text(info.model_dump_json())
    store.seed(info)
    # the initial policy's own samples: the first tail's sessions train on them
    return [state.append(redis, state.key(cfg.cluster.name, "samples"), s) for s in load_samples(drafter_path)]
    assert state.get(redis, state.key(cfg.cluster.name, "drafter_current"), DrafterVersion) is not None
