"""The EAGLE-3 drafter's config (`Eagle3Config`): its sizes, RoPE, the target's aux layer ids it reads, and the
saved form every field of which is checked on load; the default aux ids for a target, and whether a config fits
a target. The trained module (model.py) and its blocks (layers.py) are built from it.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any, Sequence


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, n//2, n-3) when n >= 7; else 3 distinct ids spread over 0..n."""
    n = int(num_layers)
    if n >= 7:
        ids = (2, n // 2, n - 3)
    elif n >= 4:
        ids = (1, n // 2, n - 1)
    elif n >= 2:
        ids = (0, 1, 2) if n == 2 else (0, 1, 2)
    else:
        raise ValueError(f"a target with {n} layer(s) has fewer than 3 distinct aux states (ids 0..{n}); "
                         "EAGLE-3 needs three")
    if len(set(ids)) != 3:
        raise ValueError(f"default aux layer ids collide for a target with {n} layers: {ids}")
    return ids


def _rope_from_target(tc: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a transformers 4.x or 5.x config."""
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if rest.get("rope_type", "default") == "default":
            return theta, None
        return theta, rest
    theta = float(getattr(tc, "rope_theta", 10000.0))
    scaling = getattr(tc, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        return theta, dict(scaling)
    return theta, None


# Integer fields of a saved Eagle3Config and their allowed ranges (generous: any real model fits).
_CONFIG_INTS = {"target_hidden_size": (1, 1 << 17), "hidden_size": (1, 1 << 17), "vocab_size": (2, 1 << 24),
                "draft_vocab_size": (2, 1 << 24), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
                "head_dim": (1, 4096), "intermediate_size": (1, 1 << 19), "max_position_embeddings": (1, 1 << 24),
                "target_num_layers": (1, 4096)}


@dataclass
class Eagle3Config:
    target_hidden_size: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, int, int]
    target_num_layers: int
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    target_model_type: str = "llama"
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # forward-compatible room; round-trips through save/load

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)  # type: ignore[assignment]
        if len(self.aux_layer_ids) != 3 or len(set(self.aux_layer_ids)) != 3:
            raise ValueError(f"aux_layer_ids must be 3 distinct ints, got {self.aux_layer_ids}")
        if not 2 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [2, vocab_size={self.vocab_size}]")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int | None = None,
                    aux_layer_ids: Sequence[int] | None = None) -> "Eagle3Config":
        tc = target_config
        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
        n = int(tc.num_hidden_layers)
        theta, scaling = _rope_from_target(tc)
        return cls(
            target_hidden_size=int(tc.hidden_size), hidden_size=int(tc.hidden_size),
            vocab_size=int(tc.vocab_size), draft_vocab_size=int(draft_vocab_size or tc.vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=head_dim, intermediate_size=int(tc.intermediate_size),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n),
            target_num_layers=n, hidden_act=str(getattr(tc, "hidden_act", "silu")),
            target_model_type=str(getattr(tc, "model_type", "llama")),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """From a saved config, every field checked for type and range (a damaged or hand-edited file names
        the field instead of failing later in a constructor, or allocating a huge model)."""
        if not isinstance(d, dict):
            raise ValueError(f"Eagle3Config must be a JSON object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k)[:40] for k in set(d) - known)
        if unknown:
            raise ValueError(f"unknown Eagle3Config keys: {unknown}")
        required = {n for n, f in cls.__dataclass_fields__.items() if f.default is MISSING
                    and f.default_factory is MISSING}
        missing = sorted(required - set(d))
        if missing:
            raise ValueError(f"Eagle3Config lacks {missing}")
        for name, (lo, hi) in _CONFIG_INTS.items():
            v = d.get(name)
            if v is None and name not in required:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"Eagle3Config.{name} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = d[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
                raise ValueError(f"Eagle3Config.{name} must be a finite number > 0, got {str(v)[:40]!r}")
        ids = d["aux_layer_ids"]
        if (not isinstance(ids, (list, tuple)) or len(ids) != 3
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= d["target_num_layers"]
                           for i in ids)):
            raise ValueError(f"Eagle3Config.aux_layer_ids must be 3 integers in [0, target_num_layers], "
                             f"got {str(ids)[:60]!r}")
        for name, types in (("rope_scaling", (dict, type(None))), ("hidden_act", (str,)),
                            ("target_model_type", (str,)), ("tie_word_embeddings", (bool,)), ("extra", (dict,))):
            if name in d and not isinstance(d[name], types):
                raise ValueError(f"Eagle3Config.{name} has type {type(d[name]).__name__}")
        if d["head_dim"] % 2:
            raise ValueError(f"Eagle3Config.head_dim must be even, got {d['head_dim']}")
        if d["num_attention_heads"] % d["num_key_value_heads"]:
            raise ValueError("Eagle3Config.num_attention_heads must be a multiple of num_key_value_heads")
        return cls(**d)


def fits(cfg: Eagle3Config, target_config: Any) -> list[str]:
    """Every way the drafter does not fit the target, each naming both values (empty list = fits)."""
    tc = target_config
    out = []
    if int(tc.vocab_size) != cfg.vocab_size:
        out.append(f"vocab_size: drafter {cfg.vocab_size}, target {tc.vocab_size}")
    if int(tc.hidden_size) != cfg.target_hidden_size:
        out.append(f"hidden_size: drafter expects {cfg.target_hidden_size}, target {tc.hidden_size}")
    n = int(tc.num_hidden_layers)
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i <= n]
    if bad:
        out.append(f"aux_layer_ids {list(cfg.aux_layer_ids)}: {bad} outside 0..{n} for a target with {n} layers")
    if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids):
        out.append(f"aux_layer_ids {list(cfg.aux_layer_ids)} collide")
    return out
