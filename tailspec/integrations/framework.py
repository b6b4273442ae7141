"""What the TRL, verl and OpenRLHF adapters share: their vLLM engines as one reload target for `LiveVllm`, the
checks before a reload, the promotion watcher over those engines (`follow_promotions`: each promoted version
loaded through the roof's one drafter loader, `tailspec.drafter_load.load_drafter`), publishing the newest HF
checkpoint as a policy version, the promoted record the engines were started with, the reclaim wait's record,
and the settings files' refusal of unknown keys. Each adapter keeps only what its framework differs in: how a
reload reaches an engine, where the checkpoints are, how samples are read from its batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tailspec.core import state
from tailspec.core.atomic import link_or_copy
from tailspec.core.state import DrafterVersion
from tailspec.drafter_load import load_drafter
from tailspec.integrations.policy import PolicyPublisher
from tailspec.rollout.health_guard import GuardPolicy
from tailspec.rollout.vllm_backend import SpecCounters, process_counters
from tailspec.rollout.vllm_checks import (
    DrafterMismatch,
    DrafterSpec,
    aux_layer_ids,
    eagle3_problems,
    read_json,
    safetensors_shapes,
    speculative_config,
)
from tailspec.rollout.vllm_live import LiveVllm

log = logging.getLogger(__name__)

RemoteCall = Callable[[list[Any]], list[Any]]  # waits for a list of Ray object refs (ray.get)


def check_reloadable(policy_dir: Path, live: Path, new: Path) -> None:
    """The checks VllmRollout makes before a reload: the new export fits the target, has the live drafter's
    aux layers and exactly its tensors (`t2d` aside: vLLM has none). DrafterMismatch names what differs."""
    problems = eagle3_problems(read_json(policy_dir, "policy"), new)
    if problems:
        raise DrafterMismatch(f"drafter {new} does not fit target {policy_dir}: " + "; ".join(problems))
    if aux_layer_ids(read_json(live, "drafter")) != aux_layer_ids(read_json(new, "drafter")):
        raise DrafterMismatch(f"aux layer ids of {new} differ from the live drafter's ({live})")
    old = {k: v for k, v in safetensors_shapes(live).items() if k != "t2d"}
    cur = {k: v for k, v in safetensors_shapes(new).items() if k != "t2d"}
    if old != cur:
        raise DrafterMismatch(f"drafter {new} has other tensors than the live one ({live}): "
                              f"{sorted(set(old.items()) ^ set(cur.items()))[:6]}")


def drafter_speculative_config(drafter_dir: str | Path, model_dir: str | Path, k: int,
                               schedule: list[tuple[int, int, int]] | None = None) -> dict:
    """vLLM's `speculative_config` for a framework's engines: tailspec's EAGLE-3 export checked against the
    policy (the same checks and dict as `VllmRollout`, rollout.vllm_checks), before any engine starts."""
    return speculative_config(DrafterSpec("eagle3", Path(drafter_dir), k=k, schedule=schedule), model_dir)


class RemoteEngines:
    """A framework's vLLM engines in the shape `LiveVllm` drives (`spec`, `k_max`, `reload_drafter`,
    `set_schedule`): a reload is checked once here and sent to every engine by `_send`. Their engine cores run
    in processes of their own, so the k schedule stays as started."""

    def __init__(self, call: RemoteCall, policy_dir: str | Path, drafter_path: str | Path, k: int,
                 max_num_seqs: int = 256):
        self.call = call
        self.policy_dir, self.drafter_path = Path(policy_dir), Path(drafter_path)
        self.spec = DrafterSpec("eagle3", self.drafter_path, k=k)
        self.max_num_seqs = max_num_seqs
        self.schedule = None
        self.reloads = 0

    @property
    def k_max(self) -> int:
        return int(self.spec.k)

    def _send(self, path: Path) -> dict:
        """Load the checked export at `path` into every engine; what was reached (e.g. {"engines": n})."""
        raise NotImplementedError

    def handles(self) -> dict[str, Any]:
        """The engines' actor handles by name (one per engine or replica)."""
        raise NotImplementedError

    def counters(self) -> dict[str, SpecCounters]:
        """Every engine's cumulative speculative-decoding counters. vLLM's front end counts in the engine
        actor's own process, so Ray's `__ray_call__` runs `process_counters` there; only plain dicts come
        back."""
        handles = self.handles()
        got = self.call([h.__ray_call__.remote(process_counters) for h in handles.values()])
        return {name: SpecCounters.from_dict(d) for name, d in zip(handles, got)}

    def reload_drafter(self, path: str | Path) -> dict:
        path = Path(path)
        check_reloadable(self.policy_dir, self.drafter_path, path)
        t0 = time.perf_counter()
        reached = self._send(path)
        self.drafter_path = path
        self.reloads += 1
        return {**reached, "total_seconds": time.perf_counter() - t0}

    def set_schedule(self, schedule: Any) -> bool:
        return False


