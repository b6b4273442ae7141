"""Our own forward over an HF causal LM's weights (Llama / Qwen2 / Qwen3), with a static per-slot KV cache.

Why not HF's forward: HF's cache API keeps one position per batch, while speculative decoding leaves every
row at its own position after ragged acceptance. Here every row carries its own start position, and the
KV cache is one pre-allocated tensor per layer, `[max_slots, 2 * kv_heads, cache_len, head_dim]` (k heads,
then v heads): a row writes k/v at its positions and attends to every cached position <= its own.
Rollback is free: rejected drafts' k/v sit beyond the row's length and are overwritten by the next forward
before anything attends to them.

Rows of a forward are a contiguous range of slots (`slot0 .. slot0 + B - 1`): the engine keeps running
requests compacted at the front of the cache, so a decode step reads a plain slice of it.

Weights are the HF module's own tensors (no copy), except q/k/v and gate/up, which are concatenated once
so that one matmul replaces three (or two), with the RMSNorm weight in front of each folded into its
columns — the per-op dispatch cost dominates tiny models on a CPU. Those copies are taken at construction:
after a policy update, build a new runner (the demo's rollout worker builds an Engine per phase).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# cuDNN's attention builds an execution plan the first time it meets a shape: tens of milliseconds for every new
# row count or attended length, which a long tail meets at every finished request, so the builds would be much
# of a cold rollout. The memory-efficient kernel takes the same mask without a per-shape build; flash and math
# stay allowed so a CPU picks what it always picked.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# The memory-efficient kernel needs as many key/value heads as query heads, so with grouped-query attention
# (`enable_gqa`) and cuDNN excluded SDPA falls back to the math kernel, far slower than cuDNN's on a GPU. A
# group's query heads are folded into the query length instead (`attention_mask`, `gqa_attention`), which every
# kernel takes without copying the cache's keys and values. On a CPU, where the flash kernel takes `enable_gqa`,
# the fold makes the forward a little faster at decode shapes but attention then no longer costs what
# `tailspec simulate`'s calibration prices it at (the matmuls' seconds per FLOP): the CPU miniature keeps
# `enable_gqa`.
FOLD_GQA_DEVICES = ("cuda",)


def attention_backends(device: torch.device):
    """The SDPA kernels the engine's forwards may use on `device`: every one but cuDNN's on CUDA. Entered once
    per forward, not per layer, since the context manager's flag flips cost microseconds each."""
    return sdpa_kernel(_SDPA_BACKENDS) if device.type == "cuda" else nullcontext()


