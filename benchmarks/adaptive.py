"""Adaptive strategy selection: tokens/s per batch size for every fixed strategy (chains and trees), the oracle,
adaptive over the whole space, adaptive over chains only, BEG, threshold.

Everything runs side by side in one process on the same models: for each batch size and repeat, every selector
has its own engine on the same requests, and the engines take turns a few steps at a time (lockstep), so the
drift of a shared machine reaches them alike; the median over repeats is reported. (With a graph pool, one
engine per batch size is reconfigured, and the selectors run one after another.) The per-batch oracle is the
best fixed strategy of the whole space, and which one that is gets decided on other repeats than the one it is scored on
(`held_out_oracle`): the best of several near-tied fixed ks on the same repeats is their noise's maximum, above
what any of them delivers (the winner's curse). `adaptive_vs_oracle` is the median over repeats of adaptive ÷
the held-out oracle in the same repeat (the same requests); the in-sample figures stay beside it. A second engine
running the smallest speculative k (`twin`) is paired with the first the same way: what two identical engines
measure of each other is the resolution of every ratio in the run. A run at
batch b keeps b requests running (a queue refills finished slots between steps; their prefill is not timed) and
times max(`steps`, `rows` / b) decode steps after `warmup` untimed ones, enough at small batch to cover several
whole responses. Its requests start at their prompts;
`--start mid` starts them at a random depth of responses the policy wrote beforehand instead (a
sensitivity check: it weighs the later tokens of a response more than a rollout does).

Then one long-tail rollout: a batch of task prompts whose response lengths follow the task's heavy-tailed
distribution, run to completion under each selector, end to end, at the main job's temperature (1) under the
verify rule of the run's config (the main job's: coupled, so every selector emits the identical tokens and the
times compare the same work; the output says which rule ran).

No SD (the fixed strategy `none`, the long tail's `nospec`), the baseline of every `÷ no SD` figure, is plain
decoding: its engine has no drafter (`never_drafts`).

`acceptance_length_at_batch1` is each fixed strategy's tokens per verify forward at batch 1 (every fixed
strategy's timed steps, all repeats).

On a GPU it also captures the graph pool for the target (bf16) and reports pool memory against separately
captured graphs and the verify forward's replay-vs-eager speedup at batch 1, 8, 32.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections import Counter

from tailspec.benchmarks.lockstep import repeat_tps
from tailspec.benchmarks.machine import machine
from tailspec.rollout import cost_model
from tailspec.rollout.schedule_export import schedule_exports
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import Strategy

from tailspec.commands.args import config_from_args
from tailspec.tasks.runsum import sample_problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="deep",
                   help="target policy: a preset (micro, tiny, deep, small) or a policy directory (default deep, the demo's)")
    p.add_argument("--drafter", default="eagle3", choices=["draft_model", "ngram", "eagle3"],
                   help="default eagle3: the demo's first drafter for the target (trained and cached on first use)")
    p.add_argument("--draft-preset", default="micro", help="draft model: a policy preset or directory")
    p.add_argument("--eagle3", default=None,
                   help="directory of a trained EAGLE-3 drafter (default: the demo's bootstrap drafter for --target)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--ks", default="0,1,2,3,4,6", help="fixed chain strategies (draft lengths) to compare")
    p.add_argument("--trees", default=",".join(cost_model.DEFAULT_TREES),
                   help="fixed tree strategies to compare (labels: tree<b1-b2-...>n<nodes>, dyn<depth>x<topk>n<nodes>; "
                        "'' for none; default the main job's); with a drafter that drafts chains only, none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run (at least --rows / batch)")
    p.add_argument("--rows", type=int, default=192,
                   help="timed rows per run: small batches time more steps (a batch-1 step is short and noisy)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per run")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the per-batch runs")
    p.add_argument("--start", choices=["fresh", "mid"], default="fresh",
                   help="where the per-batch runs' requests start: fresh = at the prompt (default), mid = at a random "
                        "depth of a response the policy wrote (a sensitivity check: later tokens weigh more)")
    p.add_argument("--longtail-n", type=int, default=64, help="requests in the long-tail rollout (0: skip)")
    p.add_argument("--longtail-temperature", type=float, default=1.0,
                   help="the long-tail rollout's temperature (default 1, the main job's)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-graphs", action="store_true",
                   help="on CUDA, run every engine eagerly (default: as the main job, rollout.cuda_graphs: the verify "
                        "forward replays a captured graph pool and the cost table is timed through it)")


def _load(args, cfg):
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch
    from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer, NgramProposer

    from tailspec.tasks.policy import load_policy, resolve_policy

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tok = load_policy(resolve_policy(args.target, cfg.task, cache_dir=cfg.cache_dir), dtype=dtype)
    target.to(device)
    if args.drafter == "ngram":
        def make_drafter():
            return NgramProposer()
        label = "ngram"
    elif args.drafter == "draft_model":
        draft, _ = load_policy(resolve_policy(args.draft_preset, cfg.task, cache_dir=cfg.cache_dir), dtype=dtype)
        draft.to(device)

        def make_drafter():
            return DraftModelProposer(draft)
        label = f"draft_model:{args.draft_preset}"
    else:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.drafter_trainer.model import Eagle3Module

        if not args.eagle3:
            # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
            from tailspec.demo.bootstrap import bootstrap_drafter
            from tailspec.demo.options import DemoOptions, apply_demo_trainer

            # the demo's first drafter for this target (its trainer settings and budget: 256 samples, 60 s; cached)
            demo_cfg = cfg.model_copy(deep=True)
            apply_demo_trainer(demo_cfg.trainer, DemoOptions.validation_samples)
            args.eagle3 = bootstrap_drafter(resolve_policy(args.target, cfg.task, cache_dir=cfg.cache_dir), demo_cfg)

        head = Eagle3Module.load(args.eagle3, target.get_input_embeddings()).to(device, dtype)

        def make_drafter():
            return Eagle3Proposer(head, target)
        label = f"eagle3:{args.eagle3}"
    return target, tok, make_drafter, label, device


def _prompts(tok, n: int, seed: int, task_cfg):
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.tasks.tokenizer import encode_prompt

    return [encode_prompt(tok, p.prompt) for p in sample_problems(n, task_cfg, seed=seed)]


def _mid_response(make_engine, prompts, max_tokens: int, max_seq: int, temperature: float, seed: int):
    """(prompt + the first d tokens of a response the policy wrote, tokens left) per prompt, d uniform over the
    response: `--start mid`'s requests. A response's later tokens weigh more in such runs than in a rollout,
    which writes every response from its first token; the check is whether the pick depends on depth."""
    eng = make_engine(min(64, len(prompts)), 0)
    params = [SamplingParams(max_tokens=min(max_tokens, max_seq - len(p)), temperature=temperature, seed=seed + i)
              for i, p in enumerate(prompts)]
    rng = random.Random(seed)
    out = []
    for p, sp, o in zip(prompts, params, eng.generate(prompts, params)):
        d = rng.randrange(len(o.token_ids)) if o.token_ids else 0
        out.append((list(p) + list(o.token_ids[:d]), sp.max_tokens - d))
    return out


def _rollout_s(make_engine, selector, prompts, params) -> tuple[float, int]:
    eng = make_engine(len(prompts), selector)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def _graph_pool_section(target, cost, device: str) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch
    from tailspec.rollout.engine import Engine
    from tailspec.rollout.graph_pool import GraphPool, GraphShape, capture_plan
    from tailspec.rollout.selector import candidate_ks

    eng = Engine(target, None, max_batch=max(cost.buckets), max_seq_len=1024)
    plan = capture_plan(cost, GraphShape.of(eng.runner), budget_bytes=1 << 40)
    pool = GraphPool(eng.runner, plan).capture()
    out = {"pool_bytes": pool.pool_bytes_measured, "separate_bytes": pool.measure_separate_bytes(),
           "plan_entries": len(plan.entries), "pool_bytes_estimate": plan.pool_bytes}
    for b in (1, 8, 32):
        if b > max(cost.buckets):
            continue
        k = max(c.depth for c in candidate_ks(cost, cost.bucket(b)) if not c.is_tree)  # the longest chain planned
        ids = torch.randint(0, target.config.vocab_size, (b, k + 1), device=device)
        start = torch.full((b,), 100, dtype=torch.long, device=device)

        def t(fn, ids=ids, start=start, k=k):
            for _ in range(3):
                fn(ids, start, 0, max_pos=100 + k)
            torch.cuda.synchronize()
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                fn(ids, start, 0, max_pos=100 + k)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        out[f"replay_vs_eager_speedup_b{b}"] = round(t(eng.runner.forward) / t(pool.forward), 3)
        out[f"replay_k_b{b}"] = k
    return out


def never_drafts(selector) -> bool:
    """Whether `selector` is a table that runs no speculation at any batch size: plain decoding, the baseline every
    `÷ no SD` figure divides by. Its engine runs without a drafter, as decoding without speculation does; a drafter
    beside it would catch up on every verified token (a drafter forward per step) for drafts that never come.
    Adaptive's own no-SD steps keep their drafter caught up, since its next step may draft: that cost is its own."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.table_selector import TableSelector

    return isinstance(selector, TableSelector) and not any(Strategy.of(k).speculates for _, _, k in selector.table)


