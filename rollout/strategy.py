"""A speculation strategy as a value, the engine's per-step selector, and the record of a decode step.

A `Strategy` names the shape of one decode step's speculation (the drafter is the engine's; the shape is what
changes per step):
- `none`: plain decoding, one target token per row;
- `chain k`: k drafted tokens in a line, verified by a forward of k + 1 tokens;
- `tree`: a static token tree, the same topology at every step: `depth` levels, at most `branching[d]` children
  per node at level d + 1, and the `nodes` best nodes of that full tree verified (best by a fixed prior over
  sibling ranks: `static_tree`), so its verify forward has `nodes + 1` tokens whatever the text;
- `dynamic`: an EAGLE-2 tree: `depth` levels, at every level the `topk` most probable frontier nodes (by
  cumulative draft probability) each drafting their `topk` most probable children, then the `nodes` most
  probable drafted nodes verified. Its topology changes per row and step; its shapes do not.

A chain is the tree whose every node has one child, so the engine verifies every strategy the same way; chains
keep their own narrow fast path.

Before every decode step the engine asks its selector `selector(batch_size, last) -> Strategy | int` (an int k is
`Strategy.chain(k)`, 0 plain decoding); `last` is the `StepRecord` of the step the engine just ran (None before
its first). After every step the engine makes one `StepRecord`: everything a strategy or an estimator learns from
a step is in it, counted once, by the engine, and never recomputed by a reader.

The rules that choose a strategy (fixed, BEG's table, ReSpec's threshold, the adaptive selector) all live in
`rollout.selector`; this module holds only the contract between them and the engine.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

KINDS = ("none", "chain", "tree", "dynamic")
_CHAINS: dict[int, Strategy] = {}  # Strategy.chain(k) by k, built once each
_LABEL = re.compile(r"^(?:none|chain(\d+)|tree([\d-]+)n(\d+)|dyn(\d+)x(\d+)n(\d+))$")


@dataclass(frozen=True, eq=False)
class Strategy:
    """One speculation shape. Build with `none`, `chain`, `tree`, `dynamic`, `of` or `parse`.

    An int is a chain's k wherever a strategy is taken, and a chain or plain decoding compares and hashes equal to
    its k: `Strategy.chain(3) == 3`, and `table[(b, 3)]` finds the entry of `(b, Strategy.chain(3))`. So tables, k
    schedules and counters keyed by draft length keep working as chains' entries, beside the trees'. Ordered by
    (verify tokens, depth, kind, branching): chains by k, a cost table's columns cheapest-looking first."""

    nodes: int  # drafted tokens verified per row (the verify forward has nodes + 1 tokens: the last one first)
    depth: int  # longest path: at most this many drafts accepted per row and step
    kind: str
    branching: tuple[int, ...]  # children per node, per level (dynamic: topk at every level)

    def __post_init__(self) -> None:
        ok = self.kind in KINDS and self.depth >= 0 and self.nodes >= self.depth and len(self.branching) == self.depth
        ok = ok and all(isinstance(b, int) and b >= 1 for b in self.branching)
        if ok and self.kind == "none":
            ok = self.nodes == 0
        if ok and self.kind == "chain":
            ok = self.depth >= 1 and self.nodes == self.depth and set(self.branching) == {1}
        if ok and self.kind in ("tree", "dynamic"):
            ok = self.depth >= 1 and self.nodes <= self.full_nodes
        if ok and self.kind == "dynamic":
            ok = len(set(self.branching)) == 1
        if not ok:
            raise ValueError(f"not a valid strategy: kind={self.kind!r}, depth={self.depth}, nodes={self.nodes}, "
                             f"branching={self.branching} (a tree verifies depth <= nodes <= its full size)")
        # the identity, computed once: selectors and cost tables compare and hash strategies at every decision
        identity = (self.nodes, self.depth, KINDS.index(self.kind), self.branching)
        object.__setattr__(self, "_identity", identity)
        object.__setattr__(self, "_hash", hash(self.depth) if self.kind in ("none", "chain") else hash(identity))

    # -- identity: a chain is its k --------------------------------------------------------------------------------
    def _key(self) -> tuple:
        return self._identity

    @staticmethod
    def _other(other) -> Strategy | None:
        if isinstance(other, Strategy):
            return other
        if isinstance(other, int) and not isinstance(other, bool) and other >= 0:
            return Strategy.chain(other)
        return None

    def __eq__(self, other) -> bool:
        if other is self:
            return True
        o = self._other(other)
        return NotImplemented if o is None else self._key() == o._key()

    def __hash__(self) -> int:
        return self._hash  # a chain hashes as its k (an int key finds its entry)

    def __lt__(self, other) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self._key() < o._key()

    def __le__(self, other) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self._key() <= o._key()

    def __gt__(self, other) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self._key() > o._key()

    def __ge__(self, other) -> bool:
        o = self._other(other)
        return NotImplemented if o is None else self._key() >= o._key()

    def __index__(self) -> int:
        """A chain's k (plain decoding's 0), where an int is needed (`range(k)`, a vLLM k schedule); a tree has
        no single k and raises TypeError."""
        if self.is_tree:
            raise TypeError(f"{self.label} is a tree: it has no single draft length k")
        return self.depth

    # -- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def none(cls) -> Strategy:
        return cls(0, 0, "none", ())

    @classmethod
    def chain(cls, k: int) -> Strategy:
        """k drafted tokens in a line; chain(0) is plain decoding."""
        if type(k) is int and k in _CHAINS:
            return _CHAINS[k]
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"a chain's k must be an int >= 0, got {k!r}")
        s = cls.none() if k == 0 else cls(k, k, "chain", (1,) * k)
        if type(k) is int and k <= 64:  # immutable: one instance per k serves every int that stands for it
            _CHAINS[k] = s
        return s

    @classmethod
    def tree(cls, branching: Sequence[int], nodes: int) -> Strategy:
        """A static tree: `branching[d]` children per node at level d + 1, its `nodes` best nodes verified."""
        b = tuple(int(x) for x in branching)
        if all(x == 1 for x in b) and nodes == len(b):
            return cls.chain(len(b))
        return cls(int(nodes), len(b), "tree", b)

    @classmethod
    def dynamic(cls, depth: int, topk: int, nodes: int) -> Strategy:
        """An EAGLE-2 dynamic tree of `depth` levels, `topk` expanded nodes x `topk` children, `nodes` verified."""
        return cls(int(nodes), int(depth), "dynamic", (int(topk),) * int(depth))

    @classmethod
    def of(cls, value: Strategy | int | str) -> Strategy:
        """A strategy from a Strategy, an int (a chain's k) or a label."""
        if isinstance(value, Strategy):
            return value
        if isinstance(value, bool):
            raise ValueError(f"not a strategy: {value!r}")
        if isinstance(value, int):
            return cls.chain(value)
        if isinstance(value, str):
            return cls.parse(value)
        raise ValueError(f"not a strategy: {value!r}")

    @classmethod
    def parse(cls, label: str) -> Strategy:
        """The inverse of `label`: none, chain4, tree4-2-1n12, dyn6x4n32 (a bare int is a chain's k)."""
        s = label.strip()
        if s.isdigit():
            return cls.chain(int(s))
        m = _LABEL.match(s)
        if m is None:
            raise ValueError(f"not a strategy label: {label!r} (none, chain<k>, tree<b1-b2-...>n<nodes>, "
                             f"dyn<depth>x<topk>n<nodes>)")
        if m.group(1):
            return cls.chain(int(m.group(1)))
        if m.group(2):
            return cls.tree([int(x) for x in m.group(2).split("-") if x], int(m.group(3)))
        if m.group(4):
            return cls.dynamic(int(m.group(4)), int(m.group(5)), int(m.group(6)))
        return cls.none()

    # -- what it is ----------------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "chain":
            return f"chain{self.depth}"
        if self.kind == "tree":
            return f"tree{'-'.join(map(str, self.branching))}n{self.nodes}"
        return f"dyn{self.depth}x{self.branching[0]}n{self.nodes}"

    def __str__(self) -> str:
        return self.label

    def __format__(self, spec: str) -> str:
        return format(self.label, spec)

    @property
    def speculates(self) -> bool:
        return self.kind != "none"

    @property
    def is_tree(self) -> bool:
        """Verified as a tree (several children somewhere): static and dynamic trees, not chains."""
        return self.kind in ("tree", "dynamic")

    @property
    def width(self) -> int:
        """Tokens per row in the verify forward."""
        return self.nodes + 1

    @property
    def topk(self) -> int:
        """Children per node (a dynamic tree's topk; a static tree's widest level)."""
        return max(self.branching, default=0)

    @property
    def full_nodes(self) -> int:
        """Nodes of the full tree the branching allows (a dynamic tree: every node it drafts)."""
        if self.kind == "dynamic":
            k = self.branching[0]
            return k + (self.depth - 1) * k * k
        total, level = 0, 1
        for b in self.branching:
            level *= b
            total += level
        return total

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """A static tree's topology (chains' too): parent index of nodes 1..nodes (node 0 is the root, the row's
        last known token), nodes ordered by depth then by their ranks' path, so a parent comes before its
        children. Empty for plain decoding; a dynamic tree has none (per row, drawn at each step)."""
        if self.kind == "dynamic":
            raise ValueError(f"{self.label}: a dynamic tree's topology is chosen per row at every step")
        return tuple(p for p, _ in static_tree(self.branching, self.nodes))

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Sibling rank of nodes 1..nodes in a static tree (0: the parent's likeliest child)."""
        if self.kind == "dynamic":
            raise ValueError(f"{self.label}: a dynamic tree's topology is chosen per row at every step")
        return tuple(r for _, r in static_tree(self.branching, self.nodes))


# The fixed prior a static tree's topology is chosen by: the child of sibling rank r is the accepted one with
# probability PRIOR_ACCEPT * PRIOR_RANK_DECAY**r (an EAGLE-3 drafter's shape: ~0.7 for its first choice, a
# fraction of that for each next). The live estimates choose among trees; this only fixes each tree's nodes.
PRIOR_ACCEPT, PRIOR_RANK_DECAY = 0.7, 0.25


def static_tree(branching: Sequence[int], nodes: int) -> list[tuple[int, int]]:
    """`_static_tree`, computed once per shape: selectors value trees at every decision."""
    return list(_static_tree(tuple(int(b) for b in branching), int(nodes)))


@lru_cache(maxsize=512)
def _static_tree(branching: tuple[int, ...], nodes: int) -> tuple[tuple[int, int], ...]:
    """(parent, rank) of nodes 1..nodes of a static tree, node 0 being the root: the `nodes` most probable
    nodes of the full tree (branching[d] children per node at level d + 1) under the fixed rank prior (a node's
    probability is its path's product of PRIOR_ACCEPT * PRIOR_RANK_DECAY**rank), ties to the shallower node and
    then to lower ranks. A node is never likelier than its parent, so every kept node's parent is kept, and a
    smaller budget's nodes are among a larger budget's. Ordered by depth, then by the rank path, so
    parents precede children."""
    edge = [-math.log(PRIOR_ACCEPT * PRIOR_RANK_DECAY**r) for r in range(max(branching, default=0))]
    chosen: list[tuple[int, tuple[int, ...]]] = []  # (depth, rank path)
    heap = [(edge[r], 1, (r,)) for r in range(branching[0])] if branching else []
    heapq.heapify(heap)
    while heap and len(chosen) < nodes:
        cost, depth, path = heapq.heappop(heap)
        chosen.append((depth, path))
        if depth < len(branching):
            for r in range(branching[depth]):
                heapq.heappush(heap, (cost + edge[r], depth + 1, path + (r,)))
    if len(chosen) < nodes:
        raise ValueError(f"a tree with branching {tuple(branching)} has {len(chosen)} nodes, fewer than {nodes}")
    chosen.sort()
    index = {path: i + 1 for i, (_, path) in enumerate(chosen)}
    return tuple((index.get(path[:-1], 0), path[-1]) for _, path in chosen)


def expected_accepted(strategy: Strategy, accept: Callable[[int, int], float]) -> float:
    """E[accepted drafts per row] of a strategy when the child of sibling rank r at depth d (d = 0: the root's
    children) is the accepted one with probability accept(d, r), independently along a path: the sum over
    the verified nodes of their path's probability. A dynamic tree is valued as the static tree of its
    budget and shape (what it drafts is at least as likely as the static choice, EAGLE-2's point)."""
    if not strategy.speculates:
        return 0.0
    if strategy.kind == "chain":
        total, run = 0.0, 1.0
        for d in range(strategy.depth):
            run *= accept(d, 0)
            total += run
        return total
    shape = strategy if strategy.kind == "tree" else Strategy.tree(strategy.branching, strategy.nodes)
    prob = [1.0]
    depth = [0]
    for parent, rank in zip(shape.parents, shape.ranks):
        d = depth[parent]
        prob.append(prob[parent] * accept(d, rank))
        depth.append(d + 1)
    return sum(prob[1:])


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One decode step of one engine, as the engine measured it (host-side numbers only)."""

    step: int  # 1 for an engine's first decode step, then 2, 3, ...
    rows: int  # running rows (the batch size) of the step
    strategy: Strategy  # what the step ran (an int given here is a chain's k)
    run: int  # consecutive steps of this strategy, this one included (1: it just changed, or the first step)
    accepted: int  # accepted draft tokens summed over the rows
    reach: tuple[int, ...]  # [j] rows whose accepted path reached depth j + 1 (n_acc > j), j < depth; () for none
    seconds: float  # wall time of the step (batch, strategy, drafting, verify, accept, finishing); admission excluded
    # per depth d and sibling rank r (trees): rows whose node at depth d had a rank-r child, and rows that accepted
    # it; () for chains and plain decoding (a chain's are its reach: rank 0 at every depth)
    rank_trials: tuple[tuple[int, ...], ...] = ()
    rank_accepted: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            object.__setattr__(self, "strategy", Strategy.of(self.strategy))

    @property
    def k(self) -> int:
        """The strategy's depth: the most drafts a row can accept in this step (0: plain decoding)."""
        return self.strategy.depth

    @classmethod
    def following(cls, previous: StepRecord | None, rows: int, strategy: Strategy | int, accepted: int,
                  reach: Sequence[int], seconds: float, rank_trials: Sequence[Sequence[int]] = (),
                  rank_accepted: Sequence[Sequence[int]] = ()) -> StepRecord:
        """The record of the step after `previous` (None: the engine's first): the one place a step's index
        and its run length are counted."""
        strategy = Strategy.of(strategy)
        trials = tuple(tuple(r) for r in rank_trials)
        acc = tuple(tuple(r) for r in rank_accepted)
        if previous is None:
            return cls(1, rows, strategy, 1, accepted, tuple(reach), seconds, trials, acc)
        run = previous.run + 1 if strategy == previous.strategy else 1
        return cls(previous.step + 1, rows, strategy, run, accepted, tuple(reach), seconds, trials, acc)


Selector = Callable[[int, "StepRecord | None"], "Strategy | int"]
