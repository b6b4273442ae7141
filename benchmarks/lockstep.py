"""Policies side by side on one shared machine: each policy's engine on the same requests, taking turns a few steps
at a time (lockstep), so the machine's drift over a repeat reaches every policy alike. The adaptive bench's runner.
"""

from __future__ import annotations

import time
from collections import Counter


class Run:
    """One policy's engine with `batch` requests kept running: finished slots refilled between steps (their prefill
    untimed); tokens/s over the steps after `warmup`, and the k of each timed step in `mix`."""

    def __init__(self, eng, prompts, params, warmup: int, mix: Counter | None = None):
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.rollout.slots import GEN

        self.eng, self.warmup, self.mix, self.gen_col = eng, warmup, mix, GEN
        self.steps = self.done_tokens = self.emitted = 0
        self.row_steps = 0  # rows x timed steps: emitted / row_steps is tokens per row per verify
        self.elapsed = 0.0
        for p, sp in zip(prompts, params):
            eng.add_request(p, sp)

    def produced(self) -> int:
        n = self.eng.slots.n
        return self.done_tokens + (int(self.eng.slots.ints[:n, self.gen_col].sum()) if n else 0)

    def advance(self, n: int) -> None:
        eng = self.eng
        for _ in range(n):
            eng.admit()  # refills' prefill stays out of the timed decode step (a rollout prefills each prompt once)
            before, rows = self.produced(), eng.slots.n
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            self.done_tokens += sum(len(o.token_ids) for o in outs)
            if self.steps >= self.warmup:
                self.elapsed += dt
                self.emitted += self.produced() - before
                self.row_steps += rows  # 0 once every request is done: the step ran nothing
                if self.mix is not None and rows:
                    self.mix[eng.last.strategy.label] += 1
            self.steps += 1

    @property
    def tps(self) -> float:
        return self.emitted / self.elapsed if self.elapsed > 0 else 0.0


def repeat_tps(make_engine, policies: dict, batch: int, prompts, params, warmup: int, steps: int, mix: Counter,
                lockstep: bool, block: int = 8, accept: dict | None = None) -> dict[str, float]:
    """Every policy's tokens/s on the same requests. Lockstep (eager engines): an engine per policy, all alive,
    taking turns `block` steps at a time, the first turn of each round rotating, so the machine's drift over a
    repeat reaches every policy alike (whole runs one after another put each policy in its own stretch of a
    shared machine's load). Otherwise (a graph pool per batch size, one engine reconfigured): whole runs one after
    another."""
    total = warmup + steps
    if not lockstep:
        out = {}
        for name, pol in policies.items():
            run = Run(make_engine(batch, pol), prompts, params, warmup, mix if name == "adaptive" else None)
            run.advance(total)
            out[name] = run.tps
            _count_accept(accept, name, run)
        return out
    runs = [(name, Run(make_engine(batch, pol), prompts, params, warmup, mix if name == "adaptive" else None))
            for name, pol in policies.items()]
    turn = 0
    while any(r.steps < total for _, r in runs):
        for _, r in runs[turn % len(runs):] + runs[: turn % len(runs)]:
            r.advance(min(block, total - r.steps))
        turn += 1
    for name, r in runs:
        r.eng.abort_all()
        _count_accept(accept, name, r)
    return {name: r.tps for name, r in runs}


def _count_accept(accept: dict | None, name: str, run: Run) -> None:
    """Add a run's emitted tokens and row-steps to `accept[name]` (tokens per verify, over repeats)."""
    if accept is not None:
        e, n = accept.get(name, (0, 0))
        accept[name] = (e + run.emitted, n + run.row_steps)