def _engine_factory(target, make_drafter, cfg, max_seq: int, k_max: int, planned: dict | None):
    """make_engine(batch, selector). With `planned` (graphs on): once planned["cost"] is set, each batch size gets
    one engine with a captured graph pool, as the rollout worker attaches one, reused across runs."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.engine import Engine
    from tailspec.rollout.graph_pool import build_pool

    engines: dict[tuple[int, bool], Engine] = {}

    def make_engine(batch: int, selector):
        plain = never_drafts(selector)
        key = (batch, plain)
        if key in engines:
            engines[key].abort_all()
            return engines[key].configure(selector=selector)
        eng = Engine(target, None if plain else make_drafter(), selector=selector, max_batch=batch,
                     max_seq_len=max_seq, k_max=k_max, verify_rule=cfg.rollout.verify_rule)
        if planned is not None and "cost" in planned:
            build_pool(eng, planned["cost"], cfg.rollout.graph_memory_budget_mb << 20)
            engines[key] = eng
        return eng

    return make_engine


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch

    out = sys.stderr if args.json else sys.stdout
    cfg = config_from_args(args)
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    chains = sorted({Strategy.of(int(x)) for x in args.ks.split(",")} | {Strategy.none()})
    target, tok, make_drafter, drafter_label, device = _load(args, cfg)
    trees = sorted({Strategy.parse(x) for x in args.trees.split(",") if x.strip()}) if make_drafter().drafts_trees else []
    ks = chains + trees
    k_max = max(k.depth for k in ks)
    max_seq = min(int(target.config.max_position_embeddings), 1024)

    graphs = device == "cuda" and cfg.rollout.cuda_graphs and not args.no_graphs
    planned: dict = {}  # with graphs: the cost table that plans each engine's pool
    make_engine = _engine_factory(target, make_drafter, cfg, max_seq, k_max, planned if graphs else None)
    t_start = time.perf_counter()
    pool_prompts = _prompts(tok, 512, 11, cfg.task)
    cost, acceptance = _planned_cost_table(make_engine, planned if graphs else None, pool_prompts, batches, ks, k_max,
                                           args, out, t_start)
    starts = _starts(make_engine, pool_prompts, max_seq, args, out)
    selectors = _selectors(cost, acceptance, ks, chains, cfg.rollout.epsilon, planned=graphs)
    adaptive, chain_only = selectors["adaptive"], selectors["adaptive_chain_only"]
    accept1: dict = {}
    per_batch = [_batch_row(make_engine, selectors, adaptive, starts, b, ks, args, out, lockstep=not graphs,
                            accept=accept1 if b == 1 else None)
                 for b in batches]
    longtail = _longtail(make_engine, selectors, tok, max_seq, cfg, args, out) if args.longtail_n > 0 else {}
    result = {
        "device": machine(), "target": args.target, "drafter": drafter_label, "temperature": args.temperature,
        "verify_rule": cfg.rollout.verify_rule,
        "repeats": args.repeats, "steps": args.steps, "rows": args.rows, "ks": [int(k) for k in chains],
        "strategies": [k.label for k in ks], "start": args.start,
        "acceptance_length_at_batch1": {k.label: round(accept1[k.label][0] / accept1[k.label][1], 3)
                                        for k in ks if accept1.get(k.label, (0, 0))[1]},
        "per_batch": per_batch,
        "adaptive_vs_oracle_min_ratio": round(min(r["adaptive_vs_oracle"] for r in per_batch), 3),
        "adaptive_vs_oracle_in_sample_min_ratio": round(min(r["adaptive_tps"] / r["oracle_tps"] for r in per_batch), 3),
        "adaptive_vs_nospec_min_ratio": round(min(r["adaptive_tps"] / r["nospec_tps"] for r in per_batch), 3),
        "adaptive_vs_nospec_at_largest": round(per_batch[-1]["adaptive_tps"] / per_batch[-1]["nospec_tps"], 3),
        "twin_ratio_range": [min(r["twin_ratio"] for r in per_batch), max(r["twin_ratio"] for r in per_batch)],
        "longtail_speedup_vs_nospec": longtail,
        "adaptive_schedule": [(a, b, k.label) for a, b, k in adaptive.schedule(max(batches))],
        "adaptive_chain_only_schedule": [(a, b, k.label) for a, b, k in chain_only.schedule(max(batches))],
        "adaptive_schedule_export": schedule_exports(adaptive.schedule(max(batches))),  # {vllm, sglang}
        "acceptance": {k.label: round(adaptive.acceptance.expected_tokens(k), 4) for k in ks},
        "cost_model": cost.to_dict(),
        "seconds": round(time.perf_counter() - t_start, 1), "graphs": graphs, "lockstep": not graphs,
    }
    if device == "cuda":
        result["graph_pool"] = _graph_pool_section(target, cost, device)
    _report(result, selectors, out)
    return result


def _selectors(cost, acceptance, ks: list, chains: list, epsilon: float, planned: bool = False) -> dict:
    """Every policy the bench runs: each fixed strategy, adaptive over them all, adaptive over the chains alone (on
    its own copies of the estimates: both learn online from their steps), BEG, threshold and the twin. `planned`:
    graph pools captured the warm-up's candidates, which the adaptive selectors keep to."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.selector import AdaptiveSelector
    from tailspec.rollout.table_selector import beg_selector, fixed_selector, threshold_selector

    refresh = {"refresh_steps": 0} if planned else {}
    adaptive = AdaptiveSelector(cost, acceptance, ks=ks, epsilon=epsilon, seed=0, **refresh)
    chain_only = AdaptiveSelector(copy.deepcopy(cost), copy.deepcopy(acceptance), ks=chains, epsilon=epsilon, seed=0,
                                  **refresh)
    selectors = {k.label: fixed_selector(k) for k in ks}
    chain_max = max(k.depth for k in chains)
    selectors |= {"adaptive": adaptive, "adaptive_chain_only": chain_only, "beg": beg_selector(max(chain_max, 1)),
                 "threshold": threshold_selector(min(4, chain_max))}
    # a second engine running the smallest speculative k: two identical engines differ only by the machine's noise,
    # which is how finely the ratios of this run can be read
    selectors["twin"] = fixed_selector(min([k for k in chains if k > 0] or [Strategy.none()]))
    return selectors


