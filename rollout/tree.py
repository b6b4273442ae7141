"""Token trees: the tensors a drafter proposes for a tree strategy, and a tree strategy's verify step.

A step's tree for row b has N + 1 nodes; node 0 is the root, the row's last known token (the first verify
input, as in a chain), nodes 1..N are drafted tokens. Nodes are ordered by depth, so a parent always comes
before its children, and node i is cached in slot L - 1 + i of the target's KV cache during the verify
(rollout/model_runner.py: `tree_allowed`, `move_path`). A chain of k is the tree whose node j has parent j - 1.

Static trees have one topology for every row (`static_topology`, from the strategy's parents and ranks);
dynamic trees choose theirs per row (`select_dynamic`). Either way the shapes depend only on the strategy, so
a graph can be captured per (batch bucket, strategy).

`tree_step` is the engine's step for a tree strategy: draft, one verify forward over every node, accept by the
engine's verify rule (rollout/sampling.py: `verify_tree`, `verify_tree_coupled`), the accepted path moved into
the KV cache's positions; after it the drafter and the recorder see the path as they would a chain's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tailspec.rollout import sampling
from tailspec.rollout.strategy import Strategy


@dataclass
class TreeDraft:
    """One step's token trees, [n, N + 1] per node unless noted."""

    tokens: torch.Tensor  # long: the node's token (node 0: the row's last known token)
    parent: torch.Tensor  # long: the parent's node index (node 0: 0)
    depth: torch.Tensor  # long: 0 for the root, a child one more than its parent
    rank: torch.Tensor  # long: sibling rank, the drafter's r-th choice among its parent's children (root: 0)
    anc: torch.Tensor  # [n, N + 1, N + 1] bool: anc[b, i, j] iff node j is node i or one of its ancestors
    children: torch.Tensor  # [n, N + 1, R] long: node i's child of rank r, -1 where it has none


@dataclass(frozen=True)
class Level:
    """One drafting level of a static tree: the nodes at depth d that get children, and those children."""

    expand: torch.Tensor  # nodes at depth d with children
    expand_parent: torch.Tensor  # their parents
    kids: torch.Tensor  # the children, at depth d + 1
    kid_source: torch.Tensor  # for each child, its parent's index in `expand`
    kid_rank: torch.Tensor  # and its sibling rank
    anc_rows: torch.Tensor  # [1, len(expand), N + 1] bool: the expanded nodes' rows of the ancestor table


@dataclass(frozen=True)
class Topology:
    """A static tree's parent, depth, rank, ancestor and child tables on a device (row-independent)."""

    parent: torch.Tensor  # [N + 1]
    depth: torch.Tensor  # [N + 1]
    rank: torch.Tensor  # [N + 1]
    anc: torch.Tensor  # [N + 1, N + 1]
    children: torch.Tensor  # [N + 1, R]
    levels: tuple[Level, ...]  # per depth d < the strategy's depth


_TOPOLOGIES: dict[tuple[Strategy, torch.device], Topology] = {}


def static_topology(strategy: Strategy, device: torch.device) -> Topology:
    """The tables of a static tree (or a chain), built once per (strategy, device)."""
    key = (strategy, torch.device(device))
    if key in _TOPOLOGIES:
        return _TOPOLOGIES[key]
    parents = (0,) + strategy.parents
    ranks = (0,) + strategy.ranks
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    anc = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while True:
            anc[i][j] = True
            if j == 0:
                break
            j = parents[j]
    width = max(strategy.topk, 1)
    children = [[-1] * width for _ in range(n)]
    for i in range(1, n):
        children[parents[i]][ranks[i]] = i
    levels = []
    for d in range(strategy.depth):
        expand = [i for i in range(n) if depth[i] == d and any(c >= 0 for c in children[i])]
        where = {p: e for e, p in enumerate(expand)}
        kids = [i for i in range(1, n) if depth[i] == d + 1]

        def t(xs):
            return torch.tensor(xs, dtype=torch.long, device=device)

        levels.append(Level(expand=t(expand), expand_parent=t([parents[i] for i in expand]), kids=t(kids),
                            kid_source=t([where[parents[i]] for i in kids]), kid_rank=t([ranks[i] for i in kids]),
                            anc_rows=torch.tensor([anc[i] for i in expand], device=device).reshape(1, len(expand), n)))
    topo = Topology(
        parent=torch.tensor(parents, device=device), depth=torch.tensor(depth, device=device),
        rank=torch.tensor(ranks, device=device), anc=torch.tensor(anc, device=device),
        children=torch.tensor(children, device=device), levels=tuple(levels),
    )
    _TOPOLOGIES[key] = topo
    return topo


@dataclass(frozen=True)
class DynamicLayout:
    """What a dynamic tree's drafted tables hold whatever the text, [1, M] (`Eagle3Proposer._dynamic_tree`'s node
    numbering: the root, the root's K children, then a block of K x K children per later level)."""

    depth: torch.Tensor  # long: each node's depth
    rank: torch.Tensor  # long: its sibling rank (block offset mod K)
    parent: torch.Tensor  # long, zeros: the root's and its children's parent (later blocks' are drafted)
    anc: torch.Tensor  # [1, M, M] bool: each node itself and the root


_LAYOUTS: dict[tuple[Strategy, torch.device], DynamicLayout] = {}


