"""How good could the co-trained drafter have been at the end of a run? Held-out acceptance at k = 4 on the final
policy's own samples of:
- the frozen first drafter (the bootstrap, trained on the initial policy's samples);
- every drafter version the co-trained run wrote, and its lineage head (the most trained weights);
- a fresh bootstrap of the final policy (the same recipe and step budget as the first drafter's);
- the first drafter fine-tuned on the final policy's samples for as many optimizer steps as the run's lineage took
  in all (read from its head), at the co-training lr, on those samples alone and mixed half and half with the
  initial policy's (the stream holds several policy versions).
The last two separate what the run's drafter lacked: a ceiling the task allows, or training.

Usage (tailspec installed; TAILSPEC_CACHE as the run's):
    python -P benchmarks/drift_ceiling.py RUN_DIR/cotrained [--held 64] [--threads 2]
where RUN_DIR is `tailspec bench e2e --out RUN_DIR`'s. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
from tailspec.core.config import TailspecConfig
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.drafter_trainer.samples import fill_buffer
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import validate

from tailspec.demo.bootstrap import bootstrap_drafter, load_samples, make_buffer, rollout_samples
from tailspec.demo.options import DemoOptions, apply_demo_trainer
from tailspec.tasks.policy import load_policy, resolve_policy


def fine_tuned(start: str, policy: Path, samples, cfg: TailspecConfig, steps: int, held, model) -> float:
    teacher = Teacher.from_dir(policy)
    buf = make_buffer(cfg)
    fill_buffer(buf, samples, teacher.config.vocab_size, cfg.trainer.max_seq_len)
    with tempfile.TemporaryDirectory(prefix="tailspec-ceiling-") as tmp:
        s = TrainingSession(cfg.trainer, teacher, buf, checkpoint_dir=Path(tmp) / "ckpt")
        with torch.no_grad():  # in place: the optimizer holds these parameters
            s.drafter.load_state_dict(Eagle3Module.load(start, teacher.embedding()).state_dict())
        s.run(max_steps=steps)
        acc = score(s.drafter, model, held)
        s.close()
    return acc


def score(drafter: Eagle3Module, model, held) -> float:
    drafter.eval()
    return round(validate(drafter, Teacher(model, drafter.config.aux_layer_ids), held, 4).acceptance_length, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--held", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    run = a.run_dir
    versions = sorted((run / "policy").glob("v*"), key=lambda d: int(d.name[1:]))
    final = versions[-2] if len(versions) > 1 else versions[-1]  # the last step ran the version before the last update
    head = max((run / "drafter" / "lineage").glob("head-*"))
    lineage_steps = json.loads((head / "trainer_state.json").read_text())["lineage"]["steps"]
    cfg = TailspecConfig()
    apply_demo_trainer(cfg.trainer, DemoOptions.validation_samples)
    o = DemoOptions()
    policy0 = resolve_policy("deep", cfg.task, cache_dir=cfg.cache_dir)
    boot0 = bootstrap_drafter(policy0, cfg, o.bootstrap_samples, o.bootstrap_seconds, seed=0, steps=o.bootstrap_steps,
                              progress=False)
    boot_final = bootstrap_drafter(final, cfg, o.bootstrap_samples, o.bootstrap_seconds, seed=0, steps=o.bootstrap_steps,
                                   progress=False)
    held = rollout_samples(final, cfg, a.held, seed=4242)
    model, _ = load_policy(final)
    emb = model.get_input_embeddings()
    out: dict = {"policy": final.name, "lineage_steps": lineage_steps, "held": len(held),
                 "frozen": score(Eagle3Module.load(boot0, emb), model, held),
                 "fresh_bootstrap": score(Eagle3Module.load(boot_final, emb), model, held),
                 "lineage_head": score(Eagle3Module.load(str(head), emb), model, held)}
    out["versions"] = {d.name: score(Eagle3Module.load(str(d), emb), model, held)
                       for d in sorted((run / "drafter" / "versions").glob("v*"))}
    final_samples, first_samples = load_samples(boot_final), load_samples(boot0)
    rng = random.Random(0)
    half = len(final_samples) // 2
    mixed = rng.sample(first_samples, half) + rng.sample(final_samples, half)
    out["fine_tuned_final"] = fine_tuned(boot0, final, final_samples, cfg, lineage_steps, held, model)
    out["fine_tuned_mixed"] = fine_tuned(boot0, final, mixed, cfg, lineage_steps, held, model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