def _report(result: dict, selectors: dict, out) -> None:

    print(f"adaptive ÷ per-batch oracle, lowest over batch sizes: {result['adaptive_vs_oracle_min_ratio']:.3f} "
          f"(oracle's k held out; in sample {result['adaptive_vs_oracle_in_sample_min_ratio']:.3f}); adaptive ÷ no SD, "
          f"lowest: {result['adaptive_vs_nospec_min_ratio']:.3f}", file=out)
    lo, hi = result["twin_ratio_range"]
    print(f"two identical engines (fixed {selectors['twin'](1)}) measured {lo:.3f}-{hi:.3f} of each other over the batch "
          "sizes: the noise these ratios carry on this machine", file=out)
    print(f"adaptive schedule: {result['adaptive_schedule']}; total {result['seconds']}s on {machine()}", file=out)


def _planned_cost_table(make_engine, planned: dict | None, pool_prompts, batches: list[int], ks: list[int],
                        k_max: int, args, out, t_start: float):
    """The cost table the selector reads. With graphs (`planned`, `_engine_factory`'s): the eager table plans the
    capture, then the table is timed again through the replays, as the rollout worker does, and plans what
    engines come later."""
    cost, acceptance = _cost_table(make_engine, pool_prompts, batches, ks, k_max, args, out, t_start)
    if planned is not None:
        planned["cost"] = cost
        cost, acceptance = _cost_table(make_engine, pool_prompts, batches, ks, k_max, args, out, t_start)
        planned["cost"] = cost
    return cost, acceptance


