"""The EAGLE-3 drafter: the trained module (`Eagle3Module`; its config in eagle3_config.py, its blocks and static
KV cache in layers.py), aux-state capture and checkpoint format.

Shared by the rollout engine (inference) and the trainer (TTT). Parameter names are exactly the ones the
EAGLE-3 export format (vLLM / SGLang `LlamaForCausalLMEagle3`) uses, so export is a rename-free copy.

Aux hidden states (what the drafter reads from the target)
----------------------------------------------------------
Aux id j = the target's residual stream after j decoder layers, BEFORE the final norm (0 = the token
embeddings). That is vLLM's convention. `capture_aux(target, ids)` records exactly these tensors with
forward hooks on `target.model.embed_tokens` / `target.model.layers[j-1]`, during any forward of the
target (HF `forward`, `generate`, or an engine's own loop over the same layer modules).
Checked in transformers 5: HF `output_hidden_states[j]` equals id j for j < n, but `hidden_states[n]`
is the state AFTER the final norm (transformers ties the last entry to `last_hidden_state`), so do not
use `output_hidden_states` for id n. Trainer and engine both use `capture_aux`; they take the same tensors.
vLLM gathers aux states at the inputs of its layers, so only ids 1..n-1 are servable there; the export
refuses ids outside that range (ours accepts 0..n for small test targets).

What inference does (the engine must mirror this; the trainer's TTT unroll reproduces it exactly)
-----------------------------------------------------------------------------------------------
Notation: tokens x_0..x_m are verified (x_m is the target's last sampled / bonus token); g_t = the
target's aux states at position t (concatenated, [3H]), known for t <= m-1.
1. Catch up: run `forward(hidden=project(g_t), input_ids=x_{t+1}, position_ids=t)` with the cache for every
   position t the drafter has not yet processed with target states (c..m-1; after prefill c = 0, after a
   verify round c = the first position whose cache entry came from a draft step or was never written).
   This writes step-0 k/v at positions c..m-1. The logits at position m-1 give the first draft d_1
   (draft id → target id via `draft_to_target`), and `hidden_out` at m-1 is o_1.
2. Draft step j = 2..k: `forward(hidden=o_{j-1}, input_ids=d_{j-1}, position_ids=m+j-2)` → d_j, o_j.
   The drafter consumes its own previous hidden output (`hidden_out`, the pre-norm residual) — not fc(...).
3. Verify with the target; the rejected positions' cache entries (positions >= m after a round) are simply
   overwritten by the next catch-up, because attention only reads positions <= its own and every position
   is written before it is read.
So at draft step j (anchor m-1) the query at position m-1+j-1 attends to the step-0 entries at
positions 0..m-1 and to the draft entries of its own chain. The TTT unroll in training uses exactly this
mask (`ttt_step`), with the real continuation as input ids (teacher forcing = the accepted path).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors.torch import save_file
from tailspec.core.atomic import write_dir_atomic
from tailspec.drafter_trainer.eagle3_config import Eagle3Config, fits
from tailspec.drafter_trainer.files import DrafterFileError, file_crc32, read_json_object, read_tensors
from tailspec.drafter_trainer.layers import DrafterCache, MidLayer, RMSNorm, Rotary, TTTState
from torch import nn

CONFIG_NAME = "tailspec_drafter.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


class Eagle3Module(nn.Module):
    """The trained EAGLE-3 drafter module (the engine runs it through rollout.drafters.Eagle3Proposer)."""

    def __init__(self, cfg: Eagle3Config, target_embedding: nn.Module | None = None):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        d2t, t2d = identity_vocab_maps(cfg.vocab_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.embed_tokens: nn.Module | None = None
        if target_embedding is not None:
            self.set_target_embedding(target_embedding)

    # The embedding is the target's: frozen, shared, never a parameter of the drafter (so it is neither
    # trained nor in the drafter's state_dict). object.__setattr__ keeps nn.Module from registering it.
    def set_target_embedding(self, embedding: nn.Module) -> None:
        if embedding.weight.shape[0] != self.config.vocab_size or embedding.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"target embedding is {tuple(embedding.weight.shape)}, the drafter needs "
                             f"[{self.config.vocab_size}, {self.config.hidden_size}]")
        object.__setattr__(self, "embed_tokens", embedding)

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        check_vocab_maps(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux.to(self.fc.weight.dtype))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("the drafter has no token embedding: call set_target_embedding(target.get_input_embeddings())")
        with torch.no_grad():
            return self.embed_tokens(input_ids).to(self.fc.weight.dtype)

    def _head(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: DrafterCache | None = None, slots: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (draft_logits [B,T,draft_vocab], hidden_out [B,T,H] — the pre-norm residual fed to the next step)."""
        layer = self.midlayer
        x = layer._input(hidden, self._embed(input_ids))
        cos, sin = self.rotary(position_ids, x.dtype)
        out = layer._finish(hidden, layer.self_attn(x, cos, sin, position_ids, cache, slots))
        return self._head(out), out

    def ttt_step(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 state: TTTState) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the training unroll (see module doc); step i's rows are the anchors' chains."""
        layer = self.midlayer
        x = layer._input(hidden, self._embed(input_ids))
        cos, sin = self.rotary(position_ids, x.dtype)
        out = layer._finish(hidden, layer.self_attn.ttt(x, cos, sin, state))
        return self._head(out), out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> torch.Tensor:
        """Bool mask [vocab] of the target ids the draft vocabulary covers."""
        return self.t2d

    def draft_ids_in_target(self) -> torch.Tensor:
        """Target ids of draft ids 0..draft_vocab-1 (ascending)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_probs(self, draft_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Drafter distribution q over the TARGET vocabulary (zero outside the draft vocab)."""
        probs = torch.softmax(draft_logits.float() / max(temperature, 1e-6), dim=-1)
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        out[..., self.draft_ids_in_target()] = probs
        return out

    # -- checks ------------------------------------------------------------------------------------------
    def fits(self, target_config: Any) -> list[str]:
        return fits(self.config, target_config)

    def check_fits(self, target_config: Any) -> None:
        problems = self.fits(target_config)
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    # -- checkpoint format -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        meta = {"format_version": FORMAT_VERSION, "config": self.config.to_dict(), "extra": extra or {}}

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp / WEIGHTS_NAME))
            meta["weights_crc32"] = file_crc32(tmp / WEIGHTS_NAME)
            (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2))

        return write_dir_atomic(Path(path), write)

    @classmethod
    def load(cls, path: str | os.PathLike, target_embedding: nn.Module | None = None,
             map_location: str | torch.device = "cpu") -> "Eagle3Module":
        """A saved drafter. A missing directory is FileNotFoundError; a damaged one (any file missing, truncated,
        altered, or disagreeing with the config) is DrafterFileError naming the file."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a drafter checkpoint (no such directory)")
        meta = read_json_object(path / CONFIG_NAME)
        cfg, expect = cls.from_meta(path / CONFIG_NAME, meta)
        state = read_tensors(path / WEIGHTS_NAME, map_location, crc=meta.get("weights_crc32"), expect=expect)
        model = cls(cfg, target_embedding)
        try:
            model.load_state_dict(state, strict=True)
            check_vocab_maps(model.d2t, model.t2d, model.config.vocab_size, model.config.draft_vocab_size)
        except (ValueError, RuntimeError) as e:
            raise DrafterFileError(f"{path / WEIGHTS_NAME}: {str(e)[:300]}") from None
        return model.to(map_location)

    @classmethod
    def from_meta(cls, cfg_file: Path, meta: dict) -> tuple[Eagle3Config, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """The config a saved meta holds (checked field by field) and the tensors its weights file must hold
        (name → (shape, dtype), from a module built on the meta device: no memory), so a damaged config or
        header is refused before anything is allocated or read."""
        if meta.get("format_version") != FORMAT_VERSION:
            raise DrafterFileError(f"{cfg_file}: format_version {str(meta.get('format_version'))[:40]!r}, "
                                   f"expected {FORMAT_VERSION}")
        try:
            cfg = Eagle3Config.from_dict(meta.get("config"))
            key = json.dumps(meta.get("config"), sort_keys=True)
            shapes = _SHAPES.get(key)
            if shapes is None:  # building even a meta module is most of a small drafter's load: once per config
                with torch.device("meta"):
                    shapes = _SHAPES[key] = {n: (tuple(t.shape), t.dtype) for n, t in cls(cfg).state_dict().items()}
            shapes = dict(shapes)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, ZeroDivisionError, OverflowError) as e:
            raise DrafterFileError(f"{cfg_file}: bad drafter config: {str(e)[:300]}") from None
        return cfg, shapes


