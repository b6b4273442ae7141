"""Per-slot request state as preallocated tensors, kept compacted: running requests occupy slots 0..n-1.

A decode step reads plain slices (`[:n]`) of these tensors — no gather, no per-row Python. When a request
finishes, the last running slot is moved into its place (one copy per tensor, tens of KB), so the batch
stays contiguous while it shrinks through the long tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# int64 columns of SlotTable.ints
LEN, GEN, PROMPT_LEN, MAX_TOKENS, TOP_K, KEY, FWD, DRAFTED, ACCEPTED = range(9)
NUM_INT = 9
# the engine updates LEN|GEN and FWD|DRAFTED as column pairs
assert GEN == LEN + 1 and DRAFTED == FWD + 1
# float32 columns of SlotTable.floats
TEMP, TOP_P = range(2)
NUM_FLOAT = 2


@dataclass
class Batch:
    """The running rows 0..n-1 as a drafter sees them (views, no copies)."""

    n: int
    tokens: torch.Tensor  # [n, W] prompt + emitted tokens; positions >= length are stale
    lengths: torch.Tensor  # [n] tokens known (the last one is not yet in the target's KV cache)
    max_length: int  # host-side max of lengths
    temperature: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64
    top_p: torch.Tensor  # [n] float32
    key: torch.Tensor  # [n] int64 random key (from the request's seed)
    uniforms: torch.Tensor  # [n, 4 * token_width] float64: the rows' sampling.uniform_table
    any_sampled: bool
    any_greedy: bool
    any_truncated: bool
    any_scaled: bool = True  # some row samples at a temperature other than 1 (0 = greedy is not scaled)
    u_draft: torch.Tensor | None = None  # [n, k] this step's DRAFT-stream uniforms, set by the engine
    race: torch.Tensor | None = None  # [n, k+1, V] this step's RACE noise when the engine verifies coupled


class SlotTable:
    def __init__(self, max_slots: int, token_width: int, out_width: int, max_stop: int, device="cpu"):
        self.max_slots = max_slots
        self.ints = torch.zeros(max_slots, NUM_INT, dtype=torch.long, device=device)
        self.floats = torch.zeros(max_slots, NUM_FLOAT, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_slots, token_width, dtype=torch.long, device=device)
        # [slot, 2, position]: raw logprobs, sampling logprobs of emitted tokens
        self.logprobs = torch.zeros(max_slots, 2, out_width, dtype=torch.float32, device=device)
        self.stop_ids = torch.full((max_slots, max_stop), -1, dtype=torch.long, device=device)
        # every uniform a request can draw, by code (position << 2) | stream (sampling.uniform_table), so a
        # decode step gathers its random numbers instead of hashing them
        self.uniforms = torch.zeros(max_slots, 4 * token_width, dtype=torch.float64, device=device)
        self.n = 0
        # host mirrors (one entry per running slot) so batch-wide flags never need a device sync
        self.request_ids: list[int] = []
        self.prompts: list[list[int]] = []
        self.temps: list[float] = []
        self.truncated: list[bool] = []

    def col(self, c: int) -> torch.Tensor:
        return self.ints[: self.n, c]

    def compact(self, done: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drop the rows `done` and fill the holes they leave below the new count with the last running
        rows. Returns the (src, dst) slot index tensors so the KV caches can be moved the same way, or None
        when no row moved."""
        done_set = set(done)
        n_new = self.n - len(done_set)
        dst = sorted(i for i in done_set if i < n_new)
        src = [i for i in range(n_new, self.n) if i not in done_set]
        moved = None
        if dst:
            si = torch.tensor(src, device=self.ints.device)
            di = torch.tensor(dst, device=self.ints.device)
            moved = si, di
            for t in (self.ints, self.floats, self.tokens, self.logprobs, self.stop_ids, self.uniforms):
                t[di] = t[si]
            for lst in (self.request_ids, self.prompts, self.temps, self.truncated):
                for a, b in zip(src, dst):
                    lst[b] = lst[a]
        for lst in (self.request_ids, self.prompts, self.temps, self.truncated):
            del lst[n_new:]
        self.n = n_new
        return moved

    def batch(self, max_length: int) -> Batch:
        n = self.n
        return Batch(
            n=n,
            tokens=self.tokens[:n],
            lengths=self.ints[:n, LEN],
            max_length=max_length,
            temperature=self.floats[:n, TEMP],
            top_k=self.ints[:n, TOP_K],
            top_p=self.floats[:n, TOP_P],
            key=self.ints[:n, KEY],
            uniforms=self.uniforms[:n],
            any_sampled=any(t > 0 for t in self.temps),
            any_greedy=any(t == 0 for t in self.temps),
            any_truncated=any(self.truncated),
            any_scaled=any(t not in (0.0, 1.0) for t in self.temps),
        )
