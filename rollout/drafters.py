"""The engine's drafters: proposers of k tokens per running row, with the draft distributions q they were
drawn from.

One interface (`Proposer`), three implementations (named *Proposer: the engine-side runners, as distinct from
the drafter models they run, such as the trained `drafter_trainer.model.Eagle3Module`):
- `NgramProposer`: prompt lookup, model-free. Deterministic proposals (q = one-hot, returned as None).
- `DraftModelProposer`: a small HF causal LM with the target's vocabulary, run through our ModelRunner on
  its own static KV cache.
- `Eagle3Proposer`: runs a `drafter_trainer.model.Eagle3Module`, fed the target's three aux hidden
  states from the verify forward; it follows the inference procedure documented in that module.

Lifecycle, driven by the engine: `setup` once; `prefill` when requests are admitted (the target has just
cached positions 0..L-2 of each prompt); every decode step `propose(batch, k)` (only when k > 0), then
`observe(...)` with the verify result (every step, k = 0 included); `move_slots` when the engine compacts.
Model drafters sample their drafts with the row's own sampling params and DRAFT-stream uniforms, so q is
the processed draft distribution — speculative sampling is exact for any q, a good q only makes it fast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tailspec.rollout.model_runner import (
    ModelRunner,
    attention_backends,
    attention_mask,
    check_supported,
    gqa_attention,
    qkv_rope_tables,
    rope,
    signed_sin,
    tree_allowed,
    unit_rms_norm,
)
from tailspec.rollout.sampling import DRAFT, process, race, sample, uniforms
from tailspec.rollout.slots import Batch
from tailspec.rollout.strategy import Strategy
from tailspec.rollout.tree import TreeDraft, dynamic_layout, select_dynamic, static_topology


class Proposer:
    """Base class: the no-op parts of the interface. `name` labels benchmark rows and stats."""

    name = "none"
    needs_aux = False
    drafts_trees = False  # implements propose_tree (tree and dynamic strategies)
    aux_layer_ids: tuple[int, ...] | None = None

    def check_fits(self, target_config: Any) -> None:
        """Raise ValueError naming every mismatch with the target (vocabulary, hidden size, layers)."""

    def setup(self, max_slots: int, cache_len: int, device: torch.device) -> None:
        pass

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slot0: int, aux: torch.Tensor | None) -> None:
        pass

    def propose(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def propose_tree(self, batch: Batch, strategy: Strategy) -> TreeDraft:
        """A token tree per row for a tree or dynamic strategy (rollout/tree.py); only where `drafts_trees`."""
        raise NotImplementedError(f"the {self.name} drafter drafts chains only")

    def observe(self, batch: Batch, k: int, tokens: torch.Tensor, n_acc: torch.Tensor, aux: torch.Tensor | None) -> None:
        """After a verify of width k+1 at positions L-1..L-1+k (lengths are still the old ones); tokens
        [n, k+1] holds the accepted drafts then the target's token at n_acc."""

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, upto: int | None = None) -> None:
        """The engine compacted its slots: copy the state of slots src into slots dst; `upto`: per-position state
        only at positions 0..upto-1 (the rest is written before it is read)."""


