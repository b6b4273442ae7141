"""vLLM rollout backend: serve the policy with vLLM and tailspec's drafter, schedule and monitoring.

    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout
    ro = VllmRollout(policy_dir, DrafterSpec("eagle3", drafter_dir, k=4, schedule=[(1, 8, 4), (9, 64, 1)]),
                     max_model_len=1024)
    res = ro.generate(prompt_ids, greedy(max_tokens=256), on_progress=client_progress(client, "worker0", [0]))
    ro.reload_drafter(new_version_dir)   # between rollout phases: in place, no restart

What it does beside vLLM:
- refuses a drafter that does not fit the target BEFORE vLLM starts (vLLM would die minutes later in a
  worker with a shape error, or silently concatenate the wrong layers), naming each mismatch;
- turns the selector's schedule [(first batch size, last batch size, k), ...] into vLLM's
  `num_speculative_tokens_per_batch_size` (k_max = `num_speculative_tokens`);
- hot-reloads drafter weights through a worker extension called by name (`vllm_worker_ext`), then resets
  the prefix cache; the target's modules are never written;
- drives vLLM's engine step by step so progress (active / finished requests, tokens) reaches the
  scheduler while `generate` runs, and returns per-request and aggregate acceptance from vLLM's counters.

Imports nothing of the scheduler: progress goes to any object with `report_progress` (the tailspec client).
vLLM is imported lazily, so this module (and its checks) import without vLLM installed.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

WORKER_EXTENSION = "tailspec.rollout.vllm_worker_ext.TailspecWorkerExtension"
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


def check_schedule(schedule: Sequence[Sequence[int]], k_max: int) -> Schedule:
    """The selector's [(start, end, k)] as vLLM wants it: inclusive ranges, sorted, the first starting at 1,
    no overlap, 0 <= k <= k_max (vLLM clamps larger k silently; we refuse them)."""
    out: Schedule = []
    for e in schedule:
        if len(e) != 3:
            raise ValueError(f"schedule entry {tuple(e)}: expected (first batch size, last batch size, k)")
        s, t, k = (int(x) for x in e)
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


# -- counters ---------------------------------------------------------------------------------------------

@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (cumulative; subtract two snapshots for a window)."""

    drafts: int = 0  # verify steps with a draft, summed over requests
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens, [x - y for x, y in zip(a, b)])

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per target forward of a drafting request (the field's metric)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_k(self) -> float:
        """Drafted tokens per drafting request-step: the k vLLM actually used."""
        return self.draft_tokens / self.drafts if self.drafts else 0.0

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": self.accepted_per_pos, "acceptance_length": self.acceptance_length,
                "acceptance_rate": self.acceptance_rate, "mean_k": self.mean_k}


def counters_from_metrics(metrics: Sequence[Any]) -> SpecCounters:
    c = SpecCounters()
    for m in metrics:
        name = m.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            c.drafts += int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            c.draft_tokens += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            c.accepted_tokens += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            c.accepted_per_pos = [x + y for x, y in zip(c.accepted_per_pos + [0] * len(vals), vals)] \
                if c.accepted_per_pos else vals
    return c


# -- results ----------------------------------------------------------------------------------------------

@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None  # the sampled tokens' logprobs under the policy (when requested)
    acceptance_length: float | None  # this request's own, from vLLM's per-request counters
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class RolloutResult:
    completions: list[Completion]
    counters: SpecCounters  # this call's window of vLLM's counters
    seconds: float
    steps: int  # engine steps

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


ProgressFn = Callable[[int, int, int, float], None]  # (active, finished, tokens_done, tokens_per_s)


def client_progress(client: Any, worker: str, gpus: Sequence[int], total: int | None = None,
                    phase: str = "rollout", step: int | None = None) -> ProgressFn:
    """A progress callback that reports through the scheduler client (`tailspec.scheduler.client`)."""

    def report(active: int, finished: int, tokens: int, tokens_per_s: float) -> None:
        client.report_progress(worker, list(gpus), active, finished, phase, total=total or active + finished,
                               step=step, tokens_done=tokens, tokens_per_s=tokens_per_s)

    return report


