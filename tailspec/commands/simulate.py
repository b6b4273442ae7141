"""`tailspec simulate`: project RL steps with and without tailspec on a GPU cluster (every figure: "projection")."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

SWEEP_MODELS = ("qwen2.5-7b", "qwen3-32b", "qwen3-235b-a22b")
SWEEP_GPUS = (64, 256, 1024)


def register(sub: argparse._SubParsersAction) -> None:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.hardware import GPUS, MODELS

    p = sub.add_parser("simulate", help="project RL steps on N GPUs: no SD, frozen drafter, co-trained (projection)")
    p.add_argument("--model", default="qwen2.5-7b", help=f"{', '.join(MODELS)}, or a path to an HF config.json")
    p.add_argument("--gpu", default="H100", choices=sorted(GPUS) + [g.lower() for g in GPUS])
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--tp", type=int, default=None, help="GPUs per rollout replica (default: the smallest that fits)")
    p.add_argument("--pipeline", choices=["sync", "async"], default="sync")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-replica", type=float, default=4.0)
    p.add_argument("--group", type=int, default=16, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--length-median", type=float, default=1500.0)
    p.add_argument("--length-sigma", type=float, default=0.9)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--lengths-trace", metavar="JSONL", help="response lengths to draw from (one per line)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--k", type=int, default=None, help="one draft length at every batch size (default: adaptive)")
    p.add_argument("--alpha0", type=float, default=None, help="per-token acceptance of the first drafter")
    p.add_argument("--alpha-max", type=float, default=None, help="per-token acceptance a co-trained drafter tends to")
    p.add_argument("--decay", type=float, default=None, help="relative acceptance lost per policy step of staleness")
    p.add_argument("--acceptance-from", metavar="RUN_DIR",
                   help="take alpha0, alpha-max and decay from a recorded demo run's metrics.jsonl")
    p.add_argument("--validation-samples", type=int, default=64,
                   help="held-out samples a candidate drafter is validated on (0: no validation modelled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help=f"models {', '.join(SWEEP_MODELS)} x GPUs "
                   f"{', '.join(map(str, SWEEP_GPUS))} x sync/async (other options apply to every run)")
    p.add_argument("--calibrate", metavar="RUN_DIR", help="replay a recorded `tailspec demo` run and compare")
    p.add_argument("--holdout", nargs="+", metavar="RUN_DIR", help="fit on the first recorded run, predict the "
                   "others from their own settings, warm-up tables and lengths (out-of-sample calibration)")
    p.add_argument("--anchors", action="store_true", help="published RL results beside the projection of each setting")
    p.add_argument("--drift", nargs="+", metavar="RUN_DIR", help="fit the drafter's drift on recorded runs and project "
                   "the co-trained vs frozen gap (an interval) for --drift-steps of the scenario")
    p.add_argument("--drift-steps", default="100,300,1000", help="run lengths for --drift (comma-separated)")
    p.add_argument("--gantt", metavar="PNG", help="write a per-GPU Gantt chart of the last co-trained step")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_run)


def scenario_from_args(args: argparse.Namespace):
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.drafter import DrafterCurve
    from tailspec.simulate.run import Scenario

    curve = DrafterCurve()
    if args.acceptance_from:
        # deferred: the CLI imports every command module to build its parser; this loads when the command runs
        from tailspec.simulate.fit import curve_from_run

        curve = curve_from_run(args.acceptance_from)
    updates = {k: v for k, v in (("alpha0", args.alpha0), ("alpha_max", args.alpha_max), ("decay", args.decay)) if v is not None}
    curve = replace(curve, **updates)
    return Scenario(model=args.model, gpu=args.gpu.upper(), gpus=args.gpus, tp=args.tp, pipeline=args.pipeline,
                    prompts_per_replica=args.prompts_per_replica, group=args.group, prompt_len=args.prompt_len,
                    length_median=args.length_median, length_sigma=args.length_sigma, max_len=args.max_len,
                    lengths_trace=args.lengths_trace, max_batch=args.max_batch, k_max=args.k_max, k=args.k,
                    steps=args.steps, seed=args.seed, curve=curve, validation_samples=args.validation_samples)


def print_summary(s: dict) -> None:
    print(f"projection: {s['model']} on {s['gpus']} x {s['gpu']} (tp {s['tp']}, {s['replicas']} rollout replicas), "
          f"{s['pipeline']}, {s['steps']} steps")
    print(f"  step time (s)      no SD {s['step_s']['nospec']:.1f} | frozen {s['step_s']['frozen']:.1f} | "
          f"co-trained {s['step_s']['cotrained']:.1f}")
    print(f"  rollout time (s)   no SD {s['rollout_s']['nospec']:.1f} | frozen {s['rollout_s']['frozen']:.1f} | "
          f"co-trained {s['rollout_s']['cotrained']:.1f}")
    print(f"  speedup vs no SD   co-trained {s['speedup_cotrained']:.2f}x (rollout {s['rollout_speedup_cotrained']:.2f}x)"
          f" | frozen {s['speedup_frozen']:.2f}x (rollout {s['rollout_speedup_frozen']:.2f}x)"
          f" | co-trained vs frozen {s['speedup_vs_frozen']:.2f}x")
    print("  (co-trained vs frozen rests on the drafter curve's assumed lift and decay, simulate/drafter.py; what the "
          "recorded runs support: tailspec simulate --drift)")
    a = s["alpha_first_last"]
    print(f"  tail idle share {s['tail_idle_share']:.2f} | reclaimed share {s['reclaimed_share']:.2f} | "
          f"drafter training / tail idle {s['training_share_of_tail']:.2f} "
          f"(validating {s['validating_share_of_tail']:.2f}) | per-token acceptance frozen "
          f"{a['frozen'][0]:.2f}->{a['frozen'][1]:.2f}, co-trained {a['cotrained'][0]:.2f}->{a['cotrained'][1]:.2f}")


def run_sweep(sc) -> list[dict]:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.run import simulate

    rows = []
    for model in SWEEP_MODELS:
        for gpus in SWEEP_GPUS:
            for pipeline in ("sync", "async"):
                s = simulate(replace(sc, model=model, gpus=gpus, pipeline=pipeline, tp=None)).summary()
                rows.append({"model": model, "gpus": gpus, "pipeline": pipeline, "tp": s["tp"],
                             "speedup_cotrained": s["speedup_cotrained"], "speedup_frozen": s["speedup_frozen"],
                             "rollout_speedup_cotrained": s["rollout_speedup_cotrained"],
                             "reclaimed_share": s["reclaimed_share"], "tail_idle_share": s["tail_idle_share"],
                             "step_s_nospec": s["step_s"]["nospec"], "step_s_cotrained": s["step_s"]["cotrained"]})
    return rows


def print_sweep(rows: list[dict]) -> None:
    print("projection sweep (speedup over no SD, per RL step)")
    print(f"  {'model':16} {'GPUs':>5} {'pipeline':8} {'tp':>3} {'co-trained':>10} {'frozen':>7} {'rollout co':>10} "
          f"{'tail idle':>9} {'reclaimed':>9}")
    for r in rows:
        print(f"  {r['model']:16} {r['gpus']:>5} {r['pipeline']:8} {r['tp']:>3} {r['speedup_cotrained']:>9.2f}x "
              f"{r['speedup_frozen']:>6.2f}x {r['rollout_speedup_cotrained']:>9.2f}x {r['tail_idle_share']:>9.2f} "
              f"{r['reclaimed_share']:>9.2f}")


def run_policy_model(run_dir: str):
    """The recorded run's policy dimensions: its directory's config.json, else the preset its cache directory
    is named after (`deep-<hash>`), so a recorded run replays on a machine without the policy cache."""
    # deferred: the CLI imports every command module to build its parser; these load when a replay runs
    from tailspec.simulate import hardware as hw
    from tailspec.simulate.calibrate import load_run, policy_model

    policy = load_run(run_dir, need_costs=False)[0]["options"].get("policy")
    found = policy_model(policy)
    if found is not None or not policy:
        return found
    from tailspec.tasks.policy import PRESETS  # deferred: imports torch
    from tailspec.tasks.tokenizer import ALPHABET, SPECIALS

    pre = PRESETS.get(Path(policy).name.split("-")[0])
    if pre is None:
        return None
    return hw.model_from_config({"num_hidden_layers": pre.num_layers, "hidden_size": pre.hidden_size,
                                 "num_attention_heads": pre.num_heads, "num_key_value_heads": pre.num_kv_heads,
                                 "intermediate_size": pre.intermediate_size,
                                 "vocab_size": len(ALPHABET) + len(SPECIALS)}, pre.name)


def holdout_report(dirs: list[str]) -> dict:
    """Fit on dirs[0], predict the others; printed per run and figure."""
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.holdout import out_of_sample

    if len(dirs) < 2:
        raise ValueError("--holdout needs a run to fit on and at least one run to predict")
    models = [run_policy_model(d) for d in dirs]
    fit_model = models[0]
    if len({m and replace(m, name="") for m in models}) > 1:
        raise ValueError("--holdout: the runs' policies differ in shape; the context term needs one policy")
    o = out_of_sample(dirs[0], dirs[1:], fit_model)
    print(f"out-of-sample calibration: fitted on {dirs[0]}; projection vs measured on runs not fitted")
    for h in o["runs"]:
        errs = ", ".join(f"{k} {h['predicted'][k]:.3f} vs {v:.3f} ({h['rel_error'][k]:.1%})"
                         for k, v in h["measured"].items())
        print(f"  {h['run_dir']} ({h['mode']}, {h['workers']} workers, {h['steps']} steps): {errs}")
    print(f"  max relative error {o['max_rel_error']:.1%} (" +
          ", ".join(f"{k} {v:.1%}" for k, v in o["max_rel_error_by_figure"].items()) + ")")
    return o


def anchors_report() -> list[dict]:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.anchors import check_all

    rows = check_all()
    print("published RL results vs the projection of each setting (projection)")
    print(f"  {'anchor':48} {'figure':22} {'published':>10} {'projected':>9}  result")
    for r in rows:
        pub = f"{'>' if r['bound'] == '>' else 'up to ' if r['bound'] == '<=' else ''}{r['published']:.2f}x"
        verdict = "within 25%" if r["hit"] else f"MISS: {r['likely_cause']}"
        print(f"  {r['name']:48} {r['figure']:22} {pub:>10} {r['projected']:>8.2f}x  {verdict}")
    return rows


def drift_report(dirs: list[str], sc, steps: str) -> dict:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.drift import fit_drift, project_gap, scenario_step_time

    fitted = fit_drift(dirs)
    d, r = fitted.decay, fitted.recovery
    print(f"drift fitted on {len(dirs)} recorded runs: frozen log-alpha {d.value:.4f} ± {d.se:.4f} a step "
          f"(n {d.n}), saturating at {fitted.saturation:.3f}; co-trained recovery {r.value:.2f} ± {r.se:.2f} (n {r.n})")
    p = fitted.policy
    if p is None:
        print("  the policy's KL and entropy: not in these runs' record")
    else:
        per_kl = (f"{p.loss_per_kl.value:.3f} ± {p.loss_per_kl.se:.3f} log-alpha lost per nat of cumulative KL "
                  f"(n {p.loss_per_kl.n})" if p.loss_per_kl else "no frozen drafter measured beside it")
        print(f"  the policy: KL a step {p.kl_per_step.value:.4f} ± {p.kl_per_step.se:.4f} nats (trend "
              f"{p.kl_trend.value:+.3f} ± {p.kl_trend.se:.3f} log a step), entropy {p.entropy_per_step.value:+.4f} ± "
              f"{p.entropy_per_step.se:.4f} nats a step; the frozen drafter {per_kl}")
    step_time = scenario_step_time(sc)
    gaps = []
    for n in (int(x) for x in steps.split(",")):
        g = project_gap(n, fitted, sc.curve.alpha0, step_time)
        lo, hi = g["gap_interval"]
        print(f"  {n:>5} steps: co-trained ÷ frozen step speed {lo:.3f}-{hi:.3f}x (projection)")
        gaps.append(g)
    return {"fit": fitted.to_dict(), "gaps": gaps}


def _run(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.simulate.run import simulate

    try:
        if args.holdout:
            result: dict = {"out_of_sample": holdout_report(args.holdout)}
        elif args.anchors:
            result = {"label": "projection vs published", "anchors": anchors_report()}
        elif args.drift:
            result = {"label": "projection", "drift": drift_report(args.drift, scenario_from_args(args), args.drift_steps)}
        elif args.calibrate:
            # deferred: the CLI imports every command module to build its parser; this loads when the command runs
            from tailspec.simulate.calibrate import calibrate

            c = calibrate(args.calibrate, model=run_policy_model(args.calibrate)).to_dict()
            m, p = c["measured"], c["predicted"]
            print(f"calibration on {args.calibrate} ({c['mode']}, {c['steps']} steps): projection vs measured")
            for k in m:
                print(f"  {k:16} {p[k]:8.3f} vs {m[k]:8.3f}  ({c['rel_error'].get(k, 0.0):.1%} off)")
            result = {"calibration": c}
        else:
            sc = scenario_from_args(args)
            if args.sweep:
                rows = run_sweep(sc)
                print_sweep(rows)
                result = {"label": "projection", "sweep": rows}
            else:
                proj = simulate(sc)
                result = proj.summary()
                print_summary(result)
                if args.gantt:
                    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
                    from tailspec.simulate.plot import gantt

                    out = proj.gantt["cotrained"]
                    row = proj.mode_rows("cotrained")[-1]
                    path = gantt(out, row.train_s, sc.pipeline == "sync", proj.startup_s, args.gantt,
                                 f"{sc.model}, {sc.gpus} x {sc.gpu}, co-trained step {row.step}")
                    print(f"  Gantt chart: {path}")
                result["scenario"] = json.loads(json.dumps(asdict(sc), default=str))
    except (ValueError, OSError) as e:
        print(f"tailspec simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, separators=(",", ":"), default=float))
    return 0
