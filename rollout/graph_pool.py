"""CUDA graph pool for the target's verify forward: one graph per (batch bucket, draft length k) in a plan.

Plan (`capture_plan`): for every batch bucket of the cost model, the strategies the adaptive selector can pick
there (`selector.candidate_ks`) — nothing else is ever asked for, so nothing else is captured. Entries are
admitted smallest bucket first (that is where launch overhead dominates and a graph pays most) while the
estimated pool stays under the memory budget; the rest run eager. Capture order is largest first, as in
nano-vllm: every graph allocates from ONE shared memory pool, and graphs never run concurrently, so each
later (smaller) capture reuses the workspace the first (largest) one left behind; what stays resident per
graph is only its static outputs. Estimated pool = max workspace + sum of static buffers, against the sum
of separately captured graphs.

Lookup: a decode step of n running rows with k drafts replays the smallest captured bucket >= n with that k;
rows n..bucket-1 are padding (token 0 at position 0..k of a free slot: the KV they write sits in slots no
running request owns, and admission's prefill overwrites it before anything attends to it). Inside a graph
attention spans the whole cache (a fixed shape); the causal mask makes the extra keys exact zeros.

The plan needs a cost table before any graph exists, so the first one is timed eagerly; the rollout worker then
times it again through the replays (once per engine shape) and its selector reads that one.

On CPU the pool is disabled (no capture), but the plan, budget and lookup are the same code; `emulate=True`
runs the padded static-buffer path eagerly so that tests check everything except the replay itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.selector import candidate_ks


@dataclass(frozen=True)
class GraphShape:
    """The runner's dimensions that size a verify graph's memory."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    n_aux: int  # aux hidden states returned for an EAGLE-3 drafter (0: none)
    attn_len: int  # keys attended inside a graph (the runner's cache length)
    itemsize: int  # bytes per element of the model dtype

    @classmethod
    def of(cls, runner, want_aux: bool = False) -> GraphShape:
        return cls(
            hidden_size=runner.hidden_size, num_heads=runner.num_heads, num_kv_heads=runner.num_kv_heads,
            head_dim=runner.head_dim, intermediate_size=runner.layers[0].gate_up_w.shape[0] // 2,
            vocab_size=runner.vocab_size, num_layers=runner.num_layers,
            n_aux=len(runner.aux_layer_ids or ()) if want_aux else 0, attn_len=runner.cache_len,
            itemsize=torch.empty((), dtype=runner.dtype).element_size(),
        )

    def static_bytes(self, bucket: int, k: int) -> int:
        """Static inputs (ids, start) and outputs (float32 logits, aux states) that stay resident."""
        t = bucket * (k + 1)
        return bucket * (k + 1) * 8 + bucket * 8 + t * self.vocab_size * 4 + t * self.n_aux * self.hidden_size * self.itemsize

    def workspace_bytes(self, bucket: int, k: int) -> int:
        """Peak transient memory of one forward (one layer's intermediates live at a time, plus the logits
        in model dtype before the float32 cast); an estimate, checked against the real pool on a GPU."""
        t, e = bucket * (k + 1), self.itemsize
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_token = (3 * self.hidden_size + (q + 2 * kv) + 3 * q + 3 * self.intermediate_size) * e
        # scores, the boolean mask, and the additive mask tiled over a group's folded query heads
        groups = self.num_heads // self.num_kv_heads
        scores = bucket * (k + 1) * self.attn_len * ((self.num_heads + groups) * e + 1)
        rope = 4 * t * self.head_dim * e
        aux = t * self.n_aux * self.hidden_size * e
        return t * per_token + scores + rope + aux + t * self.vocab_size * e


@dataclass(frozen=True)
class PlanEntry:
    bucket: int
    k: int
    workspace_bytes: int
    static_bytes: int