def _cost_table(make_engine, pool_prompts, batches: list[int], ks: list[int], k_max: int, args, out, t_start: float):
    """The cost model measured on a warm engine, and the acceptance tracker warmed by the same steps."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.acceptance import AcceptanceTracker

    warm = make_engine(max(batches), 0)
    acceptance = AcceptanceTracker(k_max=k_max)  # warmed by the same real steps that time the cost table
    cost = cost_model.measure(warm, pool_prompts, buckets=cost_model.default_buckets(max(batches)), ks=ks,
                              steps=6, temperature=args.temperature, passes=2, on_step=acceptance.observe)
    print(f"cost model measured in {time.perf_counter() - t_start:.1f}s (ms per step):", file=out)
    widths = [max(8, len(k.label) + 1) for k in cost.ks]  # a tree's label is longer than a column of numbers
    print("  b \\ k " + "".join(f"{k:>{w}}" for k, w in zip(cost.ks, widths)), file=out)
    for b in cost.buckets:
        print(f"  {b:>5} " + "".join(f"{cost.table[(b, k)] * 1e3:{w}.2f}" for k, w in zip(cost.ks, widths)), file=out)
    return cost, acceptance


def _starts(make_engine, pool_prompts, max_seq: int, args, out) -> list[tuple[list[int], int]]:
    """The per-batch runs' requests: (tokens so far, tokens left), at their prompts or, with --start mid, at a
    random depth of a response the policy wrote."""
    starts = [(list(p), args.max_tokens) for p in pool_prompts[:256]]
    if args.start == "mid":
        t0 = time.perf_counter()
        starts = _mid_response(make_engine, pool_prompts[:256], args.max_tokens, max_seq, args.temperature, seed=7)
        print(f"per-batch runs start mid-response ({time.perf_counter() - t0:.1f}s to write 256 responses; mean depth "
              f"{statistics.mean(len(p) - len(q) for (p, _), q in zip(starts, pool_prompts)):.0f} tokens)", file=out)
    return starts


def _batch_row(make_engine, selectors: dict, adaptive, starts, b: int, ks: list, args, out,
               lockstep: bool, accept: dict | None = None) -> dict:
    """Every policy at batch b in each repeat (`_repeat_tps`); medians over repeats, the oracle's k among them (in
    sample, and held out: `held_out_oracle`)."""
    n_req = max(4 * b, b + 8)
    steps = max(args.steps, -(-args.rows // b))
    runs: dict[str, list[float]] = {name: [] for name in selectors}
    adaptive_mix: Counter = Counter()
    for rep in range(args.repeats):
        chosen = starts[(rep * n_req) % 256:][:n_req]
        chosen = (chosen * (n_req // max(len(chosen), 1) + 1))[:n_req]
        prompts = [p for p, _ in chosen]
        params = [SamplingParams(max_tokens=max(1, left), temperature=args.temperature, seed=1000 * rep + i)
                  for i, (_, left) in enumerate(chosen)]
        tps = repeat_tps(make_engine, selectors, b, prompts, params, args.warmup, steps, adaptive_mix, lockstep,
                          accept=accept)
        for name in selectors:
            runs[name].append(tps[name])
    med = {name: statistics.median(v) for name, v in runs.items()}
    names = [k.label for k in ks]
    oracle = max(names, key=lambda n: med[n])
    held_ks, held_tps = held_out_oracle(runs, names)
    chain_oracle = max((k.label for k in ks if not k.is_tree), key=lambda n: med[n])
    row = {
        "batch": b, "oracle_k": oracle, "oracle_tps": round(med[oracle], 1), "oracle_chain": chain_oracle,
        "oracle_held_out_ks": held_ks, "oracle_held_out_tps": round(statistics.median(held_tps), 1),
        "adaptive_vs_oracle": round(statistics.median(a / o for a, o in zip(runs["adaptive"], held_tps)), 4),
        # the same fixed k on a second engine, paired per repeat like adaptive ÷ oracle: the ratios' noise
        "twin_ratio": round(statistics.median(t / f for t, f in zip(runs["twin"], runs[selectors['twin'](b).label])),
                            4),
        "adaptive_vs_chain_only": round(statistics.median(a / c for a, c in zip(runs["adaptive"],
                                                                                 runs["adaptive_chain_only"])), 4),
        "repeats_tps": {name: [round(x, 1) for x in v] for name, v in runs.items()},
        "adaptive_tps": round(med["adaptive"], 1), "beg_tps": round(med["beg"], 1),
        "threshold_tps": round(med["threshold"], 1), "nospec_tps": round(med["none"], 1),
        "adaptive_chain_only_tps": round(med["adaptive_chain_only"], 1),
        "fixed_tps": {k.label: round(med[k.label], 1) for k in ks},
        "adaptive_k": adaptive.best(b).label,
        # what the selector expects of each candidate now, to hold against the measured fixed_tps
        "adaptive_predicted_tps": {k.label: round(v, 1) for k, v in adaptive.scores(b).items()},
        "adaptive_k_mix": dict(sorted(adaptive_mix.items())),  # the strategy of its timed steps
    }
    print(f"batch {b:>3}: " + "  ".join(f"{n}={v:.0f}" for n, v in med.items())
          + f"  (tok/s; oracle {oracle}, held out {held_ks}; adaptive ÷ oracle {row['adaptive_vs_oracle']:.3f} "
          f"held out, {med['adaptive'] / med[oracle]:.3f} in sample, ÷ chain-only {row['adaptive_vs_chain_only']:.3f}; "
          f"adaptive ran {row['adaptive_k_mix']}, now picks {row['adaptive_k']})", file=out)
    return row


def held_out_oracle(runs: dict[str, list[float]], names: list[str]) -> tuple[list[str], list[float]]:
    """Per repeat r: the fixed strategy (by policy name) whose median tok/s over the other repeats is the best, and
    its tok/s in repeat r (leave-one-out). Picking the best on the repeats it is scored on picks the luckiest of the
    near-tied strategies and reports its luck; picked on other repeats, the score is what knowing the best fixed
    strategy in advance delivers. One repeat leaves nothing to pick on: then the in-sample best."""
    n = len(runs[names[0]])
    if n < 2:
        k = max(names, key=lambda k: runs[k][0])
        return [k], [runs[k][0]]
    picks = [max(names, key=lambda k: statistics.median(v for i, v in enumerate(runs[k]) if i != r))
             for r in range(n)]
    return picks, [runs[k][r] for r, k in enumerate(picks)]


def _longtail(make_engine, selectors: dict, tok, max_seq: int, cfg, args, out) -> dict[str, float]:
    """One long-tail rollout to completion under each policy; speedup of each over no speculation."""
    lt_prompts = _prompts(tok, args.longtail_n, 12345, cfg.task)
    lt_params = [SamplingParams(max_tokens=min(args.max_tokens, max_seq - len(p)), temperature=args.longtail_temperature,
                                seed=i) for i, p in enumerate(lt_prompts)]
    names = ["nospec", "adaptive", "adaptive_chain_only", "beg", "threshold"]
    pols = {"nospec": selectors["none"], "adaptive": selectors["adaptive"], "adaptive_chain_only": selectors["adaptive_chain_only"],
            "beg": selectors["beg"], "threshold": selectors["threshold"]}
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for n in names:
            s, ntok = _rollout_s(make_engine, pols[n], lt_prompts, lt_params)
            times[n].append(s)
            tokens[n] = ntok
    med_t = {n: statistics.median(v) for n, v in times.items()}
    longtail = {n: round(med_t["nospec"] / med_t[n], 3) for n in names[1:]}
    print(f"long-tail rollout of {args.longtail_n} requests ({tokens['nospec']} tokens, T={args.longtail_temperature}, "
          f"{cfg.rollout.verify_rule} rule): "
          + "  ".join(f"{n}={med_t[n]:.2f}s" for n in names) + f"  speedup vs nospec {longtail}", file=out)
    return longtail