def attention_mask(allowed: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (0 where `allowed` [B,1,T,L], -inf elsewhere) for `gqa_attention`, built once per forward
    (a boolean mask is converted inside SDPA at every layer), tiled to [B,1,groups*T,L] where query heads are
    folded: row g*T + t is query token t of the group's g-th head."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return mask.repeat(1, 1, groups, 1) if groups > 1 and allowed.device.type in FOLD_GQA_DEVICES else mask


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of q [B,Hq,T,D] over k, v [B,Hk,L,D], query head h reading key/value head h // (Hq/Hk), as
    `enable_gqa`; `mask` from `attention_mask`. Folded, the Hq/Hk query heads that share a key/value head are
    one head over Hq/Hk times the query tokens (the mask tiled to match), so the kernel sees Hk heads on both
    sides. Returns [B,Hq,T,D]."""
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    if Hq == Hk or mask.shape[2] == T:  # not folded
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hk)
    o = F.scaled_dot_product_attention(q.reshape(B, Hk, (Hq // Hk) * T, D), k, v, attn_mask=mask)
    return o.reshape(B, Hq, T, D)  # the memory-efficient kernel may return [B,T,H,D] strides


def tree_allowed(key_pos: torch.Tensor, start: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """Which cache positions each token of a token tree may attend to, [B, T, Lk] bool: every position before the
    tree's first slot `start` [B] (the row's committed context), and within the tree's slots start .. start + N - 1
    the nodes `anc` [B, T, N] marks (a node's ancestors and itself). Tree node i sits in slot start + i whatever
    its depth, so siblings, which share a position, never share a slot."""
    rel = key_pos[None, :] - start[:, None]  # [B, Lk]
    n_nodes = anc.shape[-1]
    inside = anc.gather(2, rel.clamp(0, n_nodes - 1)[:, None, :].expand(-1, anc.shape[1], -1))
    return (rel < 0)[:, None, :] | (inside & (rel < n_nodes)[:, None, :])


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next matmul, or applied by the caller). Four ops;
    F.rms_norm dispatches about twelve on a CPU, and at these sizes every dispatch costs more than the
    arithmetic."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# RoPE in the form both our forwards use. rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin): one roll
# instead of two slices, a negation and a cat. And RoPE runs over every head of the qkv projection at once,
# the v heads with cos 1 / sin 0, so q, k and v stay in one tensor and k|v go to the cache in one write.
def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def qkv_rope_tables(cos: torch.Tensor, sin_signed: torch.Tensor, n_rot: int, n_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / signed sin [..., D] -> [..., n_rot + n_pass, D]: the first n_rot heads rotated, the rest passed."""
    *lead, D = cos.shape
    rot, keep = (*lead, n_rot, D), (*lead, n_pass, D)
    return (
        torch.cat([cos.unsqueeze(-2).expand(rot), cos.new_ones(()).expand(keep)], -2),
        torch.cat([sin_signed.unsqueeze(-2).expand(rot), sin_signed.new_zeros(()).expand(keep)], -2),
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def check_supported(config) -> None:
    """Raise ValueError naming what this forward cannot run (before any weights are touched)."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported by the native engine; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "use_sliding_window", False) or (
        mt == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        raise ValueError("sliding-window attention is not supported by the native engine (set use_sliding_window=False)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")


def _fused_layer(layer: torch.nn.Module) -> _Layer:
    """One decoder layer's weights as the runner uses them: q, k, v concatenated into one matrix and gate, up
    into another. The RMSNorm weights before qkv and gate/up are folded into those matrices' columns:
    rms(x) * w @ W.T == rms(x) @ (W * w).T, one op less per norm."""
    a, m = layer.self_attn, layer.mlp
    bias = a.q_proj.bias is not None
    in_w, post_w = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
    return _Layer(
        qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) * in_w,
        qkv_b=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if bias else None,
        q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
        k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
        o_w=a.o_proj.weight,
        o_b=a.o_proj.bias,
        gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]) * post_w,
        down_w=m.down_proj.weight,
    )


class ModelRunner:
    """Forward of a causal LM over a static KV cache with ragged per-row positions.

    `forward(input_ids [B,T], start [B], slot0)` processes token t of row b at position start[b] + t in slot
    slot0 + b and returns logits [B,T,V] (float32) and, when `aux_layer_ids` is set, the concatenated hidden
    states of those layers [B,T,len(ids)*H]: id j = the residual stream after j layers, before the final
    norm (0 = embeddings) — drafter_trainer.model's convention (its `capture_aux`), so the engine feeds the
    EAGLE-3 drafter exactly the tensors it was trained on.

    With `tree` = (depth [B,T], anc [B,T,T]) the T tokens of each row are a token tree (token 0 its root): token t
    at position start + depth[t] but cached in slot start + t, attending to the context and to the tokens anc[t]
    marks (`tree_allowed`); `move_path` then moves the accepted path into place.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_slots: int,
        cache_len: int,
        aux_layer_ids: tuple[int, ...] | None = None,
        attn_bucket: int = 64,
    ):
        cfg = model.config
        check_supported(cfg)
        self.config = cfg
        inner = model.model
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.max_slots = max_slots
        self.cache_len = cache_len
        self.attn_bucket = attn_bucket
        if aux_layer_ids is not None:
            bad = [j for j in aux_layer_ids if not 0 <= j <= self.num_layers]
            if bad:
                raise ValueError(f"aux layer ids {bad} out of range 0..{self.num_layers}")
        self.aux_layer_ids = tuple(aux_layer_ids) if aux_layer_ids is not None else None

        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        with torch.no_grad():
            self.layers: list[_Layer] = [_fused_layer(layer) for layer in inner.layers]
            # RoPE table from the model's own rotary module (covers every rope_type HF implements).
            pos = torch.arange(cache_len, device=self.device)[None]
            cos, sin = inner.rotary_emb(self.embed[:1][None], pos)
            self.cos = cos[0].to(self.dtype).contiguous()  # [cache_len, D]
            self.sin_signed = signed_sin(sin[0].to(self.dtype))
        # One cache tensor per layer, k heads then v heads: a forward writes a layer's k and v with one
        # index_put (the qkv projection already lays k and v out side by side). k_cache / v_cache are views.
        # The layers' tensors are views of one allocation, so compaction moves every layer's slots in one copy
        # (a copy per layer is a launch per layer at every finish, a cost next to a replayed step's).
        shape = (max_slots, 2 * self.num_kv_heads, cache_len, self.head_dim)
        # Attention reads masked positions too, which must hold finite numbers (0 x NaN = NaN). On a GPU the
        # cache is zeroed at allocation (microseconds of HBM); on a CPU that memset of the whole cache (105 MB for
        # the deep preset at batch 16) is paid per rollout, so there positions are zeroed as attention first
        # reaches them (`_zeroed`: the positions below it are finite in every slot).
        lazy = self.device.type == "cpu"
        self._kv_all = (torch.empty if lazy else torch.zeros)((len(self.layers), *shape), device=self.device,
                                                              dtype=self.dtype)
        self._zeroed = 0 if lazy else cache_len
        self.kv_cache = list(self._kv_all.unbind(0))
        self.k_cache = [kv[:, : self.num_kv_heads] for kv in self.kv_cache]
        self.v_cache = [kv[:, self.num_kv_heads :] for kv in self.kv_cache]

    # -- cache bookkeeping ---------------------------------------------------------------------------------
    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, upto: int | None = None) -> None:
        """Copy the caches of slots src into slots dst (compaction after requests finish); `upto`: only positions
        0..upto-1 (a repeated prompt's prefill: the rest of the slot is never read before it is written)."""
        self._kv_all[:, dst, :, :upto] = self._kv_all[:, src, :, :upto]  # upto None: every position

    def move_path(self, start: torch.Tensor, path: torch.Tensor) -> None:
        """After a tree verify of rows 0..n-1 whose node i was cached in slot start + i: move the accepted path's
        entries into place, node path[:, j] (at depth j) to position start + j. Entries past a row's accepted
        length are moved too and are garbage, as a rejected chain draft's are: overwritten before anything
        attends to them."""
        n, w = path.shape
        rows = torch.arange(n, device=path.device)[:, None]
        dst = start[:, None] + torch.arange(w, device=path.device)
        self._kv_all[:, rows, :, dst] = self._kv_all[:, rows, :, start[:, None] + path]

    def _attn_len(self, max_pos: int) -> int:
        # Attend over a bucketed prefix of the cache rather than all of it: the work follows the longest
        # running row, and the few distinct widths keep shapes friendly to graph capture later.
        b = self.attn_bucket
        return min(self.cache_len, ((max_pos + b) // b) * b)

    # -- forward ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start: torch.Tensor,
        slot0: int = 0,
        max_pos: int | None = None,
        want_aux: bool = False,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = input_ids.shape
        slots = start[:, None] + torch.arange(T, device=start.device)  # [B,T]: where each token's k/v is written
        pos = slots if tree is None else start[:, None] + tree[0]  # its position (RoPE)
        L = self._attn_len(int(slots.max()) if max_pos is None else max_pos)
        if L > self._zeroed:  # before this forward's writes: they may land past the old frontier
            self._kv_all[:, :, :, self._zeroed : L].zero_()
            self._zeroed = L
        key_pos = torch.arange(L, device=start.device)
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        allowed = key_pos[None, None, :] <= pos[:, :, None] if tree is None else tree_allowed(key_pos, start, tree[1])
        mask = attention_mask(allowed[:, None], Hq // Hk, self.embed.dtype)
        # RoPE tables for every qkv head at these positions: built once per forward, not per layer
        cos, sin = qkv_rope_tables(self.cos[pos], self.sin_signed[pos], Hq + Hk, Hk)  # [B,T,Hq+2Hk,D]
        rows = torch.arange(B, device=start.device)[:, None].expand(B, T)

        x = F.embedding(input_ids, self.embed)
        aux = [] if (want_aux and self.aux_layer_ids) else None
        ids = self.aux_layer_ids or ()
        if aux is not None and 0 in ids:
            aux.append((0, x))
        with attention_backends(x.device):
            for i, ly in enumerate(self.layers):
                h = unit_rms_norm(x, self.eps)
                qkv = F.linear(h, ly.qkv_w, ly.qkv_b).view(B, T, Hq + 2 * Hk, D)
                if ly.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
                    qkv = torch.cat([
                        F.rms_norm(qkv[:, :, :Hq], (D,), ly.q_norm, self.eps),
                        F.rms_norm(qkv[:, :, Hq : Hq + Hk], (D,), ly.k_norm, self.eps),
                        qkv[:, :, Hq + Hk :],
                    ], 2)
                qkv = rope(qkv, cos, sin)
                kv = self.kv_cache[i][slot0 : slot0 + B]
                kv[rows, :, slots] = qkv[:, :, Hq:]
                q = qkv[:, :, :Hq].transpose(1, 2)
                k, v = kv[:, :Hk, :L], kv[:, Hk:, :L]
                o = gqa_attention(q, k, v, mask)
                o = o.transpose(1, 2).reshape(B, T, Hq * D)
                x = x + F.linear(o, ly.o_w, ly.o_b)
                h = unit_rms_norm(x, self.eps)
                gu = F.linear(h, ly.gate_up_w)
                g, u = gu.chunk(2, dim=-1)
                x = x + F.linear(F.silu(g) * u, ly.down_w)
                if aux is not None and (i + 1) in ids:
                    aux.append((i + 1, x))
        x = unit_rms_norm(x, self.eps) * self.final_norm
        logits = F.linear(x, self.lm_head).float()
        aux_out = None
        if aux is not None:
            by_id = dict(aux)
            aux_out = torch.cat([by_id[j] for j in ids], dim=-1)
        return logits, aux_out
