"""The EAGLE-3 drafter's building blocks: RMSNorm, RoPE with the target's parameters, the single decoder layer
(attention over a static per-slot KV cache at inference, and over the unroll's own chain in TTT training),
and its MLP. The config they are built from: drafter_trainer/eagle3_config.py; the module that assembles them
and its checkpoint format: drafter_trainer/model.py. Parameter names are the EAGLE-3 export format's (vLLM / SGLang `LlamaForCausalLMEagle3`)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tailspec.drafter_trainer.eagle3_config import Eagle3Config
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds an execution plan the first time it meets a shape, and a session's batches are padded to a
# new width nearly every time, so each batch would pay a plan build. The same rule as the
# rollout engine's forwards (rollout.model_runner.attention_backends; components do not import each other).
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device):
    """Every SDPA kernel but cuDNN's on CUDA; no restriction elsewhere (a CPU picks what it always picked)."""
    return sdpa_kernel(_SDPA_BACKENDS) if device.type == "cuda" else nullcontext()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    """RoPE with the target's parameters (every rope type transformers knows, via its init functions)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        # deferred: transformers takes seconds to import; only building a drafter needs it
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
        lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=rope)
        if rope["rope_type"] == "default":
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
            scale = 1.0
        else:
            inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](lc, None)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.scale = float(scale)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, hd]; cos/sin [B, T, hd]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclass
class DrafterCache:
    """Static per-slot KV cache of the drafter's single layer: k, v [max_slots, kv_heads, max_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: Eagle3Config, max_slots: int, max_len: int, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32) -> "DrafterCache":
        shape = (max_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@dataclass
class TTTState:
    """k/v of every unroll step so far (step 0 = target-fed entries, later steps = the drafter's own chain)."""

    ks: list[torch.Tensor] = field(default_factory=list)
    vs: list[torch.Tensor] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.n_heads // self.n_kv
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x, cos, sin, position_ids, cache: DrafterCache | None, slots: torch.Tensor | None):
        q, k, v = self._qkv(x, cos, sin)
        if cache is None:
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            with attention_backends(x.device):
                o = F.scaled_dot_product_attention(q, self._expand(k), self._expand(v), attn_mask=mask)
            return self._out(o)
        if slots is None:
            raise ValueError("slots are required with a cache (one cache row per batch row)")
        b, t = position_ids.shape
        if int(position_ids.max()) >= cache.max_len:
            raise ValueError(f"position {int(position_ids.max())} is beyond the drafter cache length {cache.max_len}")
        rows = slots[:, None].expand(b, t)
        cache.k[rows, :, position_ids] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[rows, :, position_ids] = v.transpose(1, 2).to(cache.v.dtype)
        kk, vv = cache.k[slots].to(q.dtype), cache.v[slots].to(q.dtype)  # [B, kv, L, hd]
        key_pos = torch.arange(cache.max_len, device=x.device)
        mask = (key_pos[None, None, :] <= position_ids[:, :, None])[:, None]  # [B, 1, T, L]
        with attention_backends(x.device):
            o = F.scaled_dot_product_attention(q, self._expand(kk), self._expand(vv), attn_mask=mask)
        return self._out(o)

    def ttt(self, x, cos, sin, state: TTTState) -> torch.Tensor:
        """One unroll step: rows are anchors t; step 0 is causal over anchors, step i > 0 sees the step-0
        entries of anchors <= t plus the entries of its own chain (steps 1..i at the same anchor)."""
        q, k, v = self._qkv(x, cos, sin)
        state.ks.append(k)
        state.vs.append(v)
        t = x.shape[1]
        k0, v0 = self._expand(state.ks[0]), self._expand(state.vs[0])
        scale = self.head_dim ** -0.5
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        if len(state.ks) == 1:
            return self._out(torch.softmax(s0.float(), dim=-1).to(q.dtype) @ v0)
        chain_k = torch.stack([self._expand(kk) for kk in state.ks[1:]], dim=-2)  # [B, h, T, i, hd]
        chain_v = torch.stack([self._expand(vv) for vv in state.vs[1:]], dim=-2)
        sd = (q[..., None, :] * chain_k).sum(-1) * scale  # [B, h, T, i]
        p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        o = p[..., :t] @ v0 + (p[..., t:, None] * chain_v).sum(-2)
        return self._out(o)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer: q/k/v read [norm(embedding); norm(hidden)] (embedding first, as vLLM)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def _input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def _finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h))
