"""The CUDA graph pool's plan: which graphs to capture, under a memory budget, and what each one costs.

A decode step of strategy s at n running rows runs, at the batch bucket serving n, its verify forward over
s.width = nodes + 1 tokens per row (a tree's with its depths and ancestor mask as inputs, so the topology is
data, not shape) and, with an EAGLE-3 drafter, the drafter's steps (`draft_steps`). A graph is keyed by what
shapes it (`GraphKey`: role, bucket, tokens per row, tree nodes): strategies that share a shape share a graph.

`capture_plan`: for every batch bucket of the cost model, the strategies the adaptive selector can pick there
(`selector.candidate_ks`): nothing else is ever asked for, so nothing else is captured. A (bucket, strategy)
entry brings its verify graph and its drafter graphs; entries are admitted whole, smallest bucket first (that
is where launch overhead dominates and a graph pays most), while the estimated shared pool, drafter graphs
included, stays under the memory budget; the rest run eager. The estimates (`GraphShape`, `DraftShape`) count
one forward's transient workspace (a tree's mask included) and the static buffers that stay resident; in one
shared pool the largest workspace is reused by every graph: pool = max workspace + sum of static buffers over
the distinct graphs (`shared_bytes`). The graph pool (rollout/graph_pool.py) captures and replays them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.selector import candidate_ks
from tailspec.rollout.strategy import Strategy
from tailspec.rollout.tree import static_topology

VERIFY, DRAFT = "verify", "draft"  # GraphKey roles: the target's verify forward, one EAGLE-3 drafter step


def _attention_bytes(bucket: int, width: int, attn_len: int, heads: int, kv_heads: int, itemsize: int,
                     tree: bool) -> int:
    """Scores, the boolean mask and the additive mask tiled over a group's folded query heads; a tree's mask
    (`tree_allowed`) adds two [bucket, width, attn_len] booleans and its relative slots (int64, twice)."""
    cells = bucket * width * attn_len
    out = cells * ((heads + heads // kv_heads) * itemsize + 1)
    return out + (2 * cells + 18 * bucket * attn_len if tree else 0)


@dataclass(frozen=True)
class DraftShape:
    """The EAGLE-3 drafter's dimensions that size one of its step graphs."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    attn_len: int  # keys attended inside a graph (the drafter's cache length)
    itemsize: int

    @classmethod
    def of(cls, drafter) -> DraftShape:
        """From an `Eagle3Proposer` after its `setup` (the engine's construction)."""
        return cls(hidden_size=drafter.H, num_heads=drafter.Hq, num_kv_heads=drafter.Hk, head_dim=drafter.D,
                   intermediate_size=drafter.gate_up_w.shape[0] // 2, attn_len=drafter.cache_len,
                   itemsize=torch.empty((), dtype=drafter.dtype).element_size())

    def static_bytes(self, bucket: int, width: int, nodes: int = 0) -> int:
        """Hidden states in and out, ids, positions; a tree level's slots, tree start and ancestor rows."""
        t = bucket * width
        tree = t * 8 + bucket * 8 + t * nodes if nodes else 0
        return 2 * t * self.hidden_size * self.itemsize + 2 * t * 8 + tree

    def workspace_bytes(self, bucket: int, width: int, nodes: int = 0) -> int:
        """Peak transient memory of one step (an estimate, as GraphShape's)."""
        t, e, h = bucket * width, self.itemsize, self.hidden_size
        qkv, q = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, self.num_heads * self.head_dim
        per_token = (10 * h + 6 * qkv + 2 * q + 4 * self.intermediate_size) * e
        return t * per_token + _attention_bytes(bucket, width, self.attn_len, self.num_heads, self.num_kv_heads, e,
                                                nodes > 0)


@dataclass(frozen=True, order=True)
class GraphKey:
    """What shapes one graph: its role, batch bucket, tokens per row, and for a tree call the width of its
    ancestor mask (a verify: `width`; a drafter level: the step's nodes); 0 for a chain."""

    role: str
    bucket: int
    width: int
    nodes: int = 0


@dataclass(frozen=True)
class GraphSpec:
    key: GraphKey
    workspace_bytes: int
    static_bytes: int


