"""vLLM rollout backend: serve the policy with vLLM and tailspec's drafter, schedule and monitoring.

    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout
    ro = VllmRollout(policy_dir, DrafterSpec("eagle3", drafter_dir, k=4, schedule=[(1, 8, 4), (9, 64, 1)]),
                     max_model_len=1024)
    res = ro.generate(prompt_ids, greedy(max_tokens=256), on_progress=client_progress(client, "worker0", [0]))
    ro.reload_drafter(new_version_dir)   # between rollout phases: in place, no restart

What it does beside vLLM:
- refuses a drafter that does not fit the target BEFORE vLLM starts, naming each mismatch (the checks and
  `speculative_config` live in `rollout.vllm_checks`, re-exported here);
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

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailspec.rollout.vllm_checks import (  # also re-exported: the backend's public names
    DrafterMismatch,
    DrafterSpec,
    Schedule,
    aux_layer_ids,
    check_schedule,
    eagle3_problems,
    read_json,
    safetensors_shapes,
    speculative_config,
)

WORKER_EXTENSION = "tailspec.rollout.vllm_worker_ext.TailspecWorkerExtension"


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

    @classmethod
    def from_dict(cls, d: dict) -> SpecCounters:
        """Back from `as_dict` (the derived figures are recomputed, not read)."""
        return cls(int(d["drafts"]), int(d["draft_tokens"]), int(d["accepted_tokens"]),
                   [int(x) for x in d.get("accepted_per_pos") or []])

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


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def process_counters(_actor: Any = None) -> dict:
    """The speculative-decoding counters of every vLLM engine front end in this process, as a plain dict
    (`SpecCounters.as_dict`): read from the Prometheus registry vLLM's stat logger writes (the one
    `LLM.get_metrics` reads), without importing vLLM. A framework's engine actor runs it through Ray's
    `__ray_call__` (the actor is the unused first argument). All zeros where the engine logs no stats
    (`disable_log_stats`) or drafts nothing."""
    # deferred: prometheus_client is a core dependency, but this runs inside another framework's actor, and the
    # rest of the module needs none of it
    from prometheus_client import REGISTRY

    c = SpecCounters()
    per_pos: dict[int, int] = {}
    for metric in REGISTRY.collect():
        if metric.type != "counter":
            continue
        for s in metric.samples:
            if not s.name.endswith("_total"):
                continue
            if metric.name in _SPEC_COUNTERS:
                field_name = _SPEC_COUNTERS[metric.name]
                setattr(c, field_name, getattr(c, field_name) + int(s.value))
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and "position" in s.labels:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(s.value)
    c.accepted_per_pos = [per_pos.get(j, 0) for j in range(max(per_pos) + 1)] if per_pos else []
    return c.as_dict()


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
StepFn = Callable[[int, "SpecCounters", float], None]  # (requests unfinished before the step, its counters, seconds)


def client_progress(client: Any, worker: str, gpus: Sequence[int], total: int | None = None,
                    phase: str = "rollout", step: int | None = None) -> ProgressFn:
    """A progress callback that reports through the scheduler client (`tailspec.scheduler.client`)."""

    def report(active: int, finished: int, tokens: int, tokens_per_s: float) -> None:
        client.report_progress(worker, list(gpus), active, finished, phase, total=total or active + finished,
                               step=step, tokens_done=tokens, tokens_per_s=tokens_per_s)

    return report


def greedy(max_tokens: int, **kw: Any):
    # deferred: vLLM (an optional extra; this module imports without it)
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
        # deferred: vLLM (an optional extra; this module imports without it)
        from vllm import LLM

        kw: dict[str, Any] = {"model": str(self.policy_dir), "tokenizer": str(self.policy_dir), "dtype": dtype,
                                  "seed": seed, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                  "disable_log_stats": False, "worker_extension_cls": WORKER_EXTENSION}
        if conf is not None:
            kw.update(speculative_config=conf, per_request_spec_decode_metrics="summary")
        kw.update(llm_kwargs)
        self.llm = LLM(**kw)
        self.max_num_seqs = max_num_seqs
        self.schedule: Schedule | None = conf.get("num_speculative_tokens_per_batch_size") if conf else None
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

    # -- policy weights and the k schedule at run time ----------------------------------------------------
    def update_policy(self, path: str | Path) -> dict:
        """Policy-weight sync in place: vLLM's own `reload_weights` (layerwise: restore the packed layers,
        load the checkpoint's tensors, re-pack) in every worker from the HF directory `path` (same
        architecture and shapes), then the prefix cache is reset so no KV of the old weights is reused. The
        drafter is not touched; a drafter that shares the target's embedding sees the new one."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.llm.reset_prefix_cache()
        self.policy_dir = Path(path)
        return {"path": str(path), "total_seconds": time.perf_counter() - t0}

    @property
    def k_max(self) -> int:
        return int(self.spec.k) if self.spec is not None else 0

    def set_schedule(self, schedule: Sequence[Sequence[int]]) -> bool:
        """Replace the batch size -> k schedule of the running engine; call it between engine steps.

        vLLM 0.32 has no API for this: its scheduler expands `num_speculative_tokens_per_batch_size` once, at
        start, into a dense lookup (`Scheduler.dynamic_sd_lookup`) that it reads at every scheduling step, and
        the workers draft the k the scheduler hands them (`num_spec_tokens_to_schedule`). When the engine core
        runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as `in_process_engine()` sets), the lookup is
        rebuilt with vLLM's own builder and swapped: True. With the engine core in its own process nothing
        reaches it (no engine-core utility call does this): False, the schedule stays as built. On a CUDA
        machine build the LLM with a schedule (vLLM then runs piecewise CUDA graphs for the varying verify
        length) before changing it at run time."""
        if self.spec is None:
            raise RuntimeError("this LLM has no drafter: nothing to schedule")
        checked = check_schedule(schedule, self.k_max)
        scheduler = getattr(getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None),
                            "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "dynamic_sd_lookup"):
            return False
        # deferred: vLLM (an optional extra; this module imports without it)
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        scheduler.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            checked, vllm_max_batch_size=scheduler.max_num_running_reqs, vllm_num_speculative_tokens=self.k_max)
        self.schedule = checked
        return True

    def target_digest(self) -> dict:
        return self.llm.collective_rpc("tailspec_target_digest")[0]

    def drafter_digest(self) -> dict:
        return self.llm.collective_rpc("tailspec_drafter_digest")[0]

    # -- counters ---------------------------------------------------------------------------------------
    def counters(self) -> SpecCounters:
        return counters_from_metrics(self.llm.get_metrics())

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *, on_progress: ProgressFn | None = None,
                 progress_every_s: float = 0.5, trace: list | None = None,
                 on_step: StepFn | None = None) -> RolloutResult:
        """Generate for token-id prompts (one SamplingParams, or one per prompt), results in prompt order.
        Steps vLLM's engine itself with streamed (delta) outputs, so `on_progress(active, finished,
        tokens_done, tokens_per_s)` is called while it runs (at most every `progress_every_s`, and at the end).
        With `trace` (a list), appends per engine step (requests unfinished before the step, that step's
        SpecCounters) — what k vLLM used at which batch size. `on_step(active, counters, seconds)` gets the
        same per engine step plus the step's wall time (the health guard and the schedule refresh read it);
        it runs between two engine steps, never inside one. Per-step counters cost one metrics read a step
        (about 5 ms on the CPU build), so they are read only when `trace` or `on_step` asks for them."""
        # deferred: vLLM (an optional extra; this module imports without it)
        from vllm.sampling_params import RequestOutputKind

        if not prompts:
            return RolloutResult([], SpecCounters(), 0.0, 0)
        per = _per_prompt_params(prompts, params)
        engine = self.llm.llm_engine
        before = self.counters()
        run = _Run(len(prompts), on_progress, progress_every_s)
        index = _submit(engine, prompts, per, RequestOutputKind.DELTA)
        prev = before
        while engine.has_unfinished_requests():
            active = run.active
            t = time.perf_counter()
            outs = engine.step()
            seconds = time.perf_counter() - t
            if trace is not None or on_step is not None:
                now = self.counters()
                if trace is not None:
                    trace.append((active, now - prev))
                if on_step is not None:
                    on_step(active, now - prev, seconds)
                prev = now
            run.fold(outs, index)
        return RolloutResult(run.finish(), self.counters() - before, run.seconds, run.steps)

    def close(self) -> None:
        """Shut the engine down (its worker processes, if any) now rather than at interpreter exit."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


def _per_prompt_params(prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
    per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    return per


class _Run:
    """One generate call's outputs as they stream in (delta outputs per engine step), and its progress."""

    def __init__(self, n: int, on_progress: ProgressFn | None, every_s: float):
        self.n, self.on_progress, self.every_s = n, on_progress, every_s
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float] | None] = [None] * n
        self.final: dict[int, Any] = {}
        self.steps, self.last, self.seconds = 0, 0.0, 0.0
        self.t0 = time.perf_counter()

    @property
    def active(self) -> int:
        return self.n - len(self.final)

    def fold(self, outs: Sequence[Any], index: dict[str, int]) -> None:
        for out in outs:
            i = index.get(out.request_id)
            if i is None:  # another caller's request on the same engine
                continue
            o = out.outputs[0]
            self.tokens[i].extend(o.token_ids)
            if o.logprobs is not None:
                lps = [float(lp[t].logprob) for lp, t in zip(o.logprobs, o.token_ids)]
                self.logprobs[i] = (self.logprobs[i] or []) + lps
            if out.finished:
                self.final[i] = o
        self.steps += 1
        if self.on_progress is not None and time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self.report()

    def report(self) -> None:
        n = sum(len(t) for t in self.tokens)
        dt = time.perf_counter() - self.t0
        self.on_progress(self.active, len(self.final), n, n / dt if dt > 0 else 0.0)

    def finish(self) -> list[Completion]:
        self.seconds = time.perf_counter() - self.t0
        if self.on_progress is not None:
            self.report()
        missing = [i for i in range(self.n) if i not in self.final]
        if missing:
            raise RuntimeError(f"vLLM returned no final output for prompts {missing[:8]}")
        return [_completion(self.tokens[i], self.logprobs[i], self.final[i]) for i in range(self.n)]


def _submit(engine: Any, prompts: Sequence[Sequence[int]], per: Sequence[Any], delta: Any) -> dict[str, int]:
    """Add every prompt to vLLM's engine with streamed (delta) outputs, so progress counts tokens as they
    come; returns request id -> prompt index (ids are unique per call, so another caller's requests on the
    same engine are told apart)."""
    tag = uuid.uuid4().hex[:8]
    index: dict[str, int] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, per)):
        sp = sp.clone()
        sp.output_kind = delta
        rid = f"tailspec-{tag}-{i}"
        index[rid] = i
        engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
    return index


def _completion(tokens: list[int], logprobs: list[float] | None, last: Any) -> Completion:
    m = getattr(last, "spec_decode_metrics", None)
    if m is not None:
        d = m.to_dict()
        return Completion(tokens, last.finish_reason, logprobs, d["mean_acceptance_length"],
                          d["num_draft_tokens"], d["num_accepted_draft_tokens"])
    return Completion(tokens, last.finish_reason, logprobs, None)
