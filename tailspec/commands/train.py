"""`tailspec train`: a standalone drafter-training session (no scheduler): teacher from a policy directory,
samples from a file, a Redis sample stream, or generated with the built-in task; progress bar with loss
and acceptance; ends with a candidate version (promoted if it beats the current one)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tailspec.commands.args import add_config_args, config_from_args
from tailspec.core.state import Sample


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 drafter on rollout samples (standalone session)")
    p.add_argument("--policy", required=True, metavar="DIR", help="policy directory (HF format): the teacher")
    p.add_argument("--samples", required=True, metavar="SRC",
                   help="JSON-lines file of samples (prompt_ids, response_ids, reward, policy_version[, group_id]), "
                        "'redis' (the cluster's sample stream at cluster.redis_url), or 'task:N' (generate N with "
                        "the built-in task)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: until --seconds or Ctrl-C)")
    p.add_argument("--seconds", type=float, default=None, help="wall-clock budget")
    p.add_argument("--out", metavar="DIR", help="checkpoint/version directory (default trainer.checkpoint_dir)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between acceptance measurements")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    add_config_args(p)
    p.set_defaults(func=_run)


def load_samples_file(path: Path):
    if not path.is_file():
        raise SystemExit(f"tailspec train: samples file not found: {path}")
    out, bad = [], 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(Sample.model_validate_json(line))
        except ValidationError as e:
            bad += 1
            if bad <= 3:
                print(f"tailspec train: {path}:{i}: skipped, {e.errors()[0]['loc']}: {e.errors()[0]['msg']}",
                      file=sys.stderr)
    return out, bad


def _sample_source(args: argparse.Namespace, cfg, buffer, vocab: int) -> tuple[Any, dict]:
    """Where the samples come from (`--samples`): the cluster's stream (a Redis client for the session's
    reader; nothing loaded here), the task (`task:N` rollouts of the policy) or a JSONL file. Returns the Redis
    client or None, and the drop counts of what was loaded."""
    # deferred: the CLI imports every command module to build its parser; torch and the models load only
    # when `tailspec train` runs
    import redis as redis_lib

    from tailspec.drafter_trainer.samples import fill_buffer

    if args.samples == "redis":
        return redis_lib.Redis.from_url(cfg.cluster.redis_url), {}
    if args.samples.startswith("task:"):
        from tailspec.tasks.samples import generate_task_samples

        n = int(args.samples.split(":", 1)[1])
        return None, fill_buffer(buffer, generate_task_samples(args.policy, n), vocab, cfg.trainer.max_seq_len)
    samples, bad = load_samples_file(Path(args.samples))
    dropped = fill_buffer(buffer, samples, vocab, cfg.trainer.max_seq_len)
    if bad:
        dropped["malformed"] += bad
    return None, dropped


def _run(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; torch and the models load only
    # when `tailspec train` runs
    import torch

    from tailspec.drafter_trainer.teacher import Teacher
    from tailspec.drafter_trainer.versions import validate
    from tailspec.session_entry import Contributor, device_and_dtype, make_buffer

    cfg = config_from_args(args)
    if args.out:
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"checkpoint_dir": args.out})})
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = device_and_dtype()
    teacher = Teacher.from_dir(args.policy, device=device, dtype=dtype)
    buffer = make_buffer(cfg)
    redis, dropped = _sample_source(args, cfg, buffer, teacher.config.vocab_size)
    trainer = Contributor(cfg, teacher, buffer, redis=redis)
    if redis is None and dropped:
        print(f"dropped samples: {dict(dropped)}", file=sys.stderr)
    sess = trainer.session
    holdout = list(buffer.holdout)[-cfg.trainer.validation_samples:]
    print(f"policy {args.policy}: {len(buffer)} training samples, {len(buffer.holdout)} held out; "
          f"resuming at step {sess.step}" if sess.resumed_from else f"policy {args.policy}: {len(buffer)} training "
          f"samples, {len(buffer.holdout)} held out; new drafter", file=sys.stderr)

    def acceptance() -> float | None:
        try:
            return validate(sess.drafter, teacher, holdout, cfg.trainer.validation_k).acceptance_length
        except ValueError:
            return None

    signal.signal(signal.SIGTERM, lambda *_: sess.request_stop("SIGTERM"))
    steps, acc = _train(args, sess, acceptance)
    info = trainer.propose() if holdout else None
    trainer.close()
    summary = {"steps": steps, "total_steps": sess.step, "checkpoint_dir": str(trainer.root),
               "acceptance": acc, "version": info.model_dump(mode="json") if info else None}
    print(json.dumps(summary))
    return 0


def _train(args: argparse.Namespace, sess: Any, acceptance: Callable[[], float | None]) -> tuple[int, float | None]:
    """Train in chunks of --eval-every steps within --steps / --seconds, measuring acceptance after each;
    Ctrl-C saves. Returns the steps taken and the last acceptance."""
    # deferred: with the rest of the command (see _run)
    from tqdm import tqdm

    acc = acceptance()
    bar = tqdm(total=args.steps, desc="train", unit="step", file=sys.stderr)
    t0 = time.monotonic()
    steps = 0
    try:
        while args.steps is None or steps < args.steps:
            left_s = None if args.seconds is None else args.seconds - (time.monotonic() - t0)
            if left_s is not None and left_s <= 0:
                break
            n = args.eval_every if args.steps is None else min(args.eval_every, args.steps - steps)
            last = sess.run(max_steps=n, max_seconds=left_s)
            steps += last.steps
            bar.update(last.steps)
            acc = acceptance()
            bar.set_postfix(loss=f"{last.losses[-1]:.3f}" if last.losses else "-",
                            acceptance=f"{acc:.2f}" if acc else "-", tok_s=f"{last.tokens_per_s:.0f}")
            if last.stop_reason not in ("max_steps", "max_seconds"):
                break
    except KeyboardInterrupt:
        sess.request_stop("interrupted")
        sess.save()
    bar.close()
    return steps, acc
