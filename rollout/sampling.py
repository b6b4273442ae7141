"""Processed distributions, counter-based per-request randomness, and exact speculative sampling.

Everything here is vectorised over the batch: no Python loop over rows.

Randomness: every random number the engine draws is a hash of (request seed, token position, stream),
so a request's output depends only on its own seed and never on which other requests share its batch
(a per-request generator, without a per-row Python loop). Streams: ACCEPT (the acceptance test of the draft
token at that position), SAMPLE (the target's draw at that position: the residual at the first rejection
or the bonus token), DRAFT (the drafter's own draw). Reusing a (position, stream) pair in a later step is
sound: at the first rejection at position t, everything emitted so far is a function of the numbers at
positions <= t only, so the numbers at positions > t are still fresh.

Two verification rules, both exact (every emitted token is distributed as the target's processed
distribution given the tokens before it):
- `verify` (residual, Leviathan et al. / Chen et al.): accept draft x with probability min(1, p(x)/q(x)),
  else draw from the normalised residual max(0, p - q). The highest acceptance an exact rule has (1 - TV(p, q)),
  but which tokens come out depends on the drafter and on k.
- `verify_coupled` (drafter-invariant: an exponential race, i.e. Gumbel-max): every position has its own
  exponential noise e per vocabulary id (stream RACE), the target's token there is argmax(p / e) and the
  drafter drafts argmax(q / e) with the same e; a draft is accepted iff it equals the target's token. The output is then
  plain Gumbel-max sampling of the target with that noise: the same tokens whatever the drafter, k or batch
  (up to float ties), so a run with speculation produces the very rollouts of a run without it. The price is
  acceptance: P(accept) >= (1 - TV) / (1 + TV), below the residual rule's 1 - TV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACCEPT, SAMPLE, DRAFT, RACE = 0, 1, 2, 3
_M32 = 0xFFFFFFFF


def _mul32_split(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow: split c into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mul32_wrap(x: torch.Tensor, c: int) -> torch.Tensor:
    # the product overflows int64, but the kernels wrap (two's complement), so its low 32 bits are exact:
    # 2 tensor ops instead of 6 (the hash is dispatch-bound on a CPU)
    return (x * c) & _M32


def _wraps() -> bool:
    """Does int64 multiplication wrap here? Checked once against exact Python integers."""
    xs = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x9E3779B9, 123456789]
    got = _mul32_wrap(torch.tensor(xs, dtype=torch.long), 0xC2B2AE35).tolist()
    return got == [(x * 0xC2B2AE35) & _M32 for x in xs]


_mul32 = _mul32_wrap if _wraps() else _mul32_split


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_mix(seed: torch.Tensor) -> torch.Tensor:
    """Fold a non-negative int64 seed into a 32-bit key (done once per request at admission)."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return _fmix32(_fmix32(lo) ^ _mul32(_fmix32(hi + 0x9E3779B9), 0x27D4EB2F))


def uniforms(key: torch.Tensor, pos: torch.Tensor, stream: int) -> torch.Tensor:
    """U[0, 1) float64 with 24 random bits for each (key [B], pos [B, T]) pair in `stream`."""
    return uniforms_at(key, (pos << 2) | stream)


