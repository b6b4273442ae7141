"""Rollout engine throughput: HF generate vs the native engine, with and without speculative decoding.

On the task's prompts with the main job's setting by default (the `deep` policy and the demo's bootstrap EAGLE-3
drafter for it, trained and cached on first use): tokens/s of HF `generate` (static batches,
left-padded), HF assisted generation (batch 1 only: HF refuses more), the engine without SD, and the
engine with SD for each k and each available drafter (n-gram; draft model = the `micro` policy trained
on the same task; EAGLE-3: the demo's bootstrap drafter, or --eagle3 DIR). Acceptance length = tokens
emitted per target forward. Every configuration is measured in this process, interleaved per repeat
(noisy shared machines drift), and reported as the median of the repeats. Engine rows also carry the wall
time per decode step, set beside the device's memory floor for one step (`memory_floor`: weight bytes over
the measured copy bandwidth; on a GPU, the HBM floor).

It also prints what one EAGLE-3 drafter step costs beside one target forward (`drafter_cost`), at batch 1
and at every batch size measured: the ratio decides whether speculation can pay at all (a drafter step
at half a target forward, as on the 4-layer `tiny`, leaves little to win; on a GPU an EAGLE-3 layer beside
a 28-64-layer target costs a few percent). JSON: `drafter_cost_ratio` (batch 1), `drafter_cost_ratios`
({batch: ratio}) and `drafter_cost` (the per-batch times in ms and which drafter was timed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tailspec.benchmarks.machine import machine
from tailspec.rollout.sequence import SamplingParams

from tailspec.commands.args import config_from_args
from tailspec.tasks.runsum import sample_problems

if TYPE_CHECKING:
    import torch


def _bootstrap_eagle3(args) -> str:
    """The demo's first drafter for --policy (its trainer settings and budget; cached), as `bench adaptive` uses."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.demo.bootstrap import bootstrap_drafter
    from tailspec.demo.options import DemoOptions, apply_demo_trainer
    from tailspec.tasks.policy import resolve_policy

    cfg = config_from_args(args)
    demo_cfg = cfg.model_copy(deep=True)
    apply_demo_trainer(demo_cfg.trainer, DemoOptions.validation_samples)
    return str(bootstrap_drafter(resolve_policy(args.policy, cfg.task, cache_dir=cfg.cache_dir), demo_cfg))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="deep", help="target policy preset or a policy directory (default deep, the "
                   "main job's)")
    p.add_argument("--draft-policy", default="micro", help="draft-model preset or directory ('' = none)")
    p.add_argument("--eagle3", default=None,
                   help="EAGLE-3 drafter checkpoint directory (default: the demo's bootstrap drafter for --policy, when "
                        "eagle3 is among --drafters; '' for none: the drafter cost then times a fresh head)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--drafters", default="ngram,draft_model,eagle3")
    p.add_argument("--prompts-per-batch", type=int, default=2, help="prompts per run = this x batch (min 4)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--verify-rule", choices=["residual", "coupled"], default="coupled",
                   help="the engine's speculative sampling rule (rollout.verify_rule; default coupled, the main job's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-assisted", action="store_true", help="skip HF assisted generation")
    p.add_argument("--cost-repeats", type=int, default=3,
                   help="interleaved rounds of the drafter-cost timing (0 = skip it)")
    p.add_argument("--hbm-floor", metavar="BATCHES", default=None,
                   help="only the physical-limit figure: the no-SD decode step at these batch sizes (e.g. 1,8,64), "
                        "eager and through the graph pool (CUDA), over the memory floor (`step_over_hbm_floor`)")


def _load(spec: str, dtype: torch.dtype, device: str):
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.tasks.policy import PRESETS, get_policy, load_policy

    path = get_policy(spec, progress=False) if spec in PRESETS else Path(spec)
    model, tok = load_policy(path, dtype=dtype)
    return model.to(device), tok


