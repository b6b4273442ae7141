"""CUDA graph pool for a decode step's forwards: the target's verify forward (chains and token trees) and the
EAGLE-3 drafter's steps, captured per batch bucket into one shared, budgeted memory pool.

Graphs. A decode step of strategy s at n running rows runs, at the bucket serving n:
- the verify forward over s.width = nodes + 1 tokens per row. A tree's graph has two more static inputs, the
  nodes' depths [bucket, width] and ancestor mask [bucket, width, width] (model_runner.tree_allowed), so the
  topology is data, not shape: one graph serves every static or dynamic tree of that width;
- the drafter's steps (`draft_steps`), through `Eagle3Proposer.step_forward`: a chain's drafting steps
  [bucket, 1]; a static tree's one per level over the nodes that get children, a dynamic tree's over its topk
  expanded nodes ([bucket, w], with the level's slots, tree start and ancestor rows over the step's nodes); and
  `observe`'s catch-up over the accepted path [bucket, depth + 1].
A graph is keyed by what shapes it (`GraphKey`: role, bucket, tokens per row, tree nodes), so strategies that
share a shape share its graph, and a call's graph follows from its own tensors: neither seam takes a strategy.
Inside a graph attention spans the whole cache (a fixed shape); the masks make the extra keys exact zeros.

Plan (rollout/graph_plan.py): the (bucket, strategy) pairs the adaptive selector can pick, each with its verify
and drafter graphs, admitted smallest bucket first under the memory budget; the rest run eager. Capture order
is largest workspace first, as in nano-vllm: every graph allocates from ONE shared memory pool and graphs never
run concurrently, so each later capture reuses the workspace the first one left behind; what stays resident
per graph is its static buffers.

Padding: rows n..bucket-1 of a replay are padding rows in free slots: token 0 in a chain at positions 0.. (a
tree verify: depths 0.., a lower-triangular ancestor mask; a drafter tree level: each node attends to its own
slot), so they stay finite and write only KV that no running request owns and that admission's prefill
overwrites before anything attends to it. Capture writes such rows into slots 0..bucket-1 of both caches, so a
pool is built on an idle engine (`build_pool` refuses one with running rows).

Pre-warm: capture runs each planned graph's forward eagerly before capturing it (two warm-ups on a side stream),
and runs every graph shape of the entries the budget left out once, eagerly: neither the rollout nor the
selector's exploration meets a cold shape (`GraphPool.warmed`).

The plan needs a cost table before any graph exists, so the first one is timed eagerly; the rollout worker then
times it again through the replays (once per engine shape) and its selector reads that one.

On CPU the pool is disabled (no capture), but the plan, budget and lookup are the same code; `emulate=True`
runs the padded static-buffer path (warm-ups included) eagerly, so tests check everything but the replay itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.graph_plan import (
    DRAFT,
    VERIFY,
    CapturePlan,
    DraftShape,
    GraphKey,
    GraphShape,
    GraphSpec,
    PlanEntry,
    capture_plan,
    draft_steps,
    shared_bytes,
)
from tailspec.rollout.strategy import Strategy

__all__ = ["DRAFT", "VERIFY", "CapturePlan", "DraftShape", "GraphKey", "GraphPool", "GraphShape", "GraphSpec",
           "PlanEntry", "build_pool", "capture_plan", "draft_steps", "pool_reserved_bytes", "shared_bytes"]


def pool_reserved_bytes(handle) -> int:
    """Bytes of the CUDA segments the caching allocator holds for one graph pool. A change in
    `memory_reserved()` across a capture is not the pool: it also counts the eager warm-ups' default-pool blocks
    and whatever other code frees or caches meanwhile; segments carry the id of the pool that owns them."""
    want = tuple(handle)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == want)


@dataclass
class _Graph:
    """One graph's static inputs [bucket, ...] with a padding row each, its forward over them, and its outputs."""

    key: GraphKey
    inputs: dict[str, torch.Tensor]
    pad: dict[str, torch.Tensor]  # [1, ...]: what a padding row holds
    fn: Callable[[], tuple]  # the eager forward over the static inputs: warm-ups, capture, CPU emulation
    out: tuple = ()
    graph: object | None = None  # torch.cuda.CUDAGraph when captured
    filled: int = 0  # rows 0..filled-1 may hold a call's inputs; rows from filled on hold padding

    def run(self, n: int, values: dict[str, torch.Tensor]) -> tuple:
        for name, v in values.items():
            self.inputs[name][:n].copy_(v)
        if self.filled > n:  # rows an earlier, larger call filled become padding again
            for name, buf in self.inputs.items():
                buf[n : self.filled].copy_(self.pad[name])
        self.filled = n
        if self.graph is not None:
            self.graph.replay()
        else:  # CPU emulation: the same padded static-shape forward, run eagerly
            self.out = self.fn()
        return self.out