def uniforms_at(key: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`uniforms` for codes [B, T] = (pos << 2) | stream: several streams and positions in one call (the
    hash is ~25 tensor ops, each a fixed dispatch cost on a CPU)."""
    # fmix32 is a bijection with full avalanche: mixing the code, folding in the (already mixed) key and
    # mixing again gives independent-looking bits per (key, code). A third round would be a bijection of
    # this one and add nothing: distinct (key, code) pairs collide exactly as often either way.
    h = _fmix32(key[:, None] ^ _fmix32(codes))
    return (h >> 8).to(torch.float64) * (1.0 / (1 << 24))


_OFFSETS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _step_offsets(k: int, device: torch.device) -> torch.Tensor:
    """[1, 3k+1] codes of a step's uniforms relative to `lengths << 2` (cached: they depend on k only)."""
    key = (k, torch.device(device))
    if key not in _OFFSETS:
        j = torch.arange(k + 1, device=device)
        _OFFSETS[key] = torch.cat([(j[:k] << 2) | DRAFT, (j[:k] << 2) | ACCEPT, (j << 2) | SAMPLE])[None]
    return _OFFSETS[key]


def uniform_table(key: torch.Tensor, positions: int) -> torch.Tensor:
    """Every uniform a request can use, [B, 4 * positions] float64 indexed by code (pos << 2) | stream, for
    keys [B]: hashed once at admission so that a decode step only gathers (see `step_uniforms_from`)."""
    codes = torch.arange(4 * positions, device=key.device)[None]
    return uniforms_at(key, codes)


def step_uniforms_from(table: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every uniform one decode step at draft length k uses, for rows with `lengths` [B] (the verify
    positions are lengths .. lengths + k), read from the rows' `uniform_table` [B, 4 * positions] in one
    gather: (draft [B, k] DRAFT stream at positions lengths + j, accept [B, k] ACCEPT stream, sample
    [B, k+1] SAMPLE stream). The same numbers as `uniforms` per stream."""
    u = table.gather(1, (lengths[:, None] << 2) + _step_offsets(k, lengths.device))
    return u[:, :k], u[:, k : 2 * k], u[:, 2 * k :]


def process(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_sampled: bool = True,
    any_greedy: bool = True,
    any_truncated: bool = True,
    any_scaled: bool = True,
) -> torch.Tensor:
    """Processed distribution [B, T, V] from logits [B, T, V] and per-row params [B].

    Same order and rules as HF's warpers: temperature, then top-k (ties with the k-th value kept), then
    top-p (keep the smallest prefix of tokens by descending probability whose mass reaches top_p).
    temperature == 0 means greedy: a one-hot on the argmax (first index on ties), so greedy rows go through
    the same speculative rule (accept iff the draft is the argmax). top_k 0 and top_p 1 mean off.
    The `any_*` flags are the caller's host-side knowledge of the batch, to skip work without a sync
    (`any_scaled`: some row's temperature is neither 0 nor 1).
    """
    B, T, V = logits.shape
    if not any_sampled:
        return F_one_hot(logits.argmax(-1), V)
    greedy = temperature == 0 if any_greedy else None
    if any_scaled:
        t = torch.where(greedy, 1.0, temperature) if any_greedy else temperature
        x = logits / t[:, None, None]
    else:
        x = logits
    if any_truncated:
        srt, idx = x.sort(-1, descending=True)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
        kth = srt.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
        ps = srt.softmax(-1)
        excl = ps.cumsum(-1) - ps  # mass strictly before each sorted token
        p_eff = torch.where(top_p < 1, top_p, torch.full_like(top_p, 2.0))[:, None, None]
        drop_sorted = (excl >= p_eff) | (srt == float("-inf"))
        drop = torch.empty_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if any_greedy:
        probs = torch.where(greedy[:, None, None], F_one_hot(logits.argmax(-1), V), probs)
    return probs


def F_one_hot(idx: torch.Tensor, V: int) -> torch.Tensor:
    return torch.zeros(*idx.shape, V, dtype=torch.float32, device=idx.device).scatter_(-1, idx[..., None], 1.0)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from (unnormalised, non-negative) probs [..., V] with u [...] in [0, 1).

    float64 cumsum: u * total < total strictly, and a zero-probability token is never chosen (its cumsum
    equals its predecessor's, so the predecessor is found first).
    """
    c = probs.double().cumsum(-1)
    target = (u * c[..., -1])[..., None]
    return torch.searchsorted(c, target, right=True)[..., 0].clamp_(max=probs.shape[-1] - 1)


def verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling for a batch with ragged acceptance.

    p [B, k+1, V] target's processed distributions at the k+1 verify positions; q [B, k, V] the drafter's
    processed distributions (None = deterministic drafts, q one-hot on the draft); drafts [B, k];
    u_accept [B, k], u_sample [B, k+1] uniforms. Draft j is accepted with probability min(1, p(x)/q(x))
    (tested as u*q(x) < p(x)); at the first rejection j a token is drawn from normalize(max(0, p_j - q_j));
    if all k are accepted, a bonus token from p_k.
    Returns (tokens [B, k+1]: accepted drafts then the drawn token at index n_acc; n_acc [B]).
    """
    B, K1, V = p.shape
    k = K1 - 1
    if k == 0:
        return sample(p[:, 0], u_sample[:, 0])[:, None], torch.zeros(B, dtype=torch.long, device=p.device)
    px = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    if q is None:
        accept = u_accept < px.double()
        q = F_one_hot(drafts, V)
    else:
        qx = q.gather(-1, drafts[..., None])[..., 0]
        accept = u_accept * qx.double() < px.double()
    n_acc = accept[:, 0].long() if k == 1 else accept.long().cumprod(-1).sum(-1)  # leading accepted drafts
    # Residuals max(0, p_j - q_j) at every position, with q = 0 past the drafts so the last row is the bonus
    # distribution p_k itself; then the row at n_acc. (Cheaper than selecting p and q rows separately.)
    resid = (p - F.pad(q, (0, 0, 0, 1))).clamp_(min=0)
    # Mathematically a rejection implies residual mass > 0; guard the float corner where it rounds to 0.
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
    resid = resid.gather(1, n_acc[:, None, None].expand(B, 1, V))[:, 0]
    final = sample(resid, u_sample.gather(-1, n_acc[:, None])[:, 0])
    tokens = F.pad(drafts, (0, 1)).scatter_(1, n_acc[:, None], final[:, None])
    return tokens, n_acc


def race_noise(key: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential race noise [B, T, V] float64 (-log u, u uniform) of the RACE stream for keys [B] at positions
    pos [B, T], one number per vocabulary id: the coupling `verify_coupled` and the drafters share. 32 random
    bits each, offset by half a step so that no uniform is 0 or 1. The code is spread by a multiplication (a
    bijection) instead of a first fmix32 round: the final round avalanches either way, and this is the hot
    path's largest hash (B x T x V numbers a step)."""
    B, T = pos.shape
    x = torch.arange(vocab, device=pos.device)
    codes = (((pos[..., None] * vocab + x) << 2) | RACE).reshape(B, T * vocab)
    h = _fmix32(key[:, None] ^ _mul32(codes, 0x9E3779B1))
    u = (h.to(torch.float64) + 0.5) * (1.0 / (1 << 32))
    return (-u.log()).reshape(B, T, vocab)


def race(probs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """argmax(probs / e) over the last dim with e exponential noise (`race_noise`): the exponential race, i.e.
    Gumbel-max (argmax(log probs - log e)), a draw from probs; a zero-probability id never wins."""
    return (probs.double() / e).argmax(-1)


def verify_coupled(p: torch.Tensor, drafts: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter-invariant exact speculative sampling (see the module docstring).

    p [B, k+1, V] the target's processed distributions at the k+1 verify positions, drafts [B, k], e [B, k+1, V]
    the race noise of those positions (`race_noise`). The target's token at every position is race(p, e); the
    leading drafts equal to it are accepted, so the step's tokens are the race winners themselves.
    Returns (tokens [B, k+1], n_acc [B]) as `verify` does."""
    tokens = race(p, e)
    k = drafts.shape[1]
    if k == 0:
        return tokens, torch.zeros(p.shape[0], dtype=torch.long, device=p.device)
    match = drafts == tokens[:, :k]
    n_acc = match[:, 0].long() if k == 1 else match.long().cumprod(-1).sum(-1)
    return tokens, n_acc


# -- token trees (rollout/tree.py) ----------------------------------------------------------------------------
# A tree's siblings are the drafter's top choices, a function of the context alone (no random number), so under
# the residual rule each child is a point-mass draft: recursive rejection over the siblings accepts child x with
# probability p_res(x) / |p_res| and, when it rejects it, takes x out of p_res (the residual max(0, p_res - onehot(x))),
# then samples the last residual when every child is rejected. That is exact for any set of candidates, and uses
# the numbers of the tree's own positions only up to the emitted token, so reusing the later ones next step is
# sound (the module docstring). TREE_RANKS bounds the sibling ranks the accept stream has numbers for.
TREE_RANKS = 16
_TREE_SALT = 0x5EED7EE5


def tree_accept_uniforms(key: torch.Tensor, lengths: torch.Tensor, depth: int, ranks: int) -> torch.Tensor:
    """[B, depth, ranks] ACCEPT-stream uniforms of a tree step: one per (position lengths + d, sibling rank r), from
    a salted key so they never coincide with a chain's numbers of the same position."""
    if ranks > TREE_RANKS:
        raise ValueError(f"a tree node may have at most {TREE_RANKS} children, got {ranks}")
    d = torch.arange(depth, device=lengths.device)[:, None]
    r = torch.arange(ranks, device=lengths.device)[None, :]
    codes = ((((lengths[:, None, None] + d) * TREE_RANKS + r) << 2) | ACCEPT).reshape(lengths.shape[0], depth * ranks)
    salted = key ^ _TREE_SALT
    return uniforms_at(salted, codes).reshape(-1, depth, ranks)


def _walk_outputs(n: int, depth: int, ranks: int, device) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(n, depth + 1, dtype=torch.long, device=device),  # tokens
            torch.zeros(n, depth + 1, dtype=torch.long, device=device),  # path
            torch.zeros(depth, ranks, dtype=torch.long, device=device),  # rank trials
            torch.zeros(depth, ranks, dtype=torch.long, device=device))  # rank accepted


def verify_tree(p: torch.Tensor, tree, u_accept: torch.Tensor, u_sample: torch.Tensor):
    """Exact speculative sampling over token trees (residual rule; see above), ragged across rows.

    p [B, N+1, V] the target's processed distributions at every node (node i's: of the token after it); `tree` a
    `rollout.tree.TreeDraft`; u_accept [B, D, R] (`tree_accept_uniforms`), u_sample [B, D+1] the SAMPLE stream at
    positions L.. L+D. Walks from the root: at a node of depth d its children are tried in rank order, and an
    accepted child is the next node; a node with no child accepted (or none at all) emits a draw of its residual.
    Returns (tokens [B, D+1]: the accepted children's tokens then the drawn one at index n_acc; n_acc [B];
    path [B, D+1]: the node at each depth of the accepted path, the last accepted repeated past n_acc;
    rank_trials [D, R] and rank_accepted [D, R]: rows whose node at depth d had a rank-r child, and accepted it)."""
    B = p.shape[0]
    D, R = u_accept.shape[1], tree.children.shape[-1]
    rows = torch.arange(B, device=p.device)
    tokens, path, trials, accepted = _walk_outputs(B, D, R, p.device)
    cur = torch.zeros(B, dtype=torch.long, device=p.device)
    active = torch.ones(B, dtype=torch.bool, device=p.device)
    n_acc = torch.zeros(B, dtype=torch.long, device=p.device)
    for d in range(D + 1):
        resid = p[rows, cur].double()  # [B, V]
        nxt = cur
        took = torch.zeros(B, dtype=torch.bool, device=p.device)
        if d < D:
            kids = tree.children[rows, cur]  # [B, R]
            for r in range(R):
                c = kids[:, r]
                tried = active & ~took & (c >= 0)
                x = tree.tokens[rows, c.clamp(min=0)]
                px = resid.gather(1, x[:, None])[:, 0]
                ok = tried & (u_accept[:, d, r] * resid.sum(-1) < px)
                # a rejected child leaves the residual: max(0, p_res - onehot(x)) is p_res without x
                resid = torch.where((tried & ~ok)[:, None], resid.scatter(1, x[:, None], 0.0), resid)
                nxt = torch.where(ok, c, nxt)
                took |= ok
                trials[d, r] = (active & (c >= 0)).sum()  # as the coupled walk counts: the child existed
                accepted[d, r] = ok.sum()
        drawn = sample(resid, u_sample[:, d])
        stop = active & ~took  # rows whose walk ends here: their token is the residual's draw
        tokens[:, d] = torch.where(took, tree.tokens[rows, nxt], torch.where(stop, drawn, tokens[:, d]))
        n_acc += took.long()
        active &= took
        cur = nxt
        if d < D:
            path[:, d + 1] = cur
    return tokens, n_acc, path, trials, accepted


def verify_tree_coupled(p: torch.Tensor, tree, e: torch.Tensor):
    """Drafter-invariant exact sampling over token trees: the token after a node of depth d is the target's race
    winner race(p[node], e[:, d]) of the position L + d, and the accepted path follows the child equal to its
    parent's winner while there is one. The emitted tokens are the race winners along the way whatever the tree
    (plain Gumbel-max sampling of the target), so a rollout is the same tokens with any drafter, chain, tree or
    none. e [B, D+1, V] is the race noise of positions L.. L+D (`race_noise`). Every node's winner is raced at once
    and the path read off the ancestor table: no walk. Returns what `verify_tree` does."""
    B, M, V = p.shape
    D, R = e.shape[1] - 1, tree.children.shape[-1]
    win = race(p, e.gather(1, tree.depth[..., None].expand(B, M, V)))  # [B, M]: the winner after each node
    ok = tree.tokens == win.gather(1, tree.parent)  # the node is its parent's winner (siblings differ: one at most)
    ok[:, 0] = True
    on_path = ~(tree.anc & ~ok[:, None, :]).any(-1)  # the node and all its ancestors are winners
    n_acc = torch.where(on_path, tree.depth, 0).amax(-1)
    levels = torch.arange(D + 1, device=p.device)
    at = on_path[:, None, :] & (tree.depth[:, None, :] == levels[None, :, None])  # [B, D+1, M]
    found = at.long().argmax(-1)
    path = torch.where(levels[None] <= n_acc[:, None], found, found.gather(1, n_acc[:, None]))
    tokens = win.gather(1, path)
    kids = tree.children.gather(1, path[:, :D, None].expand(B, D, R))  # [B, D, R]
    has = (kids >= 0) & (levels[None, :D] < n_acc[:, None] + 1)[..., None]
    took = has & on_path.gather(1, kids.clamp(min=0).reshape(B, D * R)).reshape(B, D, R)
    return tokens, n_acc, path, has.sum(0), took.sum(0)
