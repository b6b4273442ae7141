"""What a vLLM rollout is built with, checked before vLLM starts (pure; imports without vLLM installed).

A drafter that does not fit its target would make vLLM die minutes later in a worker with a shape error,
or silently concatenate the wrong layers; these checks name each mismatch up front. `speculative_config`
turns a `DrafterSpec` (and the selector's schedule of (first batch size, last batch size, k)) into vLLM's
`speculative_config`, with `num_speculative_tokens_per_batch_size` for the per-batch-size k.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tailspec.rollout.schedule_export import vllm_k
from tailspec.rollout.strategy import Strategy

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
Method = Literal["eagle3", "draft_model", "ngram"]
Schedule = list[tuple[int, int, int]]


class DrafterMismatch(ValueError):
    """The drafter does not fit the target (or its directory is not a servable drafter)."""


@dataclass
class DrafterSpec:
    """What to speculate with: `method` eagle3 (tailspec's EAGLE-3 export), draft_model (an HF causal LM with
    the target's tokenizer), or ngram (model-free prompt lookup, `path` None). `k` is the maximum draft
    length; `schedule` (the selector's [(start, end, k)], inclusive batch-size ranges) picks k per step."""

    method: Method
    path: str | Path | None = None
    k: int = 4
    schedule: Schedule | None = None
    ngram_max: int = 4
    ngram_min: int = 1


# -- checks (pure; no vLLM needed) -----------------------------------------------------------------------

def read_json(path: Path, what: str) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise DrafterMismatch(f"{what} {path} has no config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DrafterMismatch(f"{f}: not valid JSON ({e})") from None


def safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} from a safetensors header, without reading the tensors."""
    f = Path(path)
    f = f / "model.safetensors" if f.is_dir() else f
    if not f.is_file():
        raise DrafterMismatch(f"no weights file {f}")
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        if n > 100_000_000:
            raise DrafterMismatch(f"{f}: not a safetensors file (header length {n})")
        header = json.loads(fh.read(n))
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def is_eagle3_export(path: str | Path) -> bool:
    """Whether the directory is an EAGLE-3 export vLLM loads: its config.json names an EAGLE-3 architecture."""
    try:
        arch = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        arch = []
    return any(a in EAGLE3_ARCHITECTURES for a in arch)


def aux_layer_ids(drafter_cfg: dict) -> list[int] | None:
    ids = drafter_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(drafter_cfg.get("eagle_config"), dict):
        ids = drafter_cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def eagle3_problems(target_cfg: dict, drafter_dir: Path) -> list[str]:
    """Every way an EAGLE-3 directory does not fit the target for vLLM, each naming both values."""
    cfg = read_json(drafter_dir, "EAGLE-3 drafter")
    out: list[str] = []
    arch = cfg.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in arch):
        out.append(f"architectures {arch}: an EAGLE-3 directory names one of {list(EAGLE3_ARCHITECTURES)}")
    th, tv, n = int(target_cfg["hidden_size"]), int(target_cfg["vocab_size"]), int(target_cfg["num_hidden_layers"])
    dh = int(cfg.get("hidden_size", -1))
    t_h = int(cfg.get("target_hidden_size") or dh)
    if t_h != th:
        out.append(f"hidden_size: drafter expects a target of hidden size {t_h}, target has {th}")
    if dh != th:
        out.append(f"hidden_size: drafter {dh}, target {th} (the drafter reads the target's token embedding)")
    vocab = int(cfg.get("vocab_size", -1))
    if vocab != tv:
        out.append(f"vocab_size: drafter {vocab}, target {tv}")
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    ids = aux_layer_ids(cfg)
    if ids is None:
        default = sorted({2, n // 2, n - 3})
        out.append(f"eagle_aux_hidden_state_layer_ids is missing: vLLM would use (2, {n // 2}, {n - 3}) → "
                   f"{default} for a {n}-layer target; write the ids the drafter was trained on")
        ids = default
    else:
        if len(set(ids)) != len(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} collide (vLLM drops duplicates and fc gets "
                       "fewer inputs than it was trained on)")
        if ids != sorted(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} are not ascending (vLLM concatenates the "
                       "states in layer order)")
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            out.append(f"eagle_aux_hidden_state_layer_ids {bad} outside 0..{n} for a target with {n} layers")
    try:
        shapes = safetensors_shapes(drafter_dir)
    except DrafterMismatch as e:
        return out + [str(e)]
    fc = shapes.get("fc.weight")
    if fc is None:
        out.append("fc.weight is missing (EAGLE-3 projects the target's aux states with fc)")
    elif fc[0] != (dh, len(set(ids)) * th):
        out.append(f"fc.weight {list(fc[0])}: expected [{dh}, {len(set(ids))} × {th}] for aux ids {ids}")
    head = shapes.get("lm_head.weight")
    if head is None:
        out.append("lm_head.weight is missing: vLLM would share the target's lm_head and a hot reload would "
                   "overwrite it; export the drafter with its own lm_head")
    elif head[0] != (draft_vocab, dh):
        out.append(f"lm_head.weight {list(head[0])}: expected [draft_vocab_size {draft_vocab}, {dh}]")
    if draft_vocab < vocab and "d2t" not in shapes:
        out.append(f"d2t is missing: draft_vocab_size {draft_vocab} < vocab_size {vocab} needs the map")
    if draft_vocab == vocab and "d2t" in shapes:
        out.append("d2t is present although draft_vocab_size == vocab_size (vLLM has no parameter for it)")
    if "d2t" in shapes and shapes["d2t"][0] != (draft_vocab,):
        out.append(f"d2t {list(shapes['d2t'][0])}: expected [{draft_vocab}]")
    emb = shapes.get("embed_tokens.weight")
    if emb is not None and emb[0] != (tv, th):
        out.append(f"embed_tokens.weight {list(emb[0])}: expected the target's [{tv}, {th}]")
    return out


def draft_model_problems(target_cfg: dict, drafter_dir: Path) -> list[str]:
    cfg = read_json(drafter_dir, "draft model")
    out = []
    if int(cfg.get("vocab_size", -1)) != int(target_cfg["vocab_size"]):
        out.append(f"vocab_size: draft model {cfg.get('vocab_size')}, target {target_cfg['vocab_size']}")
    if any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or []):
        out.append(f"{drafter_dir} is an EAGLE-3 directory: use method eagle3")
    return out


def check_schedule(schedule: Sequence[Sequence[Any]], k_max: int) -> Schedule:
    """The selector's [(start, end, k)] as vLLM wants it: inclusive ranges, sorted, the first starting at 1,
    no overlap, 0 <= k <= k_max (vLLM clamps larger k silently; we refuse them). A `Strategy` in place of k
    runs as vLLM can (`schedule_export.vllm_k`): a chain its k, a tree a chain of its depth, none 0."""
    out: Schedule = []
    for e in schedule:
        if len(e) != 3:
            raise ValueError(f"schedule entry {tuple(e)}: expected (first batch size, last batch size, k)")
        s, t = int(e[0]), int(e[1])
        k = vllm_k(e[2]) if isinstance(e[2], Strategy) else int(e[2])
        if not 1 <= s <= t:
            raise ValueError(f"schedule entry {(s, t, k)}: batch sizes must satisfy 1 <= start <= end")
        if not 0 <= k <= k_max:
            raise ValueError(f"schedule entry {(s, t, k)}: k must be in 0..{k_max} (the drafter's maximum k)")
        out.append((s, t, k))
    out.sort()
    if not out or out[0][0] != 1:
        raise ValueError(f"schedule {out}: the first range must start at batch size 1")
    for a, b in itertools.pairwise(out):
        if b[0] <= a[1]:
            raise ValueError(f"schedule ranges {a} and {b} overlap")
    return out


def speculative_config(spec: DrafterSpec, target_dir: str | Path) -> dict:
    """vLLM's `speculative_config` for `spec`, after checking that the drafter fits the target."""
    if spec.k < 1:
        raise ValueError(f"k must be >= 1 (got {spec.k}); build without a DrafterSpec for plain decoding")
    target_cfg = read_json(Path(target_dir), "policy")
    conf: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": int(spec.k)}
    if spec.method in ("eagle3", "draft_model"):
        if spec.path is None:
            raise ValueError(f"method {spec.method} needs a drafter directory")
        path = Path(spec.path)
        problems = (eagle3_problems if spec.method == "eagle3" else draft_model_problems)(target_cfg, path)
        if problems:
            raise DrafterMismatch(f"drafter {path} does not fit target {target_dir}: " + "; ".join(problems))
        conf.update(model=str(path), draft_tensor_parallel_size=1)
    elif spec.method == "ngram":
        conf.update(prompt_lookup_max=spec.ngram_max, prompt_lookup_min=spec.ngram_min)
    else:
        raise ValueError(f"method {spec.method!r}: choose eagle3, draft_model or ngram")
    if spec.schedule is not None:
        conf["num_speculative_tokens_per_batch_size"] = check_schedule(spec.schedule, spec.k)
    return conf