@dataclass
class CapturePlan:
    entries: list[PlanEntry]  # capture order: largest first
    skipped: list[tuple[int, int]]  # (bucket, k) the selector can pick but the budget left out: run eager
    budget_bytes: int
    _by_k: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        by_k: dict[int, list[int]] = {}
        for e in self.entries:
            by_k.setdefault(e.k, []).append(e.bucket)
        self._by_k = {k: sorted(bs) for k, bs in by_k.items()}

    @property
    def pool_bytes(self) -> int:
        """Estimated shared pool: the largest workspace once, plus every graph's resident static buffers."""
        return shared_bytes(self.entries)

    @property
    def separate_bytes(self) -> int:
        """Estimated memory of the same graphs captured each into its own pool."""
        return sum(e.workspace_bytes + e.static_bytes for e in self.entries)

    def lookup(self, n: int, k: int) -> int | None:
        """The bucket that serves n running rows at draft length k (n <= bucket; rows n.. are padding),
        or None: that shape runs eager."""
        bs = self._by_k.get(k)
        if not bs or n < 1:
            return None
        i = bisect.bisect_left(bs, n)
        return bs[i] if i < len(bs) else None

    def pairs(self) -> set[tuple[int, int]]:
        return {(e.bucket, e.k) for e in self.entries}


def shared_bytes(entries: Sequence[PlanEntry]) -> int:
    if not entries:
        return 0
    return max(e.workspace_bytes for e in entries) + sum(e.static_bytes for e in entries)


def capture_plan(
    cost: CostModel,
    shape: GraphShape,
    budget_bytes: int,
    ks: Sequence[int] | None = None,
    margin: float = 0.1,
    max_batch: int | None = None,
) -> CapturePlan:
    """(bucket, k) pairs to capture: the selector's candidates per bucket, smallest bucket first, under the budget."""
    if budget_bytes < 0:
        raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
    wanted = []
    for b in cost.buckets:
        if max_batch is not None and b > max_batch:
            continue
        for k in candidate_ks(cost, b, ks, margin):
            wanted.append(PlanEntry(b, k, shape.workspace_bytes(b, k), shape.static_bytes(b, k)))
    chosen: list[PlanEntry] = []
    skipped: list[tuple[int, int]] = []
    for e in wanted:  # smallest bucket first: the biggest replay gain per byte
        if shared_bytes(chosen + [e]) <= budget_bytes:
            chosen.append(e)
        else:
            skipped.append((e.bucket, e.k))
    chosen.sort(key=lambda e: (e.bucket * (e.k + 1), e.bucket, e.k), reverse=True)
    return CapturePlan(chosen, skipped, budget_bytes)


def pool_reserved_bytes(handle) -> int:
    """Bytes of the CUDA segments the caching allocator holds for one graph pool. A change in
    `memory_reserved()` across a capture is not the pool: it also counts the eager warm-ups' default-pool blocks
    and whatever other code frees or caches meanwhile; segments carry the id of the pool that owns them."""
    want = tuple(handle)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == want)


@dataclass
class _Graph:
    ids: torch.Tensor  # [bucket, k+1] static input
    start: torch.Tensor  # [bucket]
    logits: torch.Tensor | None = None  # static outputs
    aux: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph when captured