def _hf_generate(model, prompts, params, batch: int, pad_id: int, eos_id: int, assistant=None) -> tuple[int, float]:
    """Static batches of `batch` prompts (left-padded), each run until its longest row ends."""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch

    dev = next(model.parameters()).device
    tokens = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        kw = dict(assistant_model=assistant) if assistant is not None else {}
        sampled = params.temperature > 0
        out = model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=params.max_tokens,
            do_sample=sampled, temperature=params.temperature if sampled else None, top_k=None, top_p=None,
            pad_token_id=pad_id, eos_token_id=eos_id, **kw,
        )
        for r in range(len(chunk)):
            resp = out[r, width:].tolist()
            tokens += resp.index(eos_id) + 1 if eos_id in resp else len([t for t in resp if t != pad_id])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t0


def _engine_run(engine, prompts, params) -> tuple[int, float, float, int]:
    """(tokens, seconds, tokens per target forward, decode steps) of one run to completion."""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch

    dev = engine.device
    steps0 = engine.steps
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.stats.target_forwards for o in outs)
    return tokens, dt, tokens / max(forwards, 1), engine.steps - steps0


def memory_floor(model, device: str, nbytes: int | None = None, repeats: int = 10) -> dict:
    """The bandwidth floor of one decode step: the target's weight bytes over the measured copy bandwidth
    (bytes read + written per second by a large device-to-device copy). Every decode step reads every weight
    once, so no step can be faster than this on the device; the measured step time is set beside it."""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch

    dev = torch.device(device)
    nbytes = nbytes or ((512 << 20) if dev.type == "cuda" else (128 << 20))
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    bw = 2 * nbytes * repeats / (time.perf_counter() - t0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": round(bw / 1e9, 2),
            "floor_ms_per_step": round(weight_bytes / bw * 1e3, 4)}


def drafter_cost(model, eagle, batches, prompts, *, steps: int = 24, calls: int = 30, repeats: int = 3,
                 temperature: float = 1.0) -> dict:
    """Drafter step ÷ target forward at each batch size, timed on the real engine's code.

    For each batch b: an Engine with the EAGLE-3 drafter (`eagle`, an `Eagle3Module`: a trained one,
    or a fresh one of the same shape, since the cost does not depend on the weights) runs b requests for
    `steps` decode steps at k = 1 (rows mid-response, drafter and target caches filled). Then, on that
    batch, interleaved `repeats` times, `calls` calls each:
    - target forward: `engine.runner.forward` of the last token of every row (plain decoding's forward, the
      unit a draft token saves);
    - drafter step: one iteration of `rollout.drafters.Eagle3Proposer.propose`'s loop: the drafter layer
      (`step`), its head and the draw of the next draft (`_draw`: the row's sampling on the draft logits).
    Each is the median of its calls; the ratio is their quotient. Neither includes the engine's per-step
    bookkeeping (sampling and acceptance of the verify, the emitted tokens' scatters), which a step pays
    with or without a drafter.
    """
    return {b: _batch_cost(model, eagle, b, prompts, steps, calls, repeats, temperature) for b in batches}


def _batch_cost(model, eagle, b: int, prompts, steps: int, calls: int, repeats: int, temperature: float) -> dict:
    """`drafter_cost` at one batch size."""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch
    from tailspec.rollout.drafters import Eagle3Proposer, _draw
    from tailspec.rollout.engine import Engine
    from tailspec.rollout.sampling import step_uniforms_from

    rows = [prompts[i % len(prompts)] for i in range(b)]
    seq = max(len(p) for p in rows) + 2 * steps + 8  # k = 1: up to 2 tokens a step
    dr = Eagle3Proposer(eagle)
    eng = Engine(model, dr, selector=1, max_batch=b, max_seq_len=seq, k_max=2)
    for i, p in enumerate(rows):  # ignore_eos: every row stays in the batch for the whole warm-up
        eng.add_request(p, SamplingParams(max_tokens=2 * steps + 4, temperature=temperature, ignore_eos=True, seed=i))
    for _ in range(steps):
        eng.step()
    s = eng.slots
    if s.n != b:
        raise RuntimeError(f"drafter cost: {s.n} of {b} rows still running after the warm-up")
    L = s.batch(0).lengths
    max_len = int(L.max())
    batch = s.batch(max_len)
    if batch.any_sampled:  # the engine gathers a step's draft uniforms once, before proposing
        batch.u_draft = step_uniforms_from(batch.uniforms, L, 2)[0]
    last = batch.tokens.gather(1, (L - 1)[:, None])
    hidden = dr.next_hidden[: batch.n][:, None]
    pos = (L - 1)[:, None]  # propose's first loop step: position L + j - 2 at j = 1

    def target():
        eng.runner.forward(last, L - 1, max_pos=max_len - 1)

    def draft():
        h = dr.step(hidden, last, pos, max_pos=max_len - 1)[:, 0]
        _draw(dr._to_target(dr.head(h)), batch, 1)

    times: dict[str, list[float]] = {"target": [], "drafter": []}
    with torch.inference_mode():
        for f in (target, draft):
            for _ in range(3):
                f()
        for _ in range(repeats):
            for name, f in (("target", target), ("drafter", draft)):
                for _ in range(calls):
                    t0 = time.perf_counter()
                    f()
                    if eng.device.type == "cuda":
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - t0)
    eng.abort_all()
    t_ms = statistics.median(times["target"]) * 1e3
    d_ms = statistics.median(times["drafter"]) * 1e3
    return {"target_forward_ms": round(t_ms, 4), "drafter_step_ms": round(d_ms, 4), "ratio": round(d_ms / t_ms, 4)}


