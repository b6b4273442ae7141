"""The native rollout engine: continuous batching over a static KV cache, exact speculative decoding.

One decode step, for the running rows 0..n-1 (kept compacted by SlotTable):
  s = selector(n, last)                                    selector: a Strategy (an int: a chain's k; 0 none)
  drafts, q = drafter.propose(batch, k)                     chain: [n, k], [n, k, V] or None
  logits = target([last token, drafts] at L-1 .. L-1+k)     one verify forward, fixed width k+1
  tokens, n_acc = verify(p, q, drafts, uniforms)            exact speculative sampling, ragged acceptance
                                                            (verify_rule "coupled": the drafter-invariant race)
  emit tokens[: n_acc+1] cut at the first stop id / max_tokens; lengths += emitted
A tree strategy (rollout/tree.py: `tree_step`) drafts a token tree per row, verifies all its nodes in the same one
forward (each attending to its ancestors), walks the accepted path and emits it like a chain of the tree's depth.
Rejected drafts need no KV rollback: their entries sit past the row's length and are overwritten before
anything attends to them. Prefill caches positions 0..L-2 only; the last prompt token is the first verify
input, so the first response token is speculated like every other.

Host syncs per step: one `.tolist()` of three numbers (any finished, accepted, max length), plus, in a step
that finishes requests, four for all of them together (which rows, their int columns, tokens, logprobs). No
Python loop runs over the rows of the batch on the hot path. Each step ends in one
frozen `StepRecord` (rows, k, its run at k, accepted drafts, per-position reach, seconds): `last`, the bounded
`history`, and what the selector is handed before the next step.

Configuration: the selector and the verify forward's seam are set at construction or through
`configure` (the cost model's warm-up swaps hooks, a graph pool installs its replays); nothing outside the
engine assigns its attributes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from tailspec.rollout import prefill, sampling, tree
from tailspec.rollout.drafters import Proposer
from tailspec.rollout.model_runner import ModelRunner, check_supported
from tailspec.rollout.sequence import RequestOutput, RequestStats, SamplingParams, check_request
from tailspec.rollout.slots import (
    ACCEPTED,
    DRAFTED,
    FWD,
    GEN,
    KEY,
    LEN,
    MAX_TOKENS,
    PROMPT_LEN,
    TEMP,
    TOP_K,
    TOP_P,
    Batch,
    SlotTable,
)
from tailspec.rollout.states import StateRecorder
from tailspec.rollout.strategy import Selector, StepRecord, Strategy
from tailspec.rollout.table_selector import fixed_selector

NONE = Strategy.none()

# the verify forward's seam: ModelRunner.forward's contract, (ids, start, slot0, max_pos, want_aux) -> (logits, aux)
VerifyForward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
# sampling.verify (the residual rule: highest acceptance) or sampling.verify_coupled (the same tokens whatever
# the drafter and k: a run with speculation samples the very rollouts of a run without it)
VERIFY_RULES = ("residual", "coupled")


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        drafter: Proposer | None = None,
        *,
        selector: Selector | int = 0,
        max_batch: int = 64,
        max_seq_len: int = 1024,
        k_max: int = 8,
        max_tree_nodes: int = 128,
        max_stop_ids: int = 8,
        seed: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
        history: int = 1024,
        verify_rule: str = "residual",
        record_states: bool = False,
    ):
        cfg = model.config
        check_supported(cfg)
        if min(max_batch - 1, max_seq_len - 2, k_max, max_tree_nodes) < 0:
            raise ValueError(f"need max_batch >= 1, max_seq_len >= 2, k_max, max_tree_nodes >= 0; got {max_batch}, "
                             f"{max_seq_len}, {k_max}, {max_tree_nodes}")
        if verify_rule not in VERIFY_RULES:
            raise ValueError(f"verify_rule must be one of {VERIFY_RULES}, got {verify_rule!r}")
        if drafter is not None:
            drafter.check_fits(cfg)  # a misfit drafter is refused before any compute
        self.verify_rule, self.model = verify_rule, model.eval()
        self.vocab_size = int(cfg.vocab_size)
        self.max_batch, self.max_seq_len, self.k_max = max_batch, max_seq_len, k_max
        # a tree strategy's depth is at most k_max; every node it drafts takes a cache slot during the step
        self.max_tree_nodes = max_tree_nodes if (drafter is not None and drafter.drafts_trees) else 0
        self.max_stop_ids = max_stop_ids
        eos = eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", None)
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        self.drafter = drafter
        self._selector = self._hook(selector)

        cache_len = max_seq_len + max(k_max, self.max_tree_nodes) + 1
        aux_ids = drafter.aux_layer_ids if (drafter is not None and drafter.needs_aux) else None
        self.runner = ModelRunner(model, max_batch, cache_len, aux_layer_ids=aux_ids)
        self._verify_forward: VerifyForward = self.runner.forward  # a graph pool's replays, through configure
        self.device = self.runner.device
        self.slots = SlotTable(max_batch, cache_len + k_max + 2, max_seq_len + k_max + 2, max_stop_ids, self.device)
        if drafter is not None:
            drafter.setup(max_batch, cache_len, self.device)
        self.recorder = None  # each request's aux states and logits (rollout/states.py), when asked for
        if record_states:
            if aux_ids is None:
                raise ValueError("record_states needs a drafter that reads the target's aux states (EAGLE-3)")
            self.recorder = StateRecorder(max_batch, cache_len + k_max + 1, max_seq_len + k_max + 2,
                                          len(aux_ids) * cfg.hidden_size, self.vocab_size, self.device, self.runner.dtype)
        self.waiting: deque[tuple[int, list[int], SamplingParams]] = deque()
        self.last: StepRecord | None = None  # the latest decode step
        self.history: deque[StepRecord] = deque(maxlen=history)  # the latest `history` decode steps
        self._next_id = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._batch: Batch | None = None
        self._max_length = 0
        self._arange = torch.arange(k_max + 2, device=self.device)
        self._fwd_drafted: dict[int, torch.Tensor] = {}  # drafted tokens per row -> [1, drafted]

    # -- configuration ---------------------------------------------------------------------------------------
    def configure(self, *, selector: Selector | int | None = None, verify_forward: VerifyForward | None = None) -> Engine:
        """Change how the engine decodes from its next step on; the one way to, after construction.

        `selector`: the selector (an int: that k at every step; k > 0 needs a drafter). `verify_forward`:
        the verify forward's seam, ModelRunner.forward's contract (a graph pool's `forward` replays captured
        graphs; `engine.runner.forward` is eager). An argument left out keeps what is set. Returns the engine."""
        if selector is not None:
            self._selector = self._hook(selector)
        if verify_forward is not None:
            self._verify_forward = verify_forward
        return self

    def _hook(self, selector: Selector | int) -> Selector:
        if not isinstance(selector, int):
            return selector
        hook = fixed_selector(selector)
        if self.drafter is None and selector > 0:
            raise ValueError(f"k={selector} needs a drafter; pass drafter= or k=0")
        return hook

    @property
    def selector(self) -> Selector:
        """The selector (read-only: set it at construction or with `configure`)."""
        return self._selector

    @property
    def verify_forward(self) -> VerifyForward:
        """The verify forward's seam (read-only: set it with `configure`)."""
        return self._verify_forward

    @property
    def steps(self) -> int:
        """Decode steps run so far."""
        return self.last.step if self.last is not None else 0

    # -- requests ------------------------------------------------------------------------------------------
    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request (nothing is computed before this passes)."""
        check_request(prompt, params, self.vocab_size, self.max_seq_len, self.max_stop_ids,
                      lambda: self._stop_ids(params))

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        stops = tuple(params.stop_token_ids) if params.stop_token_ids is not None else ()
        if not params.ignore_eos:
            stops = stops + tuple(e for e in self.eos_ids if e not in stops)
        return stops

    @staticmethod
    def _as_ids(prompt: Sequence[int]) -> list:
        # numpy / torch integer scalars become ints; anything else is left for validate() to name
        return [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in prompt]

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        prompt = self._as_ids(prompt)
        self.validate(prompt, params)
        return self._enqueue(prompt, params)

    def _enqueue(self, prompt: list[int], params: SamplingParams) -> int:
        rid = self._next_id
        self._next_id += 1
        self.waiting.append((rid, list(prompt), params))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.slots.n > 0

    def abort_all(self) -> int:
        """Drop every waiting and running request without output (e.g. the end of a warm-up). Returns how
        many were dropped. Slot state past the running count is stale by design, so nothing else is reset."""
        dropped = len(self.waiting) + self.slots.n
        self.waiting.clear()
        s = self.slots
        for lst in (s.request_ids, s.prompts, s.temps, s.truncated):
            lst.clear()
        s.n = 0
        self._batch = None
        self._max_length = 0
        return dropped

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run the given prompts to completion; outputs in input order. Every request is validated first."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [(self._as_ids(p), sp) for p, sp in zip(prompts, plist)]
        for p, sp in reqs:
            self.validate(p, sp)
        ids = [self._enqueue(p, sp) for p, sp in reqs]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    # -- admission -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self) -> None:
        """Prefill waiting requests into the free slots now. `step` does this itself first; calling it before
        lets a caller keep prefill out of a decode step's timing (the benchmarks' tokens/s at a batch size)."""
        self._admit()

    def _admit(self) -> None:
        s = self.slots
        m = min(len(self.waiting), self.max_batch - s.n)
        if m == 0:
            return
        reqs = [self.waiting.popleft() for _ in range(m)]
        # seeds drawn in arrival order (a request's draw does not depend on the prefill plan's order)
        drawn = [sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._gen))
                 for _, _, sp in reqs]
        order, chunks = prefill.plan([p for _, p, _ in reqs])
        reqs, drawn = [reqs[i] for i in order], [drawn[i] for i in order]
        slot0 = s.n
        T = max(len(p) for _, p, _ in reqs)
        ncol = s.ints.shape[1]
        tok_rows, int_rows, float_rows, stop_rows = [], [], [], []
        for rid, prompt, sp in reqs:
            tok_rows.append(prompt + [0] * (T - len(prompt)))
            r = [0] * ncol
            r[LEN] = r[PROMPT_LEN] = len(prompt)
            r[MAX_TOKENS], r[TOP_K] = sp.max_tokens, sp.top_k
            int_rows.append(r)
            fr = [0.0] * s.floats.shape[1]
            fr[TEMP], fr[TOP_P] = sp.temperature, sp.top_p
            float_rows.append(fr)
            st = list(self._stop_ids(sp))
            stop_rows.append(st + [-1] * (self.max_stop_ids - len(st)))
            s.request_ids.append(rid)
            s.prompts.append(prompt)
            s.temps.append(float(sp.temperature))
            s.truncated.append(sp.top_k > 0 or sp.top_p < 1)
        ints = torch.tensor(int_rows, dtype=torch.long)
        keys = sampling.seed_mix(torch.tensor(drawn, dtype=torch.long))
        ints[:, KEY] = keys
        toks = torch.tensor(tok_rows, dtype=torch.long, device=self.device)
        rows = slice(slot0, slot0 + m)
        s.tokens[rows, :T] = toks
        s.ints[rows] = ints.to(self.device)
        s.floats[rows] = torch.tensor(float_rows, dtype=torch.float32, device=self.device)
        s.stop_ids[rows] = torch.tensor(stop_rows, dtype=torch.long, device=self.device)
        if any(sp.temperature > 0 for _, _, sp in reqs):  # greedy rows draw nothing
            s.uniforms[rows] = sampling.uniform_table(keys.to(self.device), s.tokens.shape[1])
        s.n += m
        self._prefill(toks, s.ints[rows, LEN], slot0, chunks)
        self._batch = None
        self._max_length = max(self._max_length, T)

    def _prefill(self, toks: torch.Tensor, lengths: torch.Tensor, slot0: int, chunks: list[prefill.Chunk]) -> None:
        """Cache positions 0..L-2 of the admitted rows (slots slot0..) chunk by chunk (rollout/prefill.py): each
        chunk's distinct prompts in one forward at its own width, then its repeated prompts by a slot copy."""
        need_aux = self.drafter is not None and self.drafter.needs_aux
        for c in chunks:
            a, u = c.start, c.start + c.unique
            part, aux = toks[a:u, : c.width], None
            if c.width > 1:
                start = torch.zeros(c.unique, dtype=torch.long, device=self.device)
                _, aux = self.runner.forward(part[:, :-1], start, slot0 + a, want_aux=need_aux)
                if self.recorder is not None:
                    self.recorder.prefill(slot0 + a, aux)
            if self.drafter is not None:
                self.drafter.prefill(part, lengths[a:u], slot0 + a, aux)
            if c.sources:
                src = torch.tensor(c.sources, device=self.device) + slot0
                dst = torch.arange(u, c.end, device=self.device) + slot0
                self.runner.move_slots(src, dst, upto=c.width - 1)
                for holder in (self.drafter, self.recorder):
                    if holder is not None:
                        holder.move_slots(src, dst)

    # -- one decode step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.waiting and self.slots.n < self.max_batch:
            self._admit()
        n = self.slots.n
        if n == 0:
            return []
        # the step's seconds run from here to after its finished requests are handed out: what a step at this k
        # costs the rollout (the batch rebuilt after a change of rows, the selector, the finishing), not
        # the draft and verify alone; on a GPU with replayed graphs the rest is a large share of a step
        t_step = time.perf_counter()
        if self._batch is None:
            self._batch = self.slots.batch(self._max_length)
        batch = self._batch
        batch.max_length = self._max_length
        strategy = self._strategy(n)
        k = strategy.depth
        out, n_acc, logits, p, ranks = self._draft_and_verify(batch, n, strategy)
        done, stopped, accepted = self._emit(batch, n, k, strategy.nodes, out, n_acc, logits, p)
        head = torch.stack([done.sum(), accepted.sum(), batch.lengths.max()])
        if k > 0:  # rows whose path reached depth j + 1, j < k: the selector's per-depth acceptance
            head = torch.cat([head, (n_acc[:, None] > self._arange[None, :k]).sum(0)])
        if ranks is not None:  # per (depth, sibling rank): rows that had the child, rows that accepted it
            head = torch.cat([head, ranks[0].flatten(), ranks[1].flatten()])
        any_done, acc_sum, max_len, *rest = head.tolist()
        reach, rank_trials, rank_accepted = rest[:k], (), ()
        if ranks is not None:
            width = ranks[0].shape[1]
            flat_t, flat_a = rest[k : k + k * width], rest[k + k * width :]
            rank_trials = [flat_t[d * width : (d + 1) * width] for d in range(k)]
            rank_accepted = [flat_a[d * width : (d + 1) * width] for d in range(k)]
        self._max_length = max_len
        outs = self._finish(done, stopped) if any_done else []
        self.last = StepRecord.following(self.last, n, strategy, acc_sum, reach, time.perf_counter() - t_step,
                                         rank_trials, rank_accepted)
        self.history.append(self.last)
        return outs

    def _strategy(self, n: int) -> Strategy:
        """The hook's strategy for this step: an int is a chain's k (clipped to k_max, as ever); a tree needs a
        drafter that drafts trees and must fit the engine's k_max and max_tree_nodes (a clear error otherwise)."""
        if self.drafter is None:
            return NONE
        s = self._selector(n, self.last)
        if isinstance(s, Strategy) and s.is_tree:
            self.check_strategy(s)
            return s
        k = s.depth if isinstance(s, Strategy) else int(s)
        return Strategy.chain(max(0, min(k, self.k_max)))

    def check_strategy(self, strategy: Strategy) -> None:
        """Raise ValueError naming why this engine cannot run `strategy` (nothing is computed before)."""
        if strategy.speculates and self.drafter is None:
            raise ValueError(f"{strategy.label} needs a drafter")
        if strategy.is_tree:
            tree.check_tree(strategy, self.drafter, self.k_max, self.max_tree_nodes)

    def _draft_and_verify(self, batch: Batch, n: int, strategy: Strategy):
        """Draft and verify in one target forward: a chain of k tokens (width k + 1) or a token tree (its nodes + 1).
        Returns the step's tokens [n, depth + 1] (accepted drafts, then the target's token at n_acc), n_acc [n], the
        target's logits and processed distribution p at the accepted path's positions [n, depth + 1, V], and for a
        tree its (rank_trials, rank_accepted) [depth, R] tensors (None for a chain)."""
        k = strategy.depth
        L = batch.lengths
        last = batch.tokens.gather(1, (L - 1)[:, None])
        coupled = batch.any_sampled and self.verify_rule == "coupled"
        batch.race = batch.u_draft = None
        if coupled:  # one Gumbel race per verify position, shared by the drafter and the target
            batch.race = sampling.race_noise(batch.key, L[:, None] + self._arange[: k + 1], self.vocab_size)
        elif batch.any_sampled:  # every uniform of the step in one gather from the rows' tables
            batch.u_draft, u_acc, u_smp = sampling.step_uniforms_from(batch.uniforms, L, k)
        else:
            u_acc = torch.zeros(n, k, dtype=torch.float64, device=self.device)
            u_smp = torch.zeros(n, k + 1, dtype=torch.float64, device=self.device)
        need_aux = self.drafter is not None and self.drafter.needs_aux
        if strategy.is_tree:
            return tree.tree_step(self, batch, strategy, coupled, None if coupled else u_smp, need_aux)
        if k > 0:
            drafts, q = self.drafter.propose(batch, k)
            inp = torch.cat([last, drafts], 1)
        else:
            drafts, q, inp = last[:, :0], None, last
        logits, aux = self._verify_forward(inp, L - 1, max_pos=self._max_length - 1 + k, want_aux=need_aux)
        p = self.processed(logits, batch)
        if coupled:
            out, n_acc = sampling.verify_coupled(p, drafts, batch.race)
        else:
            out, n_acc = sampling.verify(p, q, drafts, u_acc, u_smp)
        self.after_verify(batch, k, out, n_acc, aux, logits)
        return out, n_acc, logits, p, None

    def processed(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The target's processed distributions (each row's temperature, top-k, top-p) from verify logits."""
        return sampling.process(
            logits, batch.temperature, batch.top_k, batch.top_p, batch.any_sampled, batch.any_greedy, batch.any_truncated,
            batch.any_scaled,
        )

    def after_verify(self, batch: Batch, k: int, out, n_acc, aux, logits) -> None:
        """The drafter and the state recorder see a verify's accepted path (a tree's as a chain of its depth)."""
        if self.drafter is not None:
            self.drafter.observe(batch, k, out, n_acc, aux)
        if self.recorder is not None:
            self.recorder.step(batch.lengths, self.slots.ints[:batch.n, GEN], aux, logits)

    def _emit(self, batch: Batch, n: int, k: int, drafted: int, out, n_acc, logits, p):
        """Write the step's tokens and logprobs into the slots, cut after the first stop id and at max_tokens,
        and count them. Returns per row: done, stopped (by a stop id), drafts accepted and emitted."""
        s, L = self.slots, batch.lengths
        j = self._arange[: k + 1]
        pos = L[:, None] + j  # positions of the k+1 candidate tokens
        raw_lp = torch.log_softmax(logits, -1).gather(-1, out[..., None])[..., 0]
        if batch.any_greedy or batch.any_scaled or batch.any_truncated:
            smp_lp = p.gather(-1, out[..., None])[..., 0].log()
        else:  # every row samples the raw distribution: the sampling logprob is the raw one
            smp_lp = raw_lp
        is_stop = (out[..., None] == s.stop_ids[:n, None, :]).any(-1) & (j[None] <= n_acc[:, None])
        first_stop = torch.where(is_stop, j[None], k + 1).amin(-1)
        gen = s.ints[:n, GEN]
        remaining = s.ints[:n, MAX_TOKENS] - gen
        n_emit = torch.minimum(torch.minimum(n_acc + 1, first_stop + 1), remaining)
        stopped = first_stop < n_emit
        done = stopped | (n_emit >= remaining)

        s.tokens[:n].scatter_(1, pos, out)
        lp_pos = gen[:, None] + j
        s.logprobs[:n, 0].scatter_(1, lp_pos, raw_lp)
        s.logprobs[:n, 1].scatter_(1, lp_pos, smp_lp)
        accepted = torch.minimum(n_acc, n_emit)
        # the int columns in three ops: LEN|GEN side by side, FWD|DRAFTED by a constant, ACCEPTED
        s.ints[:n, LEN : GEN + 1] += n_emit[:, None]
        per_row = self._fwd_drafted.get(drafted)
        if per_row is None:
            per_row = self._fwd_drafted[drafted] = torch.tensor([1, drafted], device=self.device)
        s.ints[:n, FWD : DRAFTED + 1] += per_row
        s.ints[:n, ACCEPTED] += accepted
        return done, stopped, accepted

    def _finish(self, done: torch.Tensor, stopped: torch.Tensor) -> list[RequestOutput]:
        s = self.slots
        idx_t = done.nonzero()[:, 0]
        # slot, stop flag and the int columns of every finished row in one read (each read is a device sync)
        head = torch.cat([idx_t[:, None], stopped[idx_t, None].long(), s.ints[idx_t]], 1).tolist()
        idx, stop_flags, rows = [h[0] for h in head], [bool(h[1]) for h in head], [h[2:] for h in head]
        width = max(r[LEN] for r in rows)
        toks = s.tokens[idx_t, :width].tolist()
        gmax = max(r[GEN] for r in rows)
        lps = s.logprobs[idx_t, :, :gmax].tolist()
        states = None if self.recorder is None else self.recorder.take(idx_t, [r[LEN] for r in rows], [r[GEN] for r in rows])
        outs = []
        for n, (i, was_stop, row) in enumerate(zip(idx, stop_flags, rows)):
            g, ln, pl = row[GEN], row[LEN], row[PROMPT_LEN]
            outs.append(
                RequestOutput(
                    request_id=s.request_ids[i],
                    prompt_token_ids=s.prompts[i],
                    token_ids=toks[n][pl:ln],
                    logprobs=lps[n][0][:g],
                    sampling_logprobs=lps[n][1][:g],
                    finish_reason="stop" if was_stop else "length",
                    stats=RequestStats(row[FWD], row[DRAFTED], row[ACCEPTED]),
                    states=states[n] if states is not None else None,
                )
            )
        moved = s.compact(idx)  # the last running rows into the freed slots, their caches below the longest length
        if moved is not None:  # (a whole slot is max_seq_len long: 10 MB on the deep preset)
            for holder in (self.runner, self.drafter, self.recorder):
                if holder is not None:
                    holder.move_slots(*moved, upto=self._max_length)
        self._batch = None
        if s.n == 0:
            self._max_length = 0
        return outs
