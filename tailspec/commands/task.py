"""`tailspec task sample | eval | build`: look at the synthetic task and evaluate a policy on it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tailspec.commands.args import add_config_args, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("task", help="the built-in synthetic long-tail task")
    tsub = p.add_subparsers(dest="task_cmd", metavar="ACTION")
    tsub.required = True

    s = tsub.add_parser("sample", help="print sample problems with their gold responses")
    s.add_argument("-n", type=int, default=5, help="how many (default 5)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    add_config_args(s)
    s.set_defaults(func=_sample)

    e = tsub.add_parser("eval", help="accuracy and response-length percentiles of a policy at a temperature")
    e.add_argument("--policy", metavar="DIR|PRESET", default="tiny",
                   help="a policy directory, or a preset name (micro|micro4|tiny|deep|small|gpu) built and cached on first use")
    e.add_argument("-n", type=int, default=256, help="problems to evaluate (default 256)")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--seed", type=int, default=10_000)
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    add_config_args(e)
    e.set_defaults(func=_eval)

    b = tsub.add_parser("build", help="build, pre-train and cache a preset policy; prints its directory")
    # checked in _build against tasks.policy.PRESETS: importing it here would load torch for every CLI call
    b.add_argument("--preset", default="tiny", help="micro | micro4 | tiny | small | deep | gpu (default tiny)")
    b.add_argument("--device", default=None, help="torch device for training (default: cpu; CUDA where there is one for the gpu preset)")
    add_config_args(b)
    b.set_defaults(func=_build)


def resolve_policy(spec: str, cfg) -> str:
    """A directory path as given, or a preset name → the cached (built on first use) policy directory."""

    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.tasks import policy

    try:
        return str(policy.resolve_policy(spec, cfg.task, cache_dir=Path(cfg.cache_dir)))
    except ValueError as e:
        raise SystemExit(f"tailspec: --policy: {e}") from None


def _sample(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.tasks.runsum import sample_problems

    cfg = config_from_args(args)
    for p in sample_problems(args.n, cfg.task, seed=args.seed):
        if args.json:
            print(json.dumps({"prompt": p.prompt, "gold": p.gold, "answer": p.answer}))
        else:
            print(f"{p.prompt}  →  {p.gold}")
    return 0


def histogram(values: list[int], bins: int = 12, width: int = 40) -> str:
    """Text histogram on log-spaced bins (the long tail shows as a slowly thinning right side)."""
    v = np.asarray(values, dtype=float)
    lo, hi = max(1.0, v.min()), max(2.0, v.max() + 1)
    edges = np.unique(np.geomspace(lo, hi, bins + 1).round())
    counts, edges = np.histogram(v, bins=edges)
    top = max(1, counts.max())
    lines = []
    for c, a, b in zip(counts, edges[:-1], edges[1:]):
        lines.append(f"{int(a):>5}-{int(b) - 1:<5} {'█' * int(round(width * c / top)):<{width}} {c}")
    return "\n".join(lines)


def eval_policy(policy_dir: str, cfg, n: int, temperature: float, seed: int) -> dict:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.tasks.policy import count_params, evaluate, load_policy

    model, tok = load_policy(policy_dir)
    ev = evaluate(model, tok, cfg.task, n=n, temperature=temperature, seed=seed)
    return {
        "policy": policy_dir, "params": count_params(model), "n": ev.n, "temperature": temperature,
        "accuracy": ev.accuracy, "well_formed": ev.well_formed,
        "len_p50": ev.len_p50, "len_p90": ev.len_p90, "len_p99": ev.len_p99, "tail_ratio": ev.tail_ratio,
        "gold_len_p50": ev.gold_len_p50, "gold_len_p99": ev.gold_len_p99, "lengths": ev.lengths,
    }


def print_eval(r: dict, out=sys.stdout) -> None:
    print(f"policy {r['policy']} ({r['params']:,} params), {r['n']} problems at temperature {r['temperature']}",
          file=out)
    print(f"accuracy {r['accuracy']:.1%}   well-formed {r['well_formed']:.1%}", file=out)
    print(f"response length (tokens): p50 {r['len_p50']:.0f}  p90 {r['len_p90']:.0f}  p99 {r['len_p99']:.0f}"
          f"  (p99/p50 = {r['tail_ratio']:.1f}; gold p50 {r['gold_len_p50']:.0f}, p99 {r['gold_len_p99']:.0f})",
          file=out)
    print(histogram(r["lengths"]), file=out)


def _eval(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    r = eval_policy(resolve_policy(args.policy, cfg), cfg, args.n, args.temperature, args.seed)
    print_eval(r)
    if args.json:
        r = {k: v for k, v in r.items() if k != "lengths"}
        print(json.dumps(r))
    return 0


def _build(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.tasks.policy import PRESETS, get_policy, policy_meta

    if args.preset not in PRESETS:
        print(f"tailspec task build: unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    path = get_policy(args.preset, cfg.task, cache_dir=Path(cfg.cache_dir), device=args.device)
    meta = policy_meta(path)
    print(f"{path}\n  params {meta.get('params', 0):,}  trained {meta.get('train_seconds', 0):.0f}s  "
          f"accuracy {meta.get('accuracy', 0):.1%}")
    return 0