def _cost_section(model, eagle, tok, batches: list[int], args, log) -> dict:
    """The JSON's `drafter_cost_ratio` (batch 1), `drafter_cost_ratios` {batch: ratio} and `drafter_cost`
    (per-batch times, which drafter), printed as one line per batch. Without --eagle3 the drafter is a
    fresh EAGLE-3 head of the shape `tailspec train` builds for this target (the full vocabulary)."""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch

    empty = {"drafter_cost_ratio": None, "drafter_cost_ratios": {}, "drafter_cost": None}
    if args.cost_repeats <= 0:
        return empty
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module

    from tailspec.tasks.tokenizer import encode_prompt

    label = f"eagle3:{args.eagle3}"
    if eagle is None:
        try:
            cfg = Eagle3Config.from_target(model.config)
        except ValueError as e:  # e.g. a 1-layer target has no three aux states
            log(f"drafter cost: skipped ({e})")
            return empty
        with torch.random.fork_rng(devices=[]):  # a fixed init that leaves the bench's own random state alone
            torch.manual_seed(0)
            eagle = Eagle3Module(cfg, model.get_input_embeddings()).to(device=args.device, dtype=getattr(torch, args.dtype))
        label = "eagle3 (fresh head, same shape as a trained one)"
    prompts = [encode_prompt(tok, p.prompt) for p in sample_problems(64, seed=30_000)]
    per = drafter_cost(model, eagle.eval(), batches, prompts, repeats=args.cost_repeats, temperature=args.temperature)
    layers = int(model.config.num_hidden_layers)
    for b, r in per.items():
        log(f"drafter cost b={b:<3} EAGLE-3 step {r['drafter_step_ms']:.3f} ms / target forward ({layers} layers) "
            f"{r['target_forward_ms']:.3f} ms = {r['ratio']:.3f} (1/{1 / r['ratio']:.1f})")
    return {
        "drafter_cost_ratio": per[1]["ratio"] if 1 in per else None,
        "drafter_cost_ratios": {str(b): r["ratio"] for b, r in per.items()},
        "drafter_cost": {"drafter": label, "target_layers": layers,
                         "per_batch": [{"batch": b, **r} for b, r in per.items()]},
    }