def _draw(logits: torch.Tensor, batch: Batch, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed q [n, V] from logits [n, V] with each row's params, and draft j (at position length + j)
    drawn from it with the DRAFT-stream uniform of that position (the engine's precomputed one when set), or,
    when the engine verifies coupled, the race of q with the target's noise of that position."""
    q = process(
        logits[:, None], batch.temperature, batch.top_k, batch.top_p,
        batch.any_sampled, batch.any_greedy, batch.any_truncated, batch.any_scaled,
    )[:, 0]
    if not batch.any_sampled:  # all greedy: q is one-hot, no randomness needed
        return q.argmax(-1), q
    if batch.race is not None:
        return race(q, batch.race[:, j]), q
    if batch.u_draft is not None and j < batch.u_draft.shape[1]:
        u = batch.u_draft[:, j]
    else:
        u = uniforms(batch.key, (batch.lengths + j)[:, None], DRAFT)[:, 0]
    return sample(q, u), q


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (n from max_n
    down to min_n) and propose the k tokens that followed it. Rows without a match propose their last
    token repeated (a cheap guess; correctness never depends on the proposal)."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def check_fits(self, target_config: Any) -> None:
        pass  # token ids are the target's own

    def propose(self, batch: Batch, k: int) -> tuple[torch.Tensor, None]:
        n_rows, W = batch.n, batch.max_length
        tok = batch.tokens[:, :W]
        L = batch.lengths
        dev = tok.device
        best = torch.full((n_rows,), -1, dtype=torch.long, device=dev)  # index of the first proposed token
        for n in range(self.max_n, self.min_n - 1, -1):
            if W <= n:
                continue
            suffix = tok.gather(1, (L[:, None] - n + torch.arange(n, device=dev)).clamp(min=0))  # [B, n]
            windows = tok.unfold(1, n, 1)  # [B, W-n+1, n]
            starts = torch.arange(windows.shape[1], device=dev)
            match = (windows == suffix[:, None, :]).all(-1) & (starts[None] + n < L[:, None])
            last = torch.where(match, starts[None], -1).amax(-1)
            best = torch.where((best < 0) & (last >= 0), last + n, best)
        idx = best[:, None] + torch.arange(k, device=dev)
        # Past the known end, the matched continuation has run out: repeat the last known token.
        idx = torch.where((best[:, None] < 0) | (idx >= L[:, None]), L[:, None] - 1, idx)
        return tok.gather(1, idx), None


class DraftModelProposer(Proposer):
    """A small causal LM with the target's vocabulary (e.g. the `micro` policy for the `tiny` target).

    Its KV cache follows the sequence lazily: each propose first feeds the last `lag` known tokens (2 after
    a drafting step: the last accepted draft may not have been fed, plus the target's token; +1 for every
    plain k = 0 step), recomputing any position already cached, then drafts k-1 more tokens one by one.
    """

    name = "draft_model"

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.runner: ModelRunner | None = None
        self.lag = 1

    def check_fits(self, target_config: Any) -> None:
        problems = []
        if int(self.model.config.vocab_size) != int(target_config.vocab_size):
            problems.append(f"vocab_size: draft model {self.model.config.vocab_size}, target {target_config.vocab_size}")
        if problems:
            raise ValueError("draft model does not fit the target: " + "; ".join(problems))
        check_supported(self.model.config)

    def setup(self, max_slots: int, cache_len: int, device: torch.device) -> None:
        self.runner = ModelRunner(self.model, max_slots, cache_len)

    def prefill(self, tokens, lengths, slot0, aux) -> None:
        if tokens.shape[1] > 1:
            start = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
            self.runner.forward(tokens[:, :-1], start, slot0)

    def propose(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        L = batch.lengths
        w = min(self.lag, batch.max_length)
        start = (L - w).clamp(min=0)
        idx = start[:, None] + torch.arange(w, device=L.device)
        logits, _ = self.runner.forward(batch.tokens.gather(1, idx), start, max_pos=batch.max_length - 1)
        last = (L - 1 - start)[:, None, None].expand(-1, 1, logits.shape[-1])
        d, q = _draw(logits.gather(1, last)[:, 0], batch, 0)
        drafts, qs = [d], [q]
        for j in range(1, k):
            logits, _ = self.runner.forward(d[:, None], L + j - 1, max_pos=batch.max_length + j - 1)
            d, q = _draw(logits[:, 0], batch, j)
            drafts.append(d)
            qs.append(q)
        self.lag = 2
        return torch.stack(drafts, 1), torch.stack(qs, 1)

    def observe(self, batch, k, tokens, n_acc, aux) -> None:
        if k == 0:
            self.lag += 1

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, upto: int | None = None) -> None:
        self.runner.move_slots(src, dst, upto)


class Eagle3Proposer(Proposer):
    """Runs a `drafter_trainer.model.Eagle3Module` inside the engine.

    The forward is our own over the module's weights and a bucketed slice of a compacted per-slot cache
    (the module's cached forward gathers the whole cache per call); `tests/test_engine_misc.py` checks it
    against the module's forward. After each verify, `observe` catches up the pairs (target aux state at
    t, token at t+1) for the verified positions and keeps the output at the last one: the first draft of
    the next step comes from it without another forward.
    """

    name = "eagle3"
    needs_aux = True
    drafts_trees = True

    def __init__(self, drafter: torch.nn.Module, target: torch.nn.Module | None = None):
        self.drafter = drafter.eval()
        if target is not None and drafter.embed_tokens is None:
            drafter.set_target_embedding(target.get_input_embeddings())
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        self.next_logits: torch.Tensor | None = None
        self.next_hidden: torch.Tensor | None = None
        self._step_forward = self.step  # the decode steps' forward (`configure`: a graph pool's replays)

    def check_fits(self, target_config: Any) -> None:
        self.drafter.check_fits(target_config)
        if self.drafter.embed_tokens is None:
            raise ValueError("the EAGLE-3 drafter has no token embedding: pass target= or call set_target_embedding")

    def setup(self, max_slots: int, cache_len: int, device: torch.device) -> None:
        d, cfg = self.drafter, self.drafter.config
        self.cfg = cfg
        self.H, self.Hq, self.Hk, self.D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        w = d.fc.weight
        self.dtype = w.dtype
        ml = d.midlayer
        a, m = ml.self_attn, ml.mlp
        eps = {ml.input_layernorm.eps, ml.hidden_norm.eps, ml.post_attention_layernorm.eps}
        if len(eps) != 1:
            raise ValueError(f"EAGLE-3 midlayer norms with different eps {sorted(eps)} are not supported")
        self.eps = eps.pop()
        with torch.no_grad():
            # the norm weights are folded into the next matmul's columns (as in rollout.model_runner): the
            # embedding and hidden norms into qkv (its input is their concatenation), the post-attention
            # norm into gate/up
            in_w = torch.cat([ml.input_layernorm.weight, ml.hidden_norm.weight])
            self.qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) * in_w
            self.gate_up_w = torch.cat([m.gate_proj.weight, m.up_proj.weight]) * ml.post_attention_layernorm.weight
            pos = torch.arange(cache_len, device=w.device)[None]
            cos, sin = d.rotary(pos, self.dtype)
        # the target runner's layout and RoPE form (rollout.model_runner): RoPE over all of q|k|v, k|v heads in
        # one cache tensor written once per step. The per-head tables are kept for every position (a drafter
        # step is small, and building them per call would cost two cats each time)
        self.cos, self.sin = qkv_rope_tables(cos[0], signed_sin(sin[0]), self.Hq + self.Hk, self.Hk)
        self.kv_cache = torch.zeros((max_slots, 2 * self.Hk, cache_len, self.D), dtype=self.dtype, device=w.device)
        self.next_logits = torch.zeros(max_slots, cfg.draft_vocab_size, dtype=torch.float32, device=w.device)
        self.next_hidden = torch.zeros(max_slots, self.H, dtype=self.dtype, device=w.device)
        self.draft_ids = d.draft_ids_in_target()
        self.vocab_size = cfg.vocab_size
        self.cache_len = cache_len
        self._arange = torch.arange(cache_len, device=w.device)

    def configure(self, *, step_forward=None) -> Eagle3Proposer:
        """Set the forward `observe`, `propose` and `propose_tree` run: `step`'s contract (a graph pool's
        `draft_step` replays captured graphs); None: the eager `step` (prefill always runs it). Returns self."""
        self._step_forward = self.step if step_forward is None else step_forward
        return self

    @property
    def step_forward(self):  # read-only: set it with `configure`
        return self._step_forward

    @torch.inference_mode()
    def step(self, hidden, input_ids, pos, slot0: int = 0, max_pos: int | None = None, slots=None,
             tree_start=None, anc=None) -> torch.Tensor:
        """Our forward of the drafter up to its hidden output [B,T,H] (the pre-norm residual); `head` turns
        the rows that are needed into logits. Token t is at position pos[:, t] and cached there, or, for tree
        nodes, cached in `slots` [B,T] and attending to the context before slot `tree_start` [B] and to the tree
        slots its `anc` [B,T,N] row marks (rollout.model_runner.tree_allowed)."""
        d = self.drafter
        ml = d.midlayer
        B, T = input_ids.shape
        H, D = self.H, self.D
        emb = F.embedding(input_ids, d.embed_tokens.weight).to(self.dtype)
        # both halves normalised in one pass over [B, T, 2, H]; their weights live in qkv_w
        x = unit_rms_norm(torch.stack([emb, hidden], 2), self.eps).view(B, T, 2 * H)
        Hq, Hk = self.Hq, self.Hk
        qkv = F.linear(x, self.qkv_w).view(B, T, Hq + 2 * Hk, D)
        qkv = rope(qkv, self.cos[pos], self.sin[pos])
        kv = self.kv_cache[slot0 : slot0 + B]
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        write = pos if slots is None else slots
        kv[rows, :, write] = qkv[:, :, Hq:]
        max_pos = int(write.max()) if max_pos is None else max_pos
        Lk = min(self.cache_len, (max_pos // 64 + 1) * 64)
        key_pos = torch.arange(Lk, device=pos.device)
        allowed = key_pos[None, None, :] <= pos[:, :, None] if anc is None else tree_allowed(key_pos, tree_start, anc)
        mask = attention_mask(allowed[:, None], Hq // Hk, self.dtype)
        with attention_backends(pos.device):  # no per-shape cuDNN plan builds (model_runner)
            o = gqa_attention(qkv[:, :, :Hq].transpose(1, 2), kv[:, :Hk, :Lk], kv[:, Hk:, :Lk], mask)
        out = hidden + F.linear(o.transpose(1, 2).reshape(B, T, self.Hq * D), ml.self_attn.o_proj.weight)
        g, u = F.linear(unit_rms_norm(out, self.eps), self.gate_up_w).chunk(2, -1)
        return out + F.linear(F.silu(g) * u, ml.mlp.down_proj.weight)

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits (float32, draft vocabulary) from hidden outputs: only of the rows a draft is taken
        from, since the draft vocabulary's lm_head is the drafter's largest matmul."""
        d = self.drafter
        return F.linear(unit_rms_norm(out, d.norm.eps) * d.norm.weight, d.lm_head.weight).float()

    def _to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        if draft_logits.shape[-1] == self.vocab_size:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.draft_ids] = draft_logits
        return out

    @torch.inference_mode()
    def prefill(self, tokens, lengths, slot0, aux) -> None:
        n, T = tokens.shape
        if T < 2:
            self.next_logits[slot0 : slot0 + n] = 0  # no context yet: a uniform first guess
            self.next_hidden[slot0 : slot0 + n] = 0
            return
        # pairs (aux state at t, token t+1) for t = 0..T-2; rows shorter than T hold garbage past L-2
        hidden = self.drafter.project(aux[:, : T - 1])
        pos = torch.arange(T - 1, device=tokens.device)[None].expand(n, T - 1)
        out = self.step(hidden, tokens[:, 1:], pos, slot0)
        last = (lengths - 2).clamp(min=0)
        out = out[torch.arange(n, device=tokens.device), last]
        self.next_logits[slot0 : slot0 + n] = self.head(out)
        self.next_hidden[slot0 : slot0 + n] = out

    @torch.inference_mode()
    def observe(self, batch, k, tokens, n_acc, aux) -> None:
        n = batch.n
        pos = (batch.lengths - 1)[:, None] + self._arange[: k + 1]
        hidden = F.linear(aux.to(self.dtype), self.drafter.fc.weight)  # = drafter.project, minus the module call
        out = self._step_forward(hidden, tokens, pos, max_pos=batch.max_length - 1 + k)
        out = out.gather(1, n_acc[:, None, None].expand(n, 1, self.H))[:, 0]  # at the last accepted position
        self.next_logits[:n] = self.head(out)
        self.next_hidden[:n] = out

    @torch.inference_mode()
    def propose(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, L = batch.n, batch.lengths
        d, q = _draw(self._to_target(self.next_logits[:n]), batch, 0)
        hidden = self.next_hidden[:n]
        drafts, qs = [d], [q]
        for j in range(1, k):
            hidden = self._step_forward(hidden[:, None], d[:, None], (L + j - 2)[:, None],
                                        max_pos=batch.max_length + j - 2)[:, 0]
            d, q = _draw(self._to_target(self.head(hidden)), batch, j)
            drafts.append(d)
            qs.append(q)
        if k == 1:  # views, not copies
            return d[:, None], q[:, None]
        return torch.stack(drafts, 1), torch.stack(qs, 1)

    # -- trees -------------------------------------------------------------------------------------------------
    def _children(self, logits: torch.Tensor, batch: Batch, d: int, width: int,
                  log_race: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The `width` likeliest children of each node whose draft logits (draft vocabulary) are `logits` [n, T, Vd],
        at tree depth d + 1 (position L + d): (tokens [n, T, width], their log-probabilities [n, T, width]).
        Likeliest means by the draft distribution q the row samples with (temperature, top-k, top-p), or, under
        the coupled rule, by q / e with the target's race noise e of that position (`log_race`: log e of the step's
        positions, taken once per tree), so the first child is the one a chain would draft (a greedy row: by the
        raw logits). Deterministic given the context and the noise, so the verify rules stay exact
        (rollout/sampling.py)."""
        z = self._to_target(logits)
        if not batch.any_sampled:
            top = z.topk(width, dim=-1).indices
            return top, torch.log_softmax(z, -1).gather(-1, top)
        q = process(z, batch.temperature, batch.top_k, batch.top_p, True, batch.any_greedy,
                    batch.any_truncated, batch.any_scaled)
        lq = q.log()
        rank_by = lq if log_race is None else lq - log_race[:, d, None]
        if batch.any_greedy:  # greedy rows rank by the raw logits and score by the raw log-probabilities
            greedy = (batch.temperature == 0)[:, None, None]
            rank_by = torch.where(greedy, z, rank_by)
            lq = torch.where(greedy, torch.log_softmax(z, -1), lq)
        top = rank_by.topk(width, dim=-1).indices
        return top, lq.gather(-1, top)

    @staticmethod
    def _log_race(batch: Batch) -> torch.Tensor | None:
        return batch.race.log() if batch.any_sampled and batch.race is not None else None

    @torch.inference_mode()
    def propose_tree(self, batch: Batch, strategy: Strategy) -> TreeDraft:
        """Draft a token tree per row, level by level: the root's children from the logits kept at the last verify,
        then one drafter forward per level over the nodes that get children, each node cached in drafter slot
        L - 2 + its index and attending to its ancestors (a chain's layout when the tree is a chain). Static trees
        expand the nodes their topology names; dynamic trees the `topk` likeliest frontier nodes by cumulative
        log-probability, and verify the `nodes` likeliest of all they drafted (EAGLE-2)."""
        n, L = batch.n, batch.lengths
        dev = L.device
        if strategy.kind == "dynamic":
            return self._dynamic_tree(batch, strategy)
        topo = static_topology(strategy, dev)
        m = topo.parent.shape[0]
        log_race = self._log_race(batch)
        tokens = torch.empty(n, m, dtype=torch.long, device=dev)
        tokens[:, 0] = batch.tokens.gather(1, (L - 1)[:, None])[:, 0]
        hidden_of = torch.empty(n, m, self.H, dtype=self.dtype, device=dev)  # a node's, once it has children
        hidden_of[:, 0] = self.next_hidden[:n]
        anc = topo.anc[None].expand(n, m, m)
        start = L - 2
        base = start[:, None]
        for d, level in enumerate(topo.levels):
            if d == 0:
                logits = self.next_logits[:n, None]
            else:
                w = level.expand.shape[0]
                out = self._step_forward(hidden_of[:, level.expand_parent], tokens[:, level.expand],
                                         (base + d).expand(n, w), slots=base + level.expand, tree_start=start,
                                         anc=level.anc_rows.expand(n, w, m), max_pos=batch.max_length - 2 + m)
                hidden_of[:, level.expand] = out
                logits = self.head(out)
            top, _ = self._children(logits, batch, d, strategy.branching[d], log_race)
            tokens[:, level.kids] = top[:, level.kid_source, level.kid_rank]
        return TreeDraft(tokens=tokens, parent=topo.parent[None].expand(n, m), depth=topo.depth[None].expand(n, m),
                         rank=topo.rank[None].expand(n, m), anc=anc, children=topo.children[None].expand(n, -1, -1))

    def _dynamic_tree(self, batch: Batch, strategy: Strategy) -> TreeDraft:
        """EAGLE-2 drafting. Nodes are numbered by level: the root 0, the root's K children 1..K, then each later
        level's K x K children in one block, the r-th child of the level's j-th expanded node at block offset
        j * K + r. Each level is carried as block tensors (tokens, cumulative scores, the expanded nodes' drafter
        outputs) and the whole tables are put together once at the end; ranks and depths depend on the shape only
        (`tree.dynamic_layout`)."""
        n, L = batch.n, batch.lengths
        dev, K, D = L.device, strategy.topk, strategy.depth
        layout = dynamic_layout(strategy, dev)
        m = layout.depth.shape[1]
        log_race = self._log_race(batch)
        top, lq = self._children(self.next_logits[:n, None], batch, 0, K, log_race)
        tok_f, score_f = top[:, 0], lq[:, 0]  # the frontier: the last level's block [n, F]
        toks, scores, expanded = [batch.tokens.gather(1, (L - 1)[:, None]), tok_f], [score_f.new_zeros(n, 1), score_f], []
        anc = layout.anc.expand(n, m, m).clone()  # each node and the root; a new block adds its parents' rows
        start = L - 2
        base = start[:, None]
        out = self.next_hidden[:n, None]  # the drafter outputs of the nodes the last level expanded: the root's
        first_f = 1  # the frontier block's first node
        for d in range(1, D):
            # expand the K likeliest nodes of the last level
            pick = score_f.topk(K, dim=-1).indices  # [n, K], offsets in the frontier block
            nodes = pick + first_f
            # a frontier node's parent is the (offset // K)-th node the last level expanded (the first level's: the root)
            hidden = out.gather(1, (pick // K)[..., None].expand(n, K, self.H))
            rows = anc.gather(1, nodes[..., None].expand(n, K, m))
            out = self._step_forward(hidden, tok_f.gather(1, pick), (base + d).expand(n, K), slots=base + nodes,
                                     tree_start=start, anc=rows, max_pos=batch.max_length - 2 + m)
            top, lq = self._children(self.head(out), batch, d, K, log_race)  # [n, K, K]
            first_f = 1 + K + (d - 1) * K * K
            anc[:, first_f : first_f + K * K].view(n, K, K, m).logical_or_(rows[:, :, None])
            score_f = (score_f.gather(1, pick)[:, :, None] + lq).reshape(n, K * K)
            tok_f = top.reshape(n, K * K)
            toks.append(tok_f)
            scores.append(score_f)
            expanded.append(nodes)
        parent = layout.parent.expand(n, m)
        if expanded:  # a block's parents: its level's expanded nodes, each K times
            parent = torch.cat([parent[:, : 1 + K],
                                torch.stack(expanded, 1)[..., None].expand(n, D - 1, K, K).reshape(n, m - 1 - K)], 1)
        return select_dynamic(torch.cat(toks, 1), parent, layout.depth.expand(n, m), layout.rank.expand(n, m),
                              torch.cat(scores, 1), anc, strategy.nodes, K)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, upto: int | None = None) -> None:
        self.kv_cache[dst, :, :upto] = self.kv_cache[src, :, :upto]  # upto None: every position
        for t in (self.next_logits, self.next_hidden):
            t[dst] = t[src]