_SHAPES: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}  # from_meta's, by the config's JSON


def identity_vocab_maps(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ids = the first `draft_vocab_size` target ids (placeholder until frequencies are known)."""
    d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    return d2t, t2d


def vocab_maps_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d of the `draft_vocab_size` most frequent target ids (ties → lower id); draft ids ascend with
    target ids, so d2t[i] = target_id[i] - i >= 0 as vLLM and SGLang expect."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab}]")
    # Stable sort on -count keeps lower ids first among ties.
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    chosen = torch.sort(order).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    if d2t.dtype != torch.long or tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"d2t must be int64 [{draft_vocab_size}], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"t2d must be bool [{vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
    target = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    if int(target.min()) < 0 or int(target.max()) >= vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target vocabulary 0..{vocab_size - 1}")
    if len(set(target.tolist())) != draft_vocab_size or not bool(t2d[target].all()) or int(t2d.sum()) != draft_vocab_size:
        raise ValueError("d2t and t2d disagree (t2d must mark exactly the target ids d2t maps to)")


@contextmanager
def capture_aux(target: nn.Module, aux_layer_ids: Sequence[int]) -> Iterator[list]:
    """Record aux states (id j = output of decoder layer j-1, pre final norm; 0 = embeddings) during any
    forward of `target` inside the block. Yields a list that receives, per forward, a tensor [B, T, 3H]."""
    base = getattr(target, "model", target)
    layers, embed = base.layers, base.embed_tokens
    n = len(layers)
    for j in aux_layer_ids:
        if not 0 <= j <= n:
            raise ValueError(f"aux layer id {j} is outside 0..{n} for a target with {n} layers")
    captured: dict[int, torch.Tensor] = {}
    results: list[torch.Tensor] = []
    last = max(aux_layer_ids)

    def hook_for(j: int):
        def hook(_mod, _inp, out):
            captured[j] = out[0] if isinstance(out, tuple) else out
            if j == last:
                results.append(torch.cat([captured[i] for i in aux_layer_ids], dim=-1))
                captured.clear()
        return hook

    handles = [(embed if j == 0 else layers[j - 1]).register_forward_hook(hook_for(j)) for j in aux_layer_ids]
    try:
        yield results
    finally:
        for h in handles:
            h.remove()