def dynamic_layout(strategy: Strategy, device: torch.device) -> DynamicLayout:
    """The shape-only tables of a dynamic tree, built once per (strategy, device)."""
    key = (strategy, torch.device(device))
    if key not in _LAYOUTS:
        k, d = strategy.topk, strategy.depth
        depth = [0] + [1] * k + [lv for lv in range(2, d + 1) for _ in range(k * k)]
        rank = [0] + list(range(k)) + list(range(k)) * (k * (d - 1))
        m = len(depth)
        anc = torch.eye(m, dtype=torch.bool, device=device)
        anc[:, 0] = True
        _LAYOUTS[key] = DynamicLayout(depth=torch.tensor([depth], device=device), rank=torch.tensor([rank], device=device),
                                      parent=torch.zeros(1, m, dtype=torch.long, device=device), anc=anc[None])
    return _LAYOUTS[key]


def children_table(parent: torch.Tensor, rank: torch.Tensor, width: int) -> torch.Tensor:
    """[n, M, width] long: node i's child of rank r, -1 where none (node 0 is nobody's child)."""
    n, m = parent.shape
    out = torch.full((n, m, width), -1, dtype=torch.long, device=parent.device)
    idx = torch.arange(m, device=parent.device)[None].expand(n, m)
    flat = (parent * width + rank)[:, 1:]
    out.view(n, m * width).scatter_(1, flat, idx[:, 1:])
    return out


def select_dynamic(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor,
                   score: torch.Tensor, anc: torch.Tensor, nodes: int, width: int) -> TreeDraft:
    """The verified tree of a dynamic strategy: from every drafted node ([n, M] tables in depth order, node 0 the
    root; `anc` [n, M, M] their ancestor table), the `nodes` with the highest cumulative draft log-probability
    `score` (ties to the earlier node, so a parent, never less likely than its child, is kept before it), in their
    drafted order. Every kept node's ancestors are kept, so the kept tree's ancestor table is the drafted one's
    rows and columns at the kept nodes. Returns its tables."""
    n, m = tokens.shape
    order = torch.sort(score[:, 1:], dim=1, descending=True, stable=True).indices[:, :nodes] + 1
    keep = torch.sort(order, dim=1).values  # depth order: parents before children
    keep = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=tokens.device), keep], 1)  # [n, nodes + 1]
    new_index = torch.zeros((n, m), dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, keep, torch.arange(nodes + 1, device=tokens.device)[None].expand(n, -1))
    vparent = new_index.gather(1, parent.gather(1, keep))
    vrank = rank.gather(1, keep)
    kept_rows = anc.gather(1, keep[:, :, None].expand(n, nodes + 1, m))  # [n, nodes + 1, M]
    kept_anc = kept_rows.gather(2, keep[:, None, :].expand(n, nodes + 1, nodes + 1))
    return TreeDraft(tokens=tokens.gather(1, keep), parent=vparent, depth=depth.gather(1, keep), rank=vrank,
                     anc=kept_anc, children=children_table(vparent, vrank, width))


def check_tree(strategy: Strategy, drafter, k_max: int, max_tree_nodes: int) -> None:
    """Raise ValueError naming why an engine (its drafter, k_max and max_tree_nodes) cannot run a tree strategy."""
    if drafter is None or not drafter.drafts_trees:
        name = "no drafter" if drafter is None else f"the {drafter.name} drafter"
        raise ValueError(f"{strategy.label} is a tree strategy; {name} drafts chains only (EAGLE-3 drafts trees)")
    if strategy.depth > k_max:
        raise ValueError(f"{strategy.label} is {strategy.depth} deep; this engine's k_max is {k_max}")
    drafted = strategy.full_nodes if strategy.kind == "dynamic" else strategy.nodes
    if drafted > max_tree_nodes:
        raise ValueError(f"{strategy.label} drafts {drafted} nodes; this engine's max_tree_nodes is {max_tree_nodes}")
    if strategy.topk > sampling.TREE_RANKS:
        raise ValueError(f"{strategy.label} has {strategy.topk} children per node; at most {sampling.TREE_RANKS}")


def tree_step(engine, batch, strategy: Strategy, coupled: bool, u_smp, need_aux: bool):
    """An engine step of a tree strategy (the module docstring). `u_smp` [n, depth + 1]: the SAMPLE stream of the
    residual rule (None under the coupled rule, whose race noise is `batch.race`). Returns what the engine's
    chain path does: tokens [n, depth + 1], n_acc [n], logits and p at the accepted path [n, depth + 1, V], and
    (rank_trials, rank_accepted) [depth, R]."""
    L, n = batch.lengths, batch.n
    draft = engine.drafter.propose_tree(batch, strategy)
    logits, aux = engine.verify_forward(draft.tokens, L - 1, max_pos=batch.max_length - 1 + strategy.nodes,
                                        want_aux=need_aux, tree=(draft.depth, draft.anc))
    p = engine.processed(logits, batch)
    if coupled:
        out, n_acc, path, trials, acc = sampling.verify_tree_coupled(p, draft, batch.race)
    else:
        width = draft.children.shape[-1]
        u_acc = (sampling.tree_accept_uniforms(batch.key, L, strategy.depth, width) if batch.any_sampled
                 else torch.zeros(n, strategy.depth, width, dtype=torch.float64, device=L.device))
        out, n_acc, path, trials, acc = sampling.verify_tree(p, draft, u_acc, u_smp)
    engine.runner.move_path(L - 1, path)
    at = path[..., None]
    logits, p = logits.gather(1, at.expand(-1, -1, logits.shape[-1])), p.gather(1, at.expand(-1, -1, p.shape[-1]))
    if aux is not None:
        aux = aux.gather(1, at.expand(-1, -1, aux.shape[-1]))
    engine.after_verify(batch, strategy.depth, out, n_acc, aux, logits)
    return out, n_acc, logits, p, (trials, acc)