class CallWindow:
    """The health guard's view of engines that generate on their own: their counters read when a batch starts
    and when it is back; the difference per engine goes to `LiveVllm.observe_engines`. A read that fails
    (an engine restarted, a Ray error) skips that batch's verdicts, never the batch."""

    def __init__(self, engines: RemoteEngines):
        self.engines = engines
        self.before: dict[str, SpecCounters] | None = None

    def begin(self) -> None:
        self.before = self._read()

    def end(self, names: dict[str, str] | None = None) -> dict[str, SpecCounters]:
        """Per engine (renamed by `names` where given): what the batch drafted and accepted."""
        before, self.before = self.before, None
        after = self._read()
        if before is None or after is None:
            return {}
        names = names or {}
        return {names.get(k, k): c - before[k] for k, c in after.items() if k in before}

    def _read(self) -> dict[str, SpecCounters] | None:
        try:
            return self.engines.counters()
        except Exception as e:  # noqa: BLE001 - the guard's read must never fail a rollout
            log.warning("tailspec: the engines' spec-decode counters were not read (%s); no guard verdict this batch",
                        e)
            return None


class BatchWatch:
    """What an adapter does around each generation batch of engines that generate on their own (a framework's):
    before it, the guards re-armed when the policy weights moved since the last batch (the framework synced
    them) or the engines woke from sleep, a pending rollback and a promoted version (`LiveVllm.between_calls`),
    and the counters' first read; after it, each engine's counters judged (`LiveVllm.observe_engines`)."""

    def __init__(self, live: LiveVllm, engines: RemoteEngines, synced: int | None = None):
        self.live = live
        self.window = CallWindow(engines) if live.guard is not None else None
        self.synced = synced  # the policy version whose weights the engines hold (None: known from the first batch)
        self.batches = 0

    def before(self, policy_version: int, woke: bool = False) -> None:
        """The engines are awake and idle; `woke`: they slept since the last batch."""
        if self.synced is not None and policy_version != self.synced:
            self.live.synced(policy_version, "policy_sync")
        elif woke and self.batches:
            self.live.synced(event="wake")
        self.synced = policy_version
        self.batches += 1
        self.live.between_calls()
        if self.window is not None:
            self.window.begin()

    def after(self, names: dict[str, str] | None = None) -> list[dict]:
        """The batch is back: the guards' verdicts on it (as dicts), engines renamed by `names`."""
        if self.window is None:
            return []
        return [asdict(v) for v in self.live.observe_engines(self.window.end(names))]


def guard_policy(settings: Any) -> GuardPolicy | None:
    """The health guard an adapter's settings ask for (None: off). Its window counts drafts: the adapters see
    each batch's totals, not the engines' steps."""
    if not settings.guard:
        return None
    return GuardPolicy(window_steps=settings.guard_window_drafts, floor=settings.guard_floor,
                       min_gain_share=settings.guard_min_gain_share)


@dataclass
class AttachStats:
    """What an attachment did, for tests and logs (wall-clock times, time.time())."""

    waits: list[dict] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    samples: int = 0
    samples_dropped: int = 0
    loads: list[Any] = field(default_factory=list)  # per batch: the engines' or replicas' request counts
    verdicts: list[dict] = field(default_factory=list)  # the health guard's, per engine, in order


def copy_tree(src: Path) -> Callable[[Path], None]:
    """A `PolicyPublisher` writer: `src`'s files hard-linked (copied where links are refused), so the
    framework's checkpoint rotation cannot pull them from under a session."""
    def write(tmp: Path) -> None:
        for f in sorted(src.rglob("*")):
            target = tmp / f.relative_to(src)
            if f.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                link_or_copy(f, target)
    return write


def publish_newest(publisher: PolicyPublisher, found: tuple[int, Path] | None, model_dir: Path,
                   stats: AttachStats) -> tuple[int, Path] | None:
    """Publish the framework's newest HF checkpoint `found` = (version, dir) if it is newer than the last
    published one (the base model `model_dir` as version 0 before any); returns the latest published."""
    latest = publisher.latest()
    if found is not None and (latest is None or found[0] > latest[0]):
        publisher.publish(found[0], copy_tree(found[1]))
        stats.published.append(found[0])
    elif latest is None and (model_dir / "config.json").is_file():
        publisher.publish(0, copy_tree(model_dir))
        stats.published.append(0)
    return publisher.latest()


def started_version(client: Any, cluster: str, version: int | None) -> DrafterVersion | None:
    """The promoted record the engines were started with (`version`), so the first poll does not reload it."""
    if version is None:
        return None
    cur = state.get(client.r, state.key(cluster, "drafter_current"), DrafterVersion)
    return cur if cur is not None and cur.version == version else None


def follow_promotions(engines: RemoteEngines, client: Any, cluster: str, started: int | None, worker: str,
                      guard: GuardPolicy | None) -> LiveVllm:
    """The promotion watcher over a framework's engines: `LiveVllm`, each promoted version loaded through
    `load_drafter` (its EAGLE-3 export, written once) and the version the engines were started with (`started`,
    while it is still the promoted one) not loaded again. `worker` names the guard's verdicts."""
    return LiveVllm(engines, redis=client.r, cluster=cluster, prepare=load_drafter,
                    version=started_version(client, cluster, started), worker=worker, guard=guard)


def wait_reclaimed(client: Any, timeout_s: float, step: int, stats: AttachStats) -> None:
    """The update's wait for lent GPUs to come back, recorded in `stats.waits`."""
    w = client.wait_reclaimed(timeout_s=timeout_s)
    stats.waits.append({"step": step, "waited_s": w.waited_s, "reclaimed": w.reclaimed, "held": list(w.held),
                        "error": w.error, "returned_at": time.time()})


def refuse_unknown(cls: type, data: dict) -> None:
    """A settings file's keys must all be fields of `cls`: unknown ones are refused by name."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown tailspec settings {unknown}; known: {sorted(known)}")