def greedy(max_tokens: int, **kw: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# -- the backend ------------------------------------------------------------------------------------------

class VllmRollout:
    """One vLLM `LLM` for a policy directory, optionally with a drafter; see the module doc."""

    def __init__(self, policy_dir: str | Path, spec: DrafterSpec | None = None, *, max_model_len: int = 1024,
                 max_num_seqs: int = 64, dtype: str = "auto", seed: int = 0, **llm_kwargs: Any):
        self.policy_dir = Path(policy_dir)
        self.spec = spec
        conf = speculative_config(spec, self.policy_dir) if spec is not None else None  # refuse before vLLM
        from vllm import LLM

        kw: dict[str, Any] = {"model": str(self.policy_dir), "tokenizer": str(self.policy_dir), "dtype": dtype,
                                  "seed": seed, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                  "disable_log_stats": False, "worker_extension_cls": WORKER_EXTENSION}
        if conf is not None:
            kw.update(speculative_config=conf, per_request_spec_decode_metrics="summary")
        kw.update(llm_kwargs)
        self.llm = LLM(**kw)
        self.drafter_path = Path(spec.path) if spec is not None and spec.path is not None else None
        self.reloads = 0

    # -- drafter ----------------------------------------------------------------------------------------
    def reload_drafter(self, path: str | Path) -> dict:
        """Load a new drafter version into the live LLM (same architecture as the one it started with), then
        reset the prefix cache so no cached state of the old drafter is reused. Returns what was loaded and
        the wall time."""
        if self.spec is None or self.spec.method != "eagle3" or self.drafter_path is None:
            raise RuntimeError("hot reload needs an LLM built with an EAGLE-3 drafter (method eagle3); this one "
                               f"has {self.spec.method if self.spec else 'no drafter'}")
        path = Path(path)
        self._check_reloadable(path)
        t0 = time.perf_counter()
        res = self.llm.collective_rpc("tailspec_reload_drafter", args=(str(path),))
        self.llm.reset_prefix_cache()
        self.drafter_path = path
        self.reloads += 1
        return {**res[0], "total_seconds": time.perf_counter() - t0}

    def _check_reloadable(self, path: Path) -> None:
        """Same tensor names and shapes as the drafter the LLM was built with (`t2d` ignored, vLLM has none),
        and the same config where it shapes the model: a half-loaded drafter would corrupt decoding."""
        assert self.drafter_path is not None
        if self.spec is not None and self.spec.method == "eagle3":
            problems = eagle3_problems(read_json(self.policy_dir, "policy"), path)
            if problems:
                raise DrafterMismatch(f"drafter {path} does not fit target {self.policy_dir}: " + "; ".join(problems))
            old_ids, new_ids = aux_layer_ids(read_json(self.drafter_path, "drafter")), aux_layer_ids(read_json(path, "drafter"))
            if old_ids != new_ids:
                raise DrafterMismatch(f"aux layer ids {new_ids} differ from the live drafter's {old_ids}")
        old = {k: v for k, v in safetensors_shapes(self.drafter_path).items() if k != "t2d"}
        new = {k: v for k, v in safetensors_shapes(path).items() if k != "t2d"}
        if old != new:
            diff = sorted(set(old.items()) ^ set(new.items()))
            raise DrafterMismatch(f"drafter {path} has other tensors than the live one ({self.drafter_path}): "
                                  f"{diff[:6]}")

    def target_digest(self) -> dict:
        return self.llm.collective_rpc("tailspec_target_digest")[0]

    def drafter_digest(self) -> dict:
        return self.llm.collective_rpc("tailspec_drafter_digest")[0]

    # -- counters ---------------------------------------------------------------------------------------
    def counters(self) -> SpecCounters:
        return counters_from_metrics(self.llm.get_metrics())

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *, on_progress: ProgressFn | None = None,
                 progress_every_s: float = 0.5, trace: list | None = None) -> RolloutResult:
        """Generate for token-id prompts (one SamplingParams, or one per prompt), results in prompt order.
        Steps vLLM's engine itself with streamed (delta) outputs, so `on_progress(active, finished,
        tokens_done, tokens_per_s)` is called while it runs (at most every `progress_every_s`, and at the end).
        With `trace` (a list), appends per engine step (requests unfinished before the step, that step's
        SpecCounters) — what k vLLM used at which batch size."""
        from vllm.sampling_params import RequestOutputKind

        if not prompts:
            return RolloutResult([], SpecCounters(), 0.0, 0)
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        engine = self.llm.llm_engine
        before = self.counters()
        t0 = time.perf_counter()
        tag = uuid.uuid4().hex[:8]
        index: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, per)):
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.DELTA  # tokens as they come: progress counts them
            rid = f"tailspec-{tag}-{i}"
            index[rid] = i
            engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float] | None] = [None] * len(prompts)
        final: dict[int, Any] = {}
        steps, last = 0, 0.0

        def report() -> None:
            n = sum(len(t) for t in tokens)
            dt = time.perf_counter() - t0
            on_progress(len(prompts) - len(final), len(final), n, n / dt if dt > 0 else 0.0)

        prev = before
        while engine.has_unfinished_requests():
            active = len(prompts) - len(final)
            outs = engine.step()
            if trace is not None:
                now = self.counters()
                trace.append((active, now - prev))
                prev = now
            for out in outs:
                i = index.get(out.request_id)
                if i is None:  # another caller's request on the same engine
                    continue
                o = out.outputs[0]
                tokens[i].extend(o.token_ids)
                if o.logprobs is not None:
                    logprobs[i] = (logprobs[i] or []) + [float(lp[t].logprob) for lp, t in zip(o.logprobs, o.token_ids)]
                if out.finished:
                    final[i] = o
            steps += 1
            if on_progress is not None and time.perf_counter() - last >= progress_every_s:
                last = time.perf_counter()
                report()
        seconds = time.perf_counter() - t0
        if on_progress is not None:
            report()
        missing = [i for i in range(len(prompts)) if i not in final]
        if missing:
            raise RuntimeError(f"vLLM returned no final output for prompts {missing[:8]}")
        completions = [_completion(tokens[i], logprobs[i], final[i]) for i in range(len(prompts))]
        return RolloutResult(completions, self.counters() - before, seconds, steps)

    def close(self) -> None:
        """Shut the engine down (its worker processes, if any) now rather than at interpreter exit."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


def _completion(tokens: list[int], logprobs: list[float] | None, last: Any) -> Completion:
    m = getattr(last, "spec_decode_metrics", None)
    if m is not None:
        d = m.to_dict()
        return Completion(tokens, last.finish_reason, logprobs, d["mean_acceptance_length"],
                          d["num_draft_tokens"], d["num_accepted_draft_tokens"])
    return Completion(tokens, last.finish_reason, logprobs, None)
