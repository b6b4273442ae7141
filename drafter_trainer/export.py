"""Export a drafter for serving: the EAGLE-3 directory vLLM and SGLang load, or an HF-style directory.

`eagle3` (vLLM `speculative_config={"method": "eagle3", "model": DIR, ...}`, SGLang
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`):
- config.json: `architectures: ["LlamaForCausalLMEagle3"]`, `model_type: llama`, `num_hidden_layers: 1`,
  `draft_vocab_size`, `vocab_size` (the target's), `target_hidden_size`, hidden / heads / head_dim /
  intermediate size, `rms_norm_eps`, rope fields copied from the target (`rope_theta`, `rope_scaling`,
  `rope_parameters`), `max_position_embeddings`, and the aux layer ids ALWAYS written
  (`eagle_aux_hidden_state_layer_ids` at the top level and under `eagle_config`): vLLM's default
  (2, n//2, n-3) collapses for targets with fewer than 7 layers.
- model.safetensors: `fc.weight` [H, 3H], `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v}_proj.weight` [*, 2H], `midlayer.self_attn.o_proj.weight`,
  `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, H] (always shipped:
  a hot reload must never fall back to the target's head), and `d2t` (int64) / `t2d` (bool) only when the
  draft vocabulary is smaller than the target's (vLLM refuses `d2t` otherwise).
`hf`: the same plus `embed_tokens.weight` (the target's embedding), so the directory stands alone.

Refused: colliding aux ids, and (eagle3) ids outside 1..n-1 — vLLM gathers aux states at the INPUT of
layers 1..n-1, so id n is never produced and the fc would get the wrong width.
The directory is written through a temporary sibling and renamed into place: whole or absent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tailspec.core.atomic import write_dir_atomic
from tailspec.drafter_trainer.files import (
    DrafterFileError,
    check_crc,
    file_crc32,
    read_json_object,
    read_tensors,
)
from tailspec.drafter_trainer.model import FORMAT_VERSION, Eagle3Config, Eagle3Module, check_vocab_maps
from torch import nn

log = logging.getLogger(__name__)

Format = Literal["eagle3", "hf"]
ARCHITECTURE = "LlamaForCausalLMEagle3"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    pass


def check_exportable(cfg: Eagle3Config, fmt: Format) -> None:
    ids = list(cfg.aux_layer_ids)
    if len(set(ids)) != len(ids):
        raise ExportError(f"aux layer ids {ids} collide; serving engines drop duplicates and the fc width breaks")
    if fmt == "eagle3":
        n = cfg.target_num_layers
        bad = [i for i in ids if not 1 <= i <= n - 1]
        if bad:
            raise ExportError(
                f"aux layer ids {ids}: {bad} outside 1..{n - 1}; vLLM/SGLang gather aux states at the input of "
                f"layers 1..{n - 1} of this {n}-layer target, so such a drafter cannot be served (train it with "
                "ids in that range, or export --format hf)")


def export_config(cfg: Eagle3Config) -> dict[str, Any]:
    ids = list(cfg.aux_layer_ids)
    rope_params = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_params,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "tailspec": {"drafter_config": cfg.to_dict()},
    }


def export_tensors(drafter: Eagle3Module, fmt: Format, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    cfg = drafter.config
    out = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        out[name] = t.detach().to("cpu", dtype).contiguous()
    if cfg.draft_vocab_size < cfg.vocab_size:
        out["d2t"] = drafter.d2t.detach().cpu().long().contiguous()
        out["t2d"] = drafter.t2d.detach().cpu().bool().contiguous()
    if fmt == "hf":
        if drafter.embed_tokens is None:
            raise ExportError("the hf format carries embed_tokens: give the drafter the target's embedding")
        out["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().to("cpu", dtype).contiguous()
    return out


def export(drafter: Eagle3Module, out_dir: str | Path, fmt: Format = "eagle3", dtype: str = "float32",
           meta: dict | None = None) -> Path:
    if fmt not in ("eagle3", "hf"):
        raise ExportError(f"unknown export format {fmt!r}; choose eagle3 or hf")
    if dtype not in _DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose {', '.join(_DTYPES)}")
    check_exportable(drafter.config, fmt)
    if 0 in drafter.config.aux_layer_ids and fmt == "eagle3":
        log.warning("aux layer id 0 (embeddings) is unusual for serving engines; check your engine accepts it")
    tensors = export_tensors(drafter, fmt, _DTYPES[dtype])
    config = export_config(drafter.config)
    config["torch_dtype"] = dtype
    if meta:
        config["tailspec"].update(meta)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config["tailspec"]["weights_crc32"] = file_crc32(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return write_dir_atomic(Path(out_dir), write)


def load_export(path: str | Path, target_embedding: nn.Module | None = None) -> Eagle3Module:
    """Read an exported directory back into an Eagle3Module (round trip; the hf format brings its embedding).
    Missing: FileNotFoundError; damaged (truncated, altered, not what its config says): DrafterFileError
    (an ExportError is a ValueError too) naming the file."""
    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not w_file.is_file():
        raise FileNotFoundError(f"{path} is not an exported drafter (needs config.json and model.safetensors)")
    config = read_json_object(cfg_file)
    archs = config.get("architectures")
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise DrafterFileError(f"{cfg_file}: architectures {str(archs)[:80]} lack {ARCHITECTURE}")
    ours = config.get("tailspec")
    if not isinstance(ours, dict):
        raise DrafterFileError(f"{cfg_file}: no tailspec section (not exported by tailspec)")
    cfg, expect = Eagle3Module.from_meta(cfg_file, {"format_version": FORMAT_VERSION,
                                                         "config": ours.get("drafter_config")})
    name = config.get("torch_dtype")
    if name is not None and not (isinstance(name, str) and name in _DTYPES):
        raise DrafterFileError(f"{cfg_file}: torch_dtype {str(name)[:40]!r} is none of {sorted(_DTYPES)}")
    dtype = _DTYPES.get(name, torch.float32)
    if cfg.draft_vocab_size == cfg.vocab_size:  # full vocabulary: identity maps, not shipped
        expect = {k: v for k, v in expect.items() if k not in ("d2t", "t2d")}
    check_crc(w_file, ours.get("weights_crc32"))
    if "embed_tokens.weight" in _tensor_names(w_file):
        expect["embed_tokens.weight"] = ((cfg.vocab_size, cfg.hidden_size), dtype)
    tensors = read_tensors(w_file, expect=expect)
    emb = tensors.pop("embed_tokens.weight", None)
    drafter = Eagle3Module(cfg).to(tensors["fc.weight"].dtype)
    if emb is not None:
        e = nn.Embedding(emb.shape[0], emb.shape[1], _weight=emb)
        e.requires_grad_(False)
        drafter.set_target_embedding(e)
    elif target_embedding is not None:
        drafter.set_target_embedding(target_embedding)
    state = drafter.state_dict()
    if "d2t" not in tensors:  # full vocabulary: identity maps
        tensors["d2t"], tensors["t2d"] = state["d2t"], state["t2d"]
    try:
        drafter.load_state_dict(tensors)
        check_vocab_maps(drafter.d2t, drafter.t2d, drafter.config.vocab_size, drafter.config.draft_vocab_size)
    except (ValueError, RuntimeError) as e:
        raise DrafterFileError(f"{w_file}: {str(e)[:300]}") from None
    return drafter


def _tensor_names(f: Path) -> list[str]:
    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise DrafterFileError(f"{f}: not a readable safetensors file: {str(e)[:200]}") from None
