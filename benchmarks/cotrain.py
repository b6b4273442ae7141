"""Co-training into one drafter lineage: one session vs two concurrent sessions with the same step budget.

Set-up (the main job's: the demo's policy preset and its bootstrap drafter, cached):
- policy v0 = the preset; its bootstrap drafter is the starting drafter (what `tailspec demo` starts from);
- policy v1 = v0 after `--grpo-steps` GRPO steps on its own graded rollouts (real RL: the reward moves it);
- the sample stream holds v0's rollouts, then v1's; the phase record names v1 as the teacher;
- (a) one real session process trains `--steps` optimizer steps; (b) `--sessions` session processes (two by
  default) train `--steps` / n each, at the same time, into the lineage (the demo's trainer.merge_rule: synchronous
  rounds, drafter_trainer/rounds.py; `--set trainer.merge_rule=async` for merged deltas). Each runs against its own
  fresh redis-server and lineage seeded with the starting drafter, and proposes candidates every
  `--validate-every-s` (paired test, trainer.promotion_level).
  With `--alternate` the sessions run in this process instead, taking turns one merge chunk each (each delta
  delayed by the other sessions' chunks, as when they train at once; no validations, no Redis): the asynchronous
  merge rule's cost without the timing, deterministic to the last digit (`run_alternating`).

With `--drafter-shape 8b` (or `70b`) it measures instead a round's gradient exchange at that policy's EAGLE-3 head
(benchmarks/round_exchange.py): `round_exchange_s` as {files, collective} × {2, 4 members}; target: the collective
at most a third of the files' time at 4 members.

Printed (JSON keys): `acceptance_before` (starting drafter), `acceptance_after_one` / `acceptance_after_two`
(the lineage head after (a) / (b)): expected acceptance length at k (default 4) on held-out rollouts of v1
that were never in the stream, with v1 as teacher; `merges` (merges into the head in (b); rounds: heads published),
`merges_one`;
`first_promotion_s` / `first_promotion_s_one`: from the sessions' start to the first promoted candidate
(null: none promoted); `transport`: the engine a round's gradients are exchanged on (torch.distributed and its
backend). Targets: after_two ≥ after_one − 0.05; both ≥ before + 0.5.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailspec.core import state
from tailspec.core.state import DrafterVersion, Event, PhaseInfo, Sample
from tailspec.rollout.sequence import SamplingParams

from tailspec.commands.args import config_from_args
from tailspec.demo.options import DemoOptions
from tailspec.tasks.runsum import grade, sample_problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DemoOptions.policy,
                   help=f"policy preset (default: the demo's, {DemoOptions.policy})")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps in total, per configuration")
    p.add_argument("--samples", type=int, default=256, help="rollouts of v1 in the stream")
    p.add_argument("--heldout", type=int, default=64, help="held-out rollouts of v1 the acceptance is measured on")
    p.add_argument("--grpo-steps", type=int, default=8, help="GRPO steps from v0 to v1")
    p.add_argument("--grpo-lr", type=float, default=1e-4)
    p.add_argument("--grpo-prompts", type=int, default=16, help="prompts per GRPO step (4 responses each)")
    p.add_argument("--bootstrap-steps", type=int, default=60,
                   help="optimizer steps of the starting drafter on v0's own rollouts (a step budget gives the same "
                   "drafter on a busy machine; the demo's bootstrap trains for 60 s instead)")
    p.add_argument("--k", type=int, default=4, help="chain length of the acceptance figure")
    p.add_argument("--validate-every-s", type=float, default=5.0, help="a session proposes a candidate this often "
                   "(the demo's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=2, help="sessions in configuration (b) (default 2)")
    p.add_argument("--alternate", action="store_true",
                   help="run the sessions in one process, taking turns one merge chunk each, instead of as concurrent "
                        "processes: the same delay per merge, none of the timing (deterministic; no validations). "
                        "It measures the asynchronous merge (trainer.merge_rule async): rounds need concurrent members")
    p.add_argument("--drafter-shape", choices=("8b", "70b"), default=None,
                   help="measure only a round's gradient exchange (files vs collective, 2 and 4 members) at the EAGLE-3 "
                        "head of this policy size, random weights and synthetic gradients")
    p.add_argument("--exchange-rounds", type=int, default=3, help="rounds per exchange figure (--drafter-shape)")
    p.add_argument("--exchange-dir", default=None, help="where the files exchange writes (--drafter-shape; default: "
                   "the system's temp directory)")


def rollouts(model, tok, cfg, n: int, seed: int, version: int, max_seq_len: int = 640) -> tuple[list, list[Sample]]:
    """n graded rollouts of an in-memory policy at T=1 (native engine): (RL rollouts, samples)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.engine import Engine

    from tailspec.rl import Rollout
    from tailspec.tasks.tokenizer import decode_response, encode_prompt

    problems = sample_problems(-(-n // 4), cfg.task, seed=seed)
    prompts = [encode_prompt(tok, p.prompt) for p in problems for _ in range(4)][:n]
    engine = Engine(model, None, max_batch=64, max_seq_len=max_seq_len, seed=seed)
    params = [SamplingParams(max_tokens=max_seq_len - len(p), temperature=1.0, seed=seed * 7919 + i)
              for i, p in enumerate(prompts)]
    outs = engine.generate(prompts, params)
    ro, samples = [], []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        reward = grade(problems[i // 4], decode_response(tok, o.token_ids), cfg.task).reward
        ro.append(Rollout(p, o.token_ids, o.sampling_logprobs, reward, i // 4))  # the distribution sampled from
        samples.append(Sample(prompt_ids=p, response_ids=o.token_ids, reward=reward, policy_version=version,
                              group_id=f"{version}:{seed}:{i // 4}"))
    return ro, samples


def move_policy(policy_dir: Path, cfg, args, out: Path) -> tuple[Path, list[float]]:
    """v1: GRPO steps from v0 on its own rollouts; returns (v1 directory, mean reward per step)."""
    # deferred: torch and the models (torch alone is seconds of `tailspec --help`); the CLI imports every bench
    # module to build its parser
    import torch

    from tailspec.rl import grpo_step, save_policy_weights
    from tailspec.tasks.policy import load_policy

    model, tok = load_policy(policy_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=args.grpo_lr, betas=(0.9, 0.99), weight_decay=0.0)
    rewards = []
    for step in range(args.grpo_steps):
        ro, _ = rollouts(model, tok, cfg, 4 * args.grpo_prompts, seed=args.seed * 1000 + 500 + step, version=0)
        rewards.append(grpo_step(model, opt, ro, tok.pad_token_id).mean_reward)
        print(f"  GRPO step {step}: mean reward {rewards[-1]:.3f}", file=sys.stderr, flush=True)
    return save_policy_weights(model, tok, out), rewards


def session_entry(ctx) -> dict:
    """Session process entry: `tailspec.session_entry.run_session` for $TAILSPEC_BENCH_MAX_STEPS steps."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.session_entry import run_session

    return run_session(ctx, max_steps=int(os.environ["TAILSPEC_BENCH_MAX_STEPS"]))


def run_config(n_sessions: int, args, cfg, boot: str, stream: list[Sample], v1_dir: Path, root: Path) -> dict:
    """Fresh Redis and lineage seeded with the starting drafter; n session processes share args.steps."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis
    from tailspec.drafter_trainer.lineage import Lineage

    from tailspec.demo.bootstrap import seed_store
    from tailspec.demo.options import apply_demo_trainer
    from tailspec.redis_server import start_redis

    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        c = cfg.model_copy(deep=True)
        c.cluster.name, c.cluster.redis_url = f"cotrain{n_sessions}", server.url
        c.trainer.checkpoint_dir = str(root / f"drafter-{n_sessions}")
        c.trainer.validate_every_s = args.validate_every_s
        apply_demo_trainer(c.trainer)  # the demo's session settings, unless set on the command line
        seed_store(boot, c, r)  # v1 of the store and head 1 of the lineage = the starting drafter (+ v0 samples)
        for s in stream:
            state.append(r, state.key(c.cluster.name, "samples"), s)
        state.put(r, state.key(c.cluster.name, "phase"),
                  PhaseInfo(phase="rollout", step=1, started_at=time.time(), policy_version=1, policy_path=str(v1_dir)))
        t0 = time.time()
        procs = _start_sessions(n_sessions, args, c, r, server.url, root)
        first_promotion = _wait_sessions(procs, r, c.cluster.name, t0)
        seconds = time.time() - t0
        bad = [g for g, p in enumerate(procs) if p.returncode != 0]
        if bad:
            tail = (root / f"session-{n_sessions}-{bad[0]}.log").read_text()[-3000:]
            raise RuntimeError(f"session(s) {bad} of run ({'a' if n_sessions == 1 else 'b'}) failed; the first's log "
                               f"ends:\n{tail}")
        for g in range(n_sessions):  # each session's summary line: steps, merges, validating, rounds
            for line in (root / f"session-{n_sessions}-{g}.log").read_text().splitlines():
                if line.startswith("tailspec session "):
                    print("     ", line[len("tailspec "):], file=sys.stderr)
        head = Lineage(Path(c.trainer.checkpoint_dir) / "lineage", r, c.cluster.name).head()
        history = [state.decode(DrafterVersion, x) for x in r.lrange(state.key(c.cluster.name, "drafter_versions"), 0, -1)]
        return {"head": head, "seconds": seconds, "first_promotion_s": first_promotion,
                "promotions": sum(1 for v in history[1:] if v.promoted), "candidates": len(history) - 1,
                "contributions": Lineage(Path(c.trainer.checkpoint_dir) / "lineage", r, c.cluster.name).contributions()}
    finally:
        server.stop()


def run_alternating(n_sessions: int, args, cfg, boot: str, stream: list[Sample], teacher, root: Path) -> dict:
    """n sessions in this process, no Redis, taking turns: one chunk (trainer.merge_every_steps steps) each,
    each chunk starting from the head its own session merged last, so every delta lands after the other n - 1
    sessions' chunks: the delay n contributors training at once have. What it leaves out is the timing (which
    merges land between which, and the validations' pauses) that moves the concurrent figure by 0.1 from one
    commit to the next; one session is the same run either way, bit for bit."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch
    from tailspec.drafter_trainer.lineage import Lineage
    from tailspec.drafter_trainer.model import Eagle3Module
    from tailspec.drafter_trainer.samples import fill_buffer
    from tailspec.drafter_trainer.training_session import TrainingSession

    from tailspec.demo.bootstrap import load_optimizer, load_samples
    from tailspec.session_entry import make_buffer

    tc = cfg.trainer
    lineage = Lineage(root / f"alternate-{n_sessions}" / "lineage", None, "alternate", outer_lr=tc.merge_outer_lr)
    lineage.seed(Eagle3Module.load(boot), {"step": 0, "tokens": 0, "backend": tc.backend, "policy_version": 0},
                 session_id="bootstrap", optimizer_state=load_optimizer(boot))
    samples = load_samples(boot) + stream  # what the concurrent run's stream holds: v0's samples, then v1's
    chunk = tc.merge_every_steps or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each session process runs (OMP_NUM_THREADS=1): the same arithmetic
    t0 = time.time()
    try:
        sessions = []
        for g in range(n_sessions):
            buffer = make_buffer(cfg)
            fill_buffer(buffer, samples, teacher.config.vocab_size, tc.max_seq_len)
            sessions.append(TrainingSession(tc, teacher, buffer, checkpoint_dir=root / f"alternate-{n_sessions}" / f"{g}",
                                            session_id=f"s{n_sessions}-{g}", lineage=lineage, merge_every_steps=chunk))
        left = [args.steps // n_sessions] * n_sessions
        while any(left):
            for g, session in enumerate(sessions):
                if left[g]:
                    done = session.run(max_steps=min(chunk, left[g])).steps  # ends with its merge
                    left[g] -= done
    finally:
        torch.set_num_threads(threads)
    return {"head": lineage.head(), "seconds": time.time() - t0, "first_promotion_s": None, "promotions": 0,
            "candidates": 0, "contributions": lineage.contributions()}


def _start_sessions(n_sessions: int, args, c, r, redis_url: str, root: Path) -> list[subprocess.Popen]:
    """n session processes, each on its own lease (GPUs n0:0..n-1), sharing args.steps."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.leases import Leases
    from tailspec.scheduler.session_process import CONTEXT_ENV, SessionContext

    leases = Leases(r, c.cluster.name)
    procs = []
    for g in range(n_sessions):
        lease = leases.acquire("n0", g, f"bench{g}", ttl_s=600)
        ctx = SessionContext(session_id=f"s{n_sessions}-{g}", node="n0", gpu=g, lease_token=lease.token,
                             redis_url=redis_url, cluster=c.cluster.name, config=c.model_dump(mode="json"),
                             lease_ttl_s=600, require_heartbeat=False)
        env = dict(os.environ, OMP_NUM_THREADS="1", TAILSPEC_SESSION_ENTRY="tailspec.benchmarks.cotrain:session_entry",
                   TAILSPEC_BENCH_MAX_STEPS=str(args.steps // n_sessions))
        env[CONTEXT_ENV] = ctx.to_json()
        log = open(root / f"session-{n_sessions}-{g}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "tailspec.scheduler.session_process"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait_sessions(procs: list[subprocess.Popen], r, cluster: str, t0: float) -> float | None:
    """Wait for every session to end; seconds from t0 to the first promotion past v1 (None: none)."""
    first_promotion = None
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
        if first_promotion is None:
            for _, e in state.read_stream(r, state.key(cluster, "events"), Event)[0]:
                if e.kind == "version_promoted" and int(e.detail.get("version", 0)) > 1:
                    first_promotion = e.ts - t0
                    break
    return first_promotion


def run(args: argparse.Namespace) -> dict:
    # deferred: torch and the models (torch alone is seconds of `tailspec --help`); the CLI imports every bench
    # module to build its parser
    import torch
    from tailspec.drafter_trainer.checkpoint import load_checkpoint
    from tailspec.drafter_trainer.model import Eagle3Module
    from tailspec.drafter_trainer.teacher import Teacher
    from tailspec.drafter_trainer.versions import validate

    from tailspec.demo.bootstrap import bootstrap_drafter, load_samples
    from tailspec.demo.options import apply_demo_trainer
    from tailspec.tasks.policy import load_policy, resolve_policy

    if args.drafter_shape is not None:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.benchmarks.round_exchange import measure

        out = measure(args.drafter_shape, args.exchange_rounds, Path(args.exchange_dir) if args.exchange_dir else None)
        return {**out, "transport": transport()}
    if args.sessions < 2 or args.steps % args.sessions:
        raise SystemExit(f"--sessions must be at least 2 and divide --steps ({args.steps}); got {args.sessions}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    cfg = config_from_args(args)
    policy0 = resolve_policy(args.preset, cfg.task, cache_dir=Path(cfg.cache_dir))
    print(f"bench cotrain: policy {policy0.name}; bootstrap drafter (cached after the first run)", file=sys.stderr)
    apply_demo_trainer(cfg.trainer)
    boot = bootstrap_drafter(policy0, cfg, 256, seconds=1800.0, seed=args.seed, steps=args.bootstrap_steps)
    v0_samples = load_samples(boot)
    with tempfile.TemporaryDirectory(prefix="tailspec-cotrain-") as tmp:
        root = Path(tmp)
        print(f"  v0 → v1: {args.grpo_steps} GRPO steps at lr {args.grpo_lr}", file=sys.stderr, flush=True)
        v1_dir, rewards = move_policy(policy0, cfg, args, root / "policy-v1")
        model1, tok = load_policy(v1_dir)
        _, v1_samples = rollouts(model1, tok, cfg, args.samples, seed=args.seed * 1000 + 900, version=1)
        _, heldout = rollouts(model1, tok, cfg, args.heldout, seed=args.seed * 1000 + 950, version=1)
        teacher = Teacher.from_dir(v1_dir, policy_version=1)
        emb = teacher.embedding()

        def acceptance(drafter: Eagle3Module) -> float:
            return validate(drafter, teacher, heldout, args.k).acceptance_length

        before = acceptance(Eagle3Module.load(boot, emb))
        before_v0 = validate(Eagle3Module.load(boot, Teacher.from_dir(policy0).embedding()),
                             Teacher.from_dir(policy0), v0_samples[-args.heldout:], args.k).acceptance_length
        out = {}
        for n in (1, args.sessions):
            print(f"  ({'a' if n == 1 else 'b'}) {n} session(s), {args.steps} steps in total", file=sys.stderr, flush=True)
            res = (run_alternating(n, args, cfg, boot, v1_samples, teacher, root) if args.alternate
                   else run_config(n, args, cfg, boot, v1_samples, v1_dir, root))
            head = res["head"]
            after = acceptance(load_checkpoint(head.path, emb).drafter)
            out[n] = {**res, "after": after}
            print(f"      head {head.number}: {head.steps} steps in {head.merges} merges, {res['seconds']:.0f} s; "
                  f"acceptance {after:.3f}; promotions {res['promotions']}/{res['candidates']}, first after "
                  f"{res['first_promotion_s'] if res['first_promotion_s'] is None else round(res['first_promotion_s'], 1)} s",
                  file=sys.stderr, flush=True)
    rule = "async" if args.alternate else cfg.trainer.merge_rule
    return _result(args, rewards, before, before_v0, out[1], out[args.sessions], rule)


def transport() -> str:
    """The engine a round's gradients are exchanged on, on this machine (drafter_trainer/collective.py)."""
    # deferred: torch (the CLI imports every bench module to build its parser)
    import torch
    from tailspec.drafter_trainer.collective import backend_for

    return f"torch.distributed/{backend_for(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))}"


def _result(args: argparse.Namespace, rewards: list[float], before: float, before_v0: float, one: dict,
            two: dict, rule: str) -> dict:
    result = {
        "preset": args.preset, "k": args.k, "steps": args.steps, "grpo_steps": args.grpo_steps,
        "sessions": args.sessions, "mode": "alternate" if args.alternate else "concurrent",
        "grpo_rewards": rewards, "acceptance_before": before, "acceptance_before_on_v0": before_v0,
        "acceptance_after_one": one["after"], "acceptance_after_two": two["after"],
        "merges": two["head"].merges, "merges_one": one["head"].merges,
        "steps_one": one["head"].steps, "steps_two": two["head"].steps,
        "contributions_two": two["contributions"],
        "first_promotion_s": two["first_promotion_s"], "first_promotion_s_one": one["first_promotion_s"],
        "promotions_one": one["promotions"], "promotions_two": two["promotions"],
        "seconds_one": one["seconds"], "seconds_two": two["seconds"],
        "merge_rule": rule,
        "transport": transport() if rule == "rounds" else "files (the lineage head's merges)",
        "target_merge_cost_met": two["after"] >= one["after"] - 0.05,
        "target_gain_met": min(one["after"], two["after"]) >= before + 0.5,
    }
    print(f"acceptance at k={args.k} on v1's held-out rollouts: before {before:.3f} (on v0's own: {before_v0:.3f}); "
          f"after one session {one['after']:.3f}, after two {two['after']:.3f} ({two['head'].merges} merges)",
          file=sys.stderr)
    return result