def draft_steps(strategy: Strategy | int) -> list[tuple[int, int]]:
    """(tokens per row, tree nodes or 0) of the distinct drafter step shapes a decode step of `strategy` runs:
    a chain's k - 1 drafting steps; a static tree's levels below the root (the nodes that get children, over
    nodes + 1), a dynamic tree's (topk expanded nodes, over every node it drafts); then `observe` [depth + 1]."""
    s = Strategy.of(strategy)
    out = []
    if s.kind == "chain" and s.depth >= 2:
        out.append((1, 0))
    elif s.kind == "tree":
        out += [(int(lv.expand.shape[0]), s.nodes + 1) for lv in static_topology(s, torch.device("cpu")).levels[1:]]
    elif s.kind == "dynamic" and s.depth >= 2:
        out.append((s.topk, s.full_nodes + 1))
    out.append((s.depth + 1, 0))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class GraphShape:
    """The runner's dimensions that size a verify graph's memory (and the drafter's, when its steps are captured)."""

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
    draft: DraftShape | None = None  # the drafter's steps are planned too

    @classmethod
    def of(cls, runner, want_aux: bool = False, drafter=None) -> GraphShape:
        """`drafter`: an `Eagle3Proposer` whose steps the pool captures too (None: the verify forward only)."""
        return cls(
            hidden_size=runner.hidden_size, num_heads=runner.num_heads, num_kv_heads=runner.num_kv_heads,
            head_dim=runner.head_dim, intermediate_size=runner.layers[0].gate_up_w.shape[0] // 2,
            vocab_size=runner.vocab_size, num_layers=runner.num_layers,
            n_aux=len(runner.aux_layer_ids or ()) if want_aux else 0, attn_len=runner.cache_len,
            itemsize=torch.empty((), dtype=runner.dtype).element_size(),
            draft=DraftShape.of(drafter) if drafter is not None else None,
        )

    def static_bytes(self, bucket: int, strategy: Strategy | int) -> int:
        """The verify graph's static inputs (ids, start; a tree's depths and ancestor mask) and outputs (float32
        logits, aux states), which stay resident."""
        s = Strategy.of(strategy)
        return self._static(bucket, s.width, s.is_tree)

    def workspace_bytes(self, bucket: int, strategy: Strategy | int) -> int:
        """Peak transient memory of one verify forward (one layer's intermediates live at a time, plus the logits
        in model dtype before the float32 cast; a tree's mask); an estimate, checked against the pool on a GPU."""
        s = Strategy.of(strategy)
        return self._workspace(bucket, s.width, s.is_tree)

    def _static(self, bucket: int, width: int, tree: bool) -> int:
        t = bucket * width
        out = t * 8 + bucket * 8 + t * self.vocab_size * 4 + t * self.n_aux * self.hidden_size * self.itemsize
        return out + (t * 8 + t * width if tree else 0)

    def _workspace(self, bucket: int, width: int, tree: bool) -> int:
        t, e = bucket * width, self.itemsize
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_token = (3 * self.hidden_size + (q + 2 * kv) + 3 * q + 3 * self.intermediate_size) * e
        scores = _attention_bytes(bucket, width, self.attn_len, self.num_heads, self.num_kv_heads, e, tree)
        rope = 4 * t * self.head_dim * e
        aux = t * self.n_aux * self.hidden_size * e
        return t * per_token + scores + rope + aux + t * self.vocab_size * e

    def spec(self, key: GraphKey) -> GraphSpec:
        if key.role == VERIFY:
            tree = key.nodes > 0
            return GraphSpec(key, self._workspace(key.bucket, key.width, tree), self._static(key.bucket, key.width, tree))
        d = self.draft
        return GraphSpec(key, d.workspace_bytes(key.bucket, key.width, key.nodes),
                         d.static_bytes(key.bucket, key.width, key.nodes))

    def specs(self, bucket: int, strategy: Strategy | int) -> tuple[GraphSpec, ...]:
        """The graphs a decode step of `strategy` at this bucket runs: its verify forward, then the drafter's."""
        s = Strategy.of(strategy)
        keys = [GraphKey(VERIFY, bucket, s.width, s.width if s.is_tree else 0)]
        if self.draft is not None:
            keys += [GraphKey(DRAFT, bucket, w, m) for w, m in draft_steps(s)]
        return tuple(self.spec(k) for k in keys)


@dataclass(frozen=True)
class PlanEntry:
    bucket: int
    strategy: Strategy
    graphs: tuple[GraphSpec, ...]  # its verify forward's, then its drafter steps' (some shared with other entries)

    @property
    def workspace_bytes(self) -> int:
        return max(g.workspace_bytes for g in self.graphs)

    @property
    def static_bytes(self) -> int:
        return sum(g.static_bytes for g in self.graphs)