def _static(pad: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
    return {name: p.expand(bucket, *p.shape[1:]).clone() for name, p in pad.items()}


class GraphPool:
    """Replays captured graphs through the engine's verify seam (`forward`) and the EAGLE-3 drafter's step seam
    (`draft_step`); a call whose shape has no graph runs eager."""

    def __init__(self, runner, plan: CapturePlan, want_aux: bool = False, emulate: bool = False, drafter=None):
        self.runner, self.plan, self.want_aux, self.drafter = runner, plan, want_aux, drafter
        self.enabled = runner.device.type == "cuda"
        self.emulate = emulate and not self.enabled
        self.graphs: dict[GraphKey, _Graph] = {}
        self.warmed: set[GraphKey] = set()  # every shape run at capture: captured, or warmed for its eager runs
        self.pool_handle = None
        self.pool_bytes_measured = 0
        self.replays = self.eager = 0  # verify forwards
        self.draft_replays = self.draft_eager = 0  # drafter steps through the seam
        self._max_pos = runner.cache_len - 1
        self._buckets: dict[tuple[str, int, int], list[int]] = {}
        self._found: dict[tuple[str, int, int, int], _Graph | None] = {}  # (role, n, width, nodes) -> its graph

    # -- capture -----------------------------------------------------------------------------------------------
    def _new(self, key: GraphKey) -> _Graph:
        b, w = key.bucket, key.width
        if key.role == VERIFY:
            dev = self.runner.device
            pad = {"ids": torch.zeros(1, w, dtype=torch.long, device=dev),
                   "start": torch.zeros(1, dtype=torch.long, device=dev)}
            if key.nodes:  # a padding row is a chain: depths 0.., each node's ancestors the nodes before it
                pad["depth"] = torch.arange(w, device=dev)[None]
                pad["anc"] = torch.ones(w, w, dtype=torch.bool, device=dev).tril()[None]
            x = _static(pad, b)
            tree = (x["depth"], x["anc"]) if key.nodes else None
            fwd, max_pos, aux = self.runner.forward, self._max_pos, self.want_aux
            return _Graph(key, x, pad, lambda: fwd(x["ids"], x["start"], 0, max_pos=max_pos, want_aux=aux, tree=tree))
        d = self.drafter
        dev = d.kv_cache.device
        pad = {"hidden": torch.zeros(1, w, d.H, dtype=d.dtype, device=dev),
               "ids": torch.zeros(1, w, dtype=torch.long, device=dev),
               "pos": torch.arange(w, device=dev)[None]}
        if key.nodes:  # a padding row's node t sits in slot t and attends to itself only
            pad.update(pos=torch.zeros(1, w, dtype=torch.long, device=dev), slots=torch.arange(w, device=dev)[None],
                       tree_start=torch.zeros(1, dtype=torch.long, device=dev),
                       anc=torch.eye(w, key.nodes, dtype=torch.bool, device=dev)[None])
        x = _static(pad, b)
        tree = {k: x[k] for k in ("slots", "tree_start", "anc") if k in x}
        max_pos = d.cache_len - 1
        return _Graph(key, x, pad, lambda: (d.step(x["hidden"], x["ids"], x["pos"], 0, max_pos, **tree),))

    def _build(self, key: GraphKey, pool) -> _Graph:
        """A graph's buffers, its eager warm-ups and (CUDA) its capture into `pool`."""
        g = self._new(key)
        self.warmed.add(key)
        if not self.enabled:  # CPU emulation: the warm-up alone
            g.fn()
            return g
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                g.fn()
        torch.cuda.current_stream().wait_stream(s)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=pool):
            g.out = g.fn()
        return g

    def _planned(self, specs: Iterable[GraphSpec]) -> list[GraphKey]:
        return [g.key for g in specs if g.key.role == VERIFY or self.drafter is not None]

    @torch.inference_mode()
    def capture(self) -> GraphPool:
        """Capture the plan's graphs, largest first, into one shared pool (CUDA), or set up their static buffers
        (CPU emulate); then warm every shape the budget left eager. On an idle engine: see the module docstring."""
        if not (self.enabled or self.emulate):
            return self
        self.pool_handle = torch.cuda.graph_pool_handle() if self.enabled else None
        for key in self._planned(self.plan.graphs):
            self.graphs[key] = self._build(key, self.pool_handle)
        for key in self._planned(self.plan.eager_graphs):  # pre-warm what runs eager: no cold shape later
            self._new(key).fn()
            self.warmed.add(key)
        by: dict[tuple[str, int, int], list[int]] = {}
        for key in self.graphs:
            by.setdefault((key.role, key.width, key.nodes), []).append(key.bucket)
        self._buckets = {shape: sorted(bs) for shape, bs in by.items()}
        self._found.clear()
        if self.enabled:
            torch.cuda.synchronize()
            self.pool_bytes_measured = pool_reserved_bytes(self.pool_handle)
        return self

    def measure_separate_bytes(self) -> int:
        """Reserved memory of the plan's graphs captured each into its own pool (for the benchmark's
        comparison with the shared pool); the graphs are freed afterwards."""
        if not self.enabled:
            return 0
        total, alive = 0, []
        with torch.inference_mode():
            for key in self._planned(self.plan.graphs):
                handle = torch.cuda.graph_pool_handle()
                alive.append(self._build(key, handle))
                torch.cuda.synchronize()
                total += pool_reserved_bytes(handle)
        del alive  # all kept alive while measuring: no capture reuses another's freed blocks
        torch.cuda.empty_cache()
        return total

    # -- the seams ---------------------------------------------------------------------------------------------
    def _graph(self, role: str, n: int, width: int, nodes: int) -> _Graph | None:
        """The graph of the smallest captured bucket >= n with this shape, or None (found once per call shape)."""
        at = (role, n, width, nodes)
        if at not in self._found:
            bs = self._buckets.get((role, width, nodes)) or []
            i = bisect.bisect_left(bs, n)
            self._found[at] = self.graphs[GraphKey(role, bs[i], width, nodes)] if n >= 1 and i < len(bs) else None
        return self._found[at]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, slot0: int = 0, max_pos: int | None = None,
                want_aux: bool = False, tree=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ModelRunner.forward's contract; replays the graph of this call's shape (chain, or a tree of this width)."""
        n, width = input_ids.shape
        g = None
        if slot0 == 0 and want_aux == self.want_aux and (max_pos is None or max_pos <= self._max_pos):
            g = self._graph(VERIFY, n, width, width if tree is not None else 0)
        if g is None:
            self.eager += 1
            return self.runner.forward(input_ids, start, slot0, max_pos=max_pos, want_aux=want_aux, tree=tree)
        values = {"ids": input_ids, "start": start}
        if tree is not None:
            values.update(depth=tree[0], anc=tree[1])
        logits, aux = g.run(n, values)
        self.replays += 1
        return logits[:n], (aux[:n] if aux is not None else None)

    @torch.inference_mode()
    def draft_step(self, hidden, input_ids, pos, slot0: int = 0, max_pos: int | None = None, slots=None,
                   tree_start=None, anc=None) -> torch.Tensor:
        """`Eagle3Proposer.step`'s contract; replays the graph of this call's shape (a chain step, or a tree
        level of this many nodes over this many tree nodes)."""
        n, width = input_ids.shape
        tree = anc is not None and slots is not None and tree_start is not None
        g = None
        if slot0 == 0 and (tree or (anc is None and slots is None)):
            g = self._graph(DRAFT, n, width, anc.shape[-1] if tree else 0)
        if g is None:
            self.draft_eager += 1
            return self.drafter.step(hidden, input_ids, pos, slot0, max_pos, slots, tree_start, anc)
        values = {"hidden": hidden, "ids": input_ids, "pos": pos}
        if tree:
            values.update(slots=slots, tree_start=tree_start, anc=anc)
        (out,) = g.run(n, values)
        self.draft_replays += 1
        return out[:n]

    def attach(self, engine) -> GraphPool:
        """Install the replays on the engine's verify seam (`Engine.configure(verify_forward=...)`) and, when the
        pool holds the drafter's steps, on its step seam (`Eagle3Proposer.configure(step_forward=...)`)."""
        if engine.runner is not self.runner:
            raise ValueError("graph pool was built for another engine's runner")
        if self.drafter is not None and engine.drafter is not self.drafter:
            raise ValueError("graph pool was built for another engine's drafter")
        engine.configure(verify_forward=self.forward)
        if self.drafter is not None:
            self.drafter.configure(step_forward=self.draft_step)
        return self