class GraphPool:
    """Replays captured verify graphs through the engine's `verify_forward` seam; eager outside the plan."""

    def __init__(self, runner, plan: CapturePlan, want_aux: bool = False, emulate: bool = False):
        self.runner, self.plan, self.want_aux = runner, plan, want_aux
        self.enabled = runner.device.type == "cuda"
        self.emulate = emulate and not self.enabled
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool_handle = None
        self.pool_bytes_measured = 0
        self.replays = 0
        self.eager = 0
        self._max_pos = runner.cache_len - 1

    # -- capture -----------------------------------------------------------------------------------------------
    def _buffers(self, bucket: int, k: int) -> _Graph:
        dev = self.runner.device
        return _Graph(
            ids=torch.zeros(bucket, k + 1, dtype=torch.long, device=dev),
            start=torch.zeros(bucket, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def capture(self) -> GraphPool:
        """Capture every plan entry, largest first, into one shared pool (CUDA); static buffers only (CPU emulate)."""
        if not (self.enabled or self.emulate):
            return self
        if not self.enabled:
            for e in self.plan.entries:
                self.graphs[(e.bucket, e.k)] = self._buffers(e.bucket, e.k)
            return self
        self.pool_handle = torch.cuda.graph_pool_handle()
        for e in self.plan.entries:  # largest first
            self.graphs[(e.bucket, e.k)] = self._capture_one(e.bucket, e.k, self.pool_handle)
        torch.cuda.synchronize()
        self.pool_bytes_measured = pool_reserved_bytes(self.pool_handle)
        return self

    def _capture_one(self, bucket: int, k: int, pool) -> _Graph:
        g = self._buffers(bucket, k)
        fwd = self.runner.forward
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                fwd(g.ids, g.start, 0, max_pos=self._max_pos, want_aux=self.want_aux)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            g.logits, g.aux = fwd(g.ids, g.start, 0, max_pos=self._max_pos, want_aux=self.want_aux)
        g.graph = graph
        return g

    def measure_separate_bytes(self) -> int:
        """Reserved memory of the plan's graphs captured each into its own pool (for the benchmark's
        comparison with the shared pool); the graphs are freed afterwards."""
        if not self.enabled:
            return 0
        total, alive = 0, []
        with torch.inference_mode():
            for e in self.plan.entries:
                handle = torch.cuda.graph_pool_handle()
                alive.append(self._capture_one(e.bucket, e.k, handle))
                torch.cuda.synchronize()
                total += pool_reserved_bytes(handle)
        del alive  # all kept alive while measuring: no capture reuses another's freed blocks
        torch.cuda.empty_cache()
        return total

    # -- the seam ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, slot0: int = 0, max_pos: int | None = None,
                want_aux: bool = False, tree=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ModelRunner.forward; replays the plan's graph when this shape is captured."""
        n, width = input_ids.shape
        if tree is not None:
            self.eager += 1
            return self.runner.forward(input_ids, start, slot0, max_pos=max_pos, want_aux=want_aux, tree=tree)
        bucket = self.plan.lookup(n, width - 1) if (slot0 == 0 and want_aux == self.want_aux) else None
        g = self.graphs.get((bucket, width - 1)) if bucket is not None else None
        if g is None or (max_pos is not None and max_pos > self._max_pos):
            self.eager += 1
            return self.runner.forward(input_ids, start, slot0, max_pos=max_pos, want_aux=want_aux)
        g.ids[:n].copy_(input_ids)
        g.start[:n].copy_(start)
        if bucket > n:
            g.ids[n:].zero_()
            g.start[n:].zero_()
        if g.graph is not None:
            g.graph.replay()
        else:  # CPU emulation: the same padded static-shape forward, run eagerly
            g.logits, g.aux = self.runner.forward(g.ids, g.start, 0, max_pos=self._max_pos, want_aux=self.want_aux)
        self.replays += 1
        return g.logits[:n], (g.aux[:n] if g.aux is not None else None)

    def attach(self, engine) -> GraphPool:
        """Install the pool on the engine's verify seam (`Engine.configure(verify_forward=...)`)."""
        if engine.runner is not self.runner:
            raise ValueError("graph pool was built for another engine's runner")
        engine.configure(verify_forward=self.forward)
        return self


def build_pool(engine, cost: CostModel, budget_bytes: int, ks: Sequence[int] | None = None, emulate: bool = False,
               margin: float = 0.1) -> GraphPool:
    """Plan from the cost model, capture (CUDA) or allocate static buffers (CPU emulate), attach to the engine."""
    want_aux = engine.drafter is not None and engine.drafter.needs_aux
    shape = GraphShape.of(engine.runner, want_aux)
    plan = capture_plan(cost, shape, budget_bytes, ks, margin, max_batch=engine.max_batch)
    pool = GraphPool(engine.runner, plan, want_aux=want_aux, emulate=emulate)
    if pool.enabled or pool.emulate:
        pool.capture().attach(engine)
    return pool