def shared_bytes(graphs: Iterable[GraphSpec | PlanEntry]) -> int:
    """Estimated shared pool of these graphs (an entry stands for its graphs; each distinct graph counts once):
    the largest workspace plus every graph's static buffers."""
    distinct = {}
    for g in graphs:
        for spec in (g.graphs if isinstance(g, PlanEntry) else (g,)):
            distinct[spec.key] = spec
    if not distinct:
        return 0
    return max(g.workspace_bytes for g in distinct.values()) + sum(g.static_bytes for g in distinct.values())


@dataclass
class CapturePlan:
    entries: list[PlanEntry]  # admitted (bucket, strategy) pairs, smallest bucket first
    skipped: list[tuple[int, Strategy]]  # (bucket, strategy) the selector can pick but the budget left out: eager
    budget_bytes: int
    eager_graphs: list[GraphSpec] = field(default_factory=list)  # the skipped entries' graphs no entry captures
    graphs: list[GraphSpec] = field(init=False)  # the entries' distinct graphs, capture order: largest first
    _by_strategy: dict[Strategy, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        distinct = {g.key: g for e in self.entries for g in e.graphs}
        self.graphs = sorted(distinct.values(), key=lambda g: (g.workspace_bytes, g.static_bytes, g.key), reverse=True)
        by: dict[Strategy, set[int]] = {}
        for e in self.entries:
            by.setdefault(e.strategy, set()).add(e.bucket)
        self._by_strategy = {s: sorted(bs) for s, bs in by.items()}

    @property
    def pool_bytes(self) -> int:
        """Estimated shared pool: the largest workspace once, plus every graph's resident static buffers."""
        return shared_bytes(self.graphs)

    @property
    def separate_bytes(self) -> int:
        """Estimated memory of the same graphs captured each into its own pool."""
        return sum(g.workspace_bytes + g.static_bytes for g in self.graphs)

    def lookup(self, n: int, strategy: Strategy | int) -> int | None:
        """The bucket that serves n running rows at this strategy (n <= bucket; rows n.. are padding), or None:
        that step runs eager."""
        bs = self._by_strategy.get(Strategy.of(strategy))
        if not bs or n < 1:
            return None
        i = bisect.bisect_left(bs, n)
        return bs[i] if i < len(bs) else None

    def pairs(self) -> set[tuple[int, Strategy]]:
        return {(e.bucket, e.strategy) for e in self.entries}

    def report(self) -> dict:
        """What the plan captures: graphs and estimated static bytes per role (verify forward, drafter steps),
        the estimated pool against separate pools, and the pairs left eager."""
        out = {"entries": len(self.entries), "budget_bytes": self.budget_bytes, "pool_bytes": self.pool_bytes,
               "separate_bytes": self.separate_bytes, "skipped": [(b, s.label) for b, s in self.skipped]}
        for role in (VERIFY, DRAFT):
            mine = [g for g in self.graphs if g.key.role == role]
            out[f"{role}_graphs"] = len(mine)
            out[f"{role}_static_bytes"] = sum(g.static_bytes for g in mine)
        return out


def capture_plan(
    cost: CostModel,
    shape: GraphShape,
    budget_bytes: int,
    ks: Sequence[Strategy | int] | None = None,
    margin: float = 0.1,
    max_batch: int | None = None,
) -> CapturePlan:
    """(bucket, strategy) pairs to capture with their graphs: the selector's candidates per bucket, smallest
    bucket first, under the budget (`shape.draft` set: the drafter's step graphs come with each pair)."""
    if budget_bytes < 0:
        raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
    wanted = []
    if ks is None or len(ks):
        for b in cost.buckets:
            if max_batch is None or b <= max_batch:
                wanted += [PlanEntry(b, s, shape.specs(b, s)) for s in map(Strategy.of, candidate_ks(cost, b, ks, margin))]
    chosen, left, have = [], [], {}
    for e in wanted:  # smallest bucket first: the biggest replay gain per byte
        more = {**have, **{g.key: g for g in e.graphs}}
        if shared_bytes(more.values()) <= budget_bytes:
            chosen.append(e)
            have = more
        else:
            left.append(e)
    eager = {g.key: g for e in left for g in e.graphs if g.key not in have}
    return CapturePlan(chosen, [(e.bucket, e.strategy) for e in left], budget_bytes, list(eager.values()))
