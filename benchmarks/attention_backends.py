"""Which SDPA kernels the rollout engine's forward should allow on CUDA, measured on the deep preset (bf16).

For each setting (the allowed kernels, `rollout.model_runner._SDPA_BACKENDS`, and whether grouped-query
attention is folded into the query length, `FOLD_GQA_DEVICES`): the attention op the profiler sees, the
runner's forward at decode shapes (rows x tokens) eager and replayed from a CUDA graph, the first forward at a
row count not met before (cuDNN builds a plan per shape), and the engine with its graph pool decoding 16
prompts at batch 1 and 16, cold then warm (no speculation: the target's forward alone).

Usage (tailspec installed, not the source tree): python -P benchmarks/attention_backends.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
from tailspec.core.config import TailspecConfig
from tailspec.rollout import model_runner as mr
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.engine import Engine
from tailspec.rollout.graph_pool import build_pool
from tailspec.rollout.model_runner import ModelRunner
from tailspec.rollout.sequence import SamplingParams
from torch.nn.attention import SDPBackend

from tailspec.tasks.policy import load_policy, resolve_policy

E, F_, M, C = SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION
# name: (allowed kernels, fold GQA on CUDA). no_cudnn_gqa was the fifth lease's engine (SDPA fell back to math),
# cudnn_gqa the fourth's; folded_no_cudnn is the engine's setting since.
SETS = {"folded_no_cudnn": ([E, F_, M], True), "no_cudnn_gqa": ([E, F_, M], False), "cudnn_gqa": ([C, E, F_, M], False),
        "folded_cudnn": ([C, E, F_, M], True)}
SHAPES = [(1, 1), (1, 4), (16, 1), (16, 4), (64, 1), (64, 4)]


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: str, n: int) -> float:
    for _ in range(3):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / n * 1e3


def runner_figures(model, dev: str) -> dict:
    runner = ModelRunner(model, max_slots=64, cache_len=1024)
    out: dict = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.forward(torch.ones(16, 1, dtype=torch.long, device=dev), torch.full((16,), 300, device=dev))
        sync(dev)
    out["attention_ops"] = sorted({e.key for e in prof.key_averages() if "attention" in e.key})
    for b, t in SHAPES:
        ids = torch.ones(b, t, dtype=torch.long, device=dev)
        start = torch.full((b,), 300, device=dev)
        row = {"eager_ms": round(timed(lambda ids=ids, start=start: runner.forward(ids, start, max_pos=310), dev, 20), 3)}
        if dev == "cuda":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    runner.forward(ids, start, max_pos=310)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                runner.forward(ids, start, max_pos=310)
            row["replay_ms"] = round(timed(g.replay, dev, 50), 3)
        out[f"b{b}_t{t}"] = row
    firsts = []
    for b in (13, 11, 7, 5):  # row counts not met above: the first forward at each
        ids = torch.ones(b, 1, dtype=torch.long, device=dev)
        sync(dev)
        t0 = time.perf_counter()
        runner.forward(ids, torch.full((b,), 200 + b, device=dev))
        sync(dev)
        firsts.append(round((time.perf_counter() - t0) * 1e3, 2))
    out["first_forward_new_rows_ms"] = firsts
    return out


def engine_figures(model, tok, dev: str) -> dict:
    prompts = [tok.encode(f"{i} + {i * 7 % 13} =") for i in range(16)]
    out = {}
    for batch in (1, 16):
        eng = Engine(model, None, selector=0, max_batch=batch, max_seq_len=1024)
        if dev == "cuda":
            bk = sorted({1, 2, 4, 8, 16} & set(range(1, batch + 1)))
            build_pool(eng, CostModel(bk, [0], {(b, 0): 0.001 * b for b in bk}), budget_bytes=1 << 33)
        sp = SamplingParams(max_tokens=128, temperature=1.0, seed=1, ignore_eos=True)
        runs = []
        for _ in range(2):  # cold, then warm
            sync(dev)
            t = time.perf_counter()
            outs = eng.generate(prompts, sp)
            sync(dev)
            runs.append(round(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t), 1))
        out[f"b{batch}_tok_s_cold_warm"] = runs
    return out


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TailspecConfig()
    model, tok = load_policy(resolve_policy("deep", cfg.task, cache_dir=cfg.cache_dir),
                             dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    model = model.to(dev)
    result = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__}
    for name, (backends, fold) in SETS.items():
        mr._SDPA_BACKENDS = backends
        mr.FOLD_GQA_DEVICES = ("cuda",) if fold else ()
        try:
            result[name] = runner_figures(model, dev) | engine_figures(model, tok, dev)
        except RuntimeError as e:  # a set with no kernel for these inputs
            result[name] = {"error": str(e).splitlines()[0][:200]}
        print(name, json.dumps(result[name]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