def _drafters(draft_model, eagle):
    """make_drafter(name): a fresh proposer of that kind, or None where its model is missing."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer, NgramProposer

    def make_drafter(name):
        if name == "ngram":
            return NgramProposer()
        if name == "draft_model" and draft_model is not None:
            return DraftModelProposer(draft_model)
        if name == "eagle3" and eagle is not None:
            return Eagle3Proposer(eagle)
        return None

    return make_drafter


def _batch_rows(model, tok, draft_model, make_drafter, drafter_names, ks, b: int, args, floor, log) -> list[dict]:
    """One row per configuration at batch b: HF generate (and assisted at batch 1), the engine without SD, the
    engine with SD per drafter and k; the median of `args.repeats` interleaved runs each."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout.engine import Engine

    from tailspec.tasks.tokenizer import encode_prompt

    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    n = max(4, args.prompts_per_batch * b)
    prompts = [encode_prompt(tok, p.prompt) for p in sample_problems(n, seed=20_000 + b)]
    seq = max(len(p) for p in prompts) + args.max_tokens
    configs: list[tuple[str, str | None, int | None, object]] = [("hf_generate", None, None, None)]
    if b == 1 and draft_model is not None and not args.no_assisted:
        configs.append(("hf_assisted", "draft_model", None, None))
    configs.append(("engine", None, 0, Engine(model, None, max_batch=b, max_seq_len=seq, k_max=0)))
    for name in drafter_names:
        for k in ks:
            eng = Engine(model, make_drafter(name), selector=k, max_batch=b, max_seq_len=seq, k_max=k,
                         verify_rule=args.verify_rule)
            configs.append(("engine", name, k, eng))
    # warm-up: one short run per engine (allocations, first-call overheads)
    for _, _, _, eng in configs:
        if eng is not None:
            eng.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=args.temperature))
    samples: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(configs))}
    for _ in range(args.repeats):
        for i, (method, _, _, eng) in enumerate(configs):
            step_s = float("nan")  # per decode step: engine rows only
            if method == "hf_generate":
                tokens, dt = _hf_generate(model, prompts, params, b, pad_id, eos_id)
                acc = 1.0
            elif method == "hf_assisted":
                tokens, dt = _hf_generate(model, prompts, params, 1, pad_id, eos_id, assistant=draft_model)
                acc = float("nan")
            else:
                tokens, dt, acc, steps = _engine_run(eng, prompts, params)
                step_s = dt / max(steps, 1)
            samples[i].append((tokens / dt, acc, step_s))
    rows = []
    for i, (method, name, k, _) in enumerate(configs):
        tps = statistics.median(s[0] for s in samples[i])
        acc = statistics.median(s[1] for s in samples[i])
        step = statistics.median(s[2] for s in samples[i])
        row = {"batch": b, "method": method, "drafter": name, "k": k, "tokens_per_s": round(tps, 1),
               "acceptance_length": None if acc != acc else round(acc, 3)}
        if method == "engine":  # wall time per decode step (admissions' prefill included)
            row["step_ms"] = round(step * 1e3, 3)
        rows.append(row)
        log(f"  b={b:<3} {method:<12} {name!s:<12} k={k!s:<4} {tps:9.1f} tok/s  accept_len={row['acceptance_length']}"
            + (f"  step {row['step_ms']:.3f} ms (floor {floor['floor_ms_per_step']:.3f} ms)" if "step_ms" in row else ""))
    return rows