def _runs(engine, strategy: Strategy) -> bool:
    """Whether the engine runs this strategy as it is (chains past k_max are clipped to it: never asked for)."""
    try:
        engine.check_strategy(strategy)
    except ValueError:
        return False
    return strategy.depth <= engine.k_max


def build_pool(engine, cost: CostModel, budget_bytes: int, ks: Sequence[Strategy | int] | None = None,
               emulate: bool = False, margin: float = 0.1, drafter_graphs: bool = True) -> GraphPool:
    """Plan from the cost model (the strategies the engine runs; with an EAGLE-3 drafter and `drafter_graphs`, its
    steps too), capture (CUDA) or set up static buffers (CPU emulate), attach to the engine."""
    want_aux = engine.drafter is not None and engine.drafter.needs_aux
    drafter = engine.drafter if drafter_graphs and hasattr(engine.drafter, "step_forward") else None
    shape = GraphShape.of(engine.runner, want_aux, drafter)
    ks = [s for s in map(Strategy.of, cost.ks if ks is None else ks) if _runs(engine, s)]
    plan = capture_plan(cost, shape, budget_bytes, ks, margin, max_batch=engine.max_batch)
    pool = GraphPool(engine.runner, plan, want_aux=want_aux, emulate=emulate, drafter=drafter)
    if pool.enabled or pool.emulate:
        if engine.slots.n:
            raise ValueError(f"capture writes slots 0..bucket-1 of the caches; the engine runs {engine.slots.n} "
                             "rows: build the pool before admitting requests (or after abort_all)")
        pool.capture().attach(engine)
    return pool