def floor_section(model, tok, batches: list[int], floor: dict, args, log) -> dict:
    """The no-SD decode step at each batch size, timed by the rollout's own warm-up (`cost_model.measure`, median
    of its timed steps, prefill not timed), eagerly and, on CUDA, replayed through a graph pool captured for it;
    each over the memory floor of one step (weights ÷ copy bandwidth). Where the ratio is near 1 the step is
    memory-bound, as an RL policy's decode is; far above it, launch- or host-bound."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.rollout import cost_model
    from tailspec.rollout.engine import Engine
    from tailspec.rollout.graph_pool import build_pool
    from tailspec.tasks.tokenizer import encode_prompt

    prompts = [encode_prompt(tok, p.prompt) for p in sample_problems(max(batches) * 2, seed=30_000)]
    seq = max(len(p) for p in prompts) + args.max_tokens
    out: dict[str, dict] = {}
    for b in batches:
        eng = Engine(model, None, max_batch=b, max_seq_len=seq, k_max=0)
        table = cost_model.measure(eng, prompts, buckets=[b], ks=[0], max_tokens=args.max_tokens,
                                   temperature=args.temperature)
        eager_ms = table.t(b, 0) * 1e3
        graphs_ms, why = None, "no graph pool off CUDA"
        if eng.device.type == "cuda":
            pool = build_pool(eng, table, 1 << 30, ks=[0])
            if pool.enabled:
                graphs_ms = cost_model.measure(eng, prompts, buckets=[b], ks=[0], max_tokens=args.max_tokens,
                                               temperature=args.temperature).t(b, 0) * 1e3
                why = None
            else:
                why = "the graph pool captured nothing"
        f = floor["floor_ms_per_step"]
        row = {"step_ms_eager": round(eager_ms, 4), "step_ms_graphs": None if graphs_ms is None else round(graphs_ms, 4),
               "eager": round(eager_ms / f, 2), "graphs": None if graphs_ms is None else round(graphs_ms / f, 2)}
        if why:
            row["graphs_missing"] = why
        out[str(b)] = row
        log(f"  b={b:<3} no SD step {eager_ms:.3f} ms eager ({row['eager']}x the floor)"
            + (f", {graphs_ms:.3f} ms replayed ({row['graphs']}x)" if graphs_ms is not None else f"; {why}"))
    return out


def _summary(rows: list[dict], batches: list[int]) -> dict:
    def tps(b, method, spec=None):
        sel = [r for r in rows if r["batch"] == b and r["method"] == method
               and (spec is None or ((r["k"] or 0) > 0) == spec)]
        return max((r["tokens_per_s"] for r in sel), default=None)

    ratios = [tps(b, "engine", False) / tps(b, "hf_generate") for b in batches]

    def spec_ratio(b):
        if b not in batches or tps(b, "engine", True) is None:
            return None
        return round(tps(b, "engine", True) / tps(b, "hf_generate"), 3)

    summary = {
        "nospec_vs_hf_min_ratio": round(min(ratios), 3),
        "best_spec_vs_hf_batch1_ratio": spec_ratio(1),
        "best_spec_vs_hf_batch16_ratio": spec_ratio(16),
    }
    for b in batches:  # where SD stops paying: best SD vs the engine without SD, per batch size
        nos, sd = tps(b, "engine", False), tps(b, "engine", True)
        if sd is not None:
            summary[f"best_spec_vs_nospec_batch{b}"] = round(sd / nos, 3)
    return summary


def run(args: argparse.Namespace) -> dict:
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tok = _load(args.policy, dtype, args.device)
    if args.hbm_floor:  # the physical-limit figure alone: no drafter, no HF comparison
        log = lambda *a: print(*a, file=sys.stderr, flush=True)
        floor = memory_floor(model, args.device)
        log(f"bench engine --hbm-floor: policy={args.policy} {args.dtype} on {machine()}; memory floor "
            f"{floor['weight_bytes'] / 1e6:.1f} MB at {floor['copy_bandwidth_gb_s']} GB/s = "
            f"{floor['floor_ms_per_step']:.4f} ms a step")
        fb = [int(b) for b in args.hbm_floor.split(",") if b]
        return {"device": machine(), "policy": args.policy, "dtype": args.dtype, "memory_floor": floor,
                "step_over_hbm_floor": floor_section(model, tok, fb, floor, args, log)}
    draft_model = _load(args.draft_policy, dtype, args.device)[0] if args.draft_policy else None
    eagle = None
    if args.eagle3 is None and "eagle3" in args.drafters.split(","):
        args.eagle3 = _bootstrap_eagle3(args)
    if args.eagle3:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.drafter_trainer.model import Eagle3Module

        eagle = Eagle3Module.load(args.eagle3, target_embedding=model.get_input_embeddings(), map_location=args.device)
        eagle = eagle.to(dtype)
    batches = [int(b) for b in args.batches.split(",") if b]
    ks = [int(k) for k in args.ks.split(",") if k]
    make_drafter = _drafters(draft_model, eagle)
    drafter_names = [d for d in args.drafters.split(",") if d and make_drafter(d) is not None]
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    log(f"bench engine: policy={args.policy} drafters={drafter_names} batches={batches} ks={ks} "
        f"T={args.temperature} device={machine()}")
    floor = memory_floor(model, args.device)
    log(f"memory floor: {floor['weight_bytes'] / 1e6:.1f} MB of weights at {floor['copy_bandwidth_gb_s']} GB/s "
        f"copy bandwidth = {floor['floor_ms_per_step']:.3f} ms per decode step")
    cost = _cost_section(model, eagle, tok, sorted({1, *batches}), args, log)
    rows = []
    for b in batches:
        rows += _batch_rows(model, tok, draft_model, make_drafter, drafter_names, ks, b, args, floor, log)
    summary = _summary(rows, batches)
    log(f"summary: {summary}")
    return {"device": machine(), "policy": args.policy, "temperature": args.temperature, "rows": rows, "summary": summary,
            "memory_floor": floor, **cost}
