"""Configuration: one pydantic model per section of the YAML file (cluster, scheduler, trainer, rollout, ...),
loaded from YAML, then `TAILSPEC_*` environment variables, then CLI `key.path=value` overrides (later wins).

Every model forbids unknown keys, so a typo fails loudly with its key path instead of being
silently ignored. `ConfigError` messages name the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "TAILSPEC_"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key path."""


class _Section(BaseModel):
    # NaN / inf refused everywhere (no setting means either); a number given for a text setting is its text
    # (`--set trainer.checkpoint_dir=2024` is the directory "2024").
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              coerce_numbers_to_str=True)


def _check_redis_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"must start with redis://, rediss:// (TLS) or unix://, got {url[:80]!r}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs a socket path")
        return url
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {url[:80]!r}") from None
    if not parts.hostname or (port is not None and not 1 <= port <= 65535):
        raise ValueError(f"needs a host (and a port in 1..65535), got {url[:80]!r}")
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"the path must be a database number, got {db[:20]!r}")
    return url


def _check_path(v: str) -> str:
    if not v.strip() or "\x00" in v:
        raise ValueError("must be a non-empty path without NUL characters")
    return v


class ClusterConfig(_Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="namespace of Redis keys")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL (password/TLS ok: "
                           "rediss://:PASSWORD@host:6380/0?ssl_ca_certs=/path/ca.pem; see docs/integrations.md)")
    node: str = Field("node0", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="this node's name in single-node mode")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return _check_redis_url(v)


class SchedulerConfig(_Section):
    telemetry: Literal["auto", "nvml", "simulated"] = "auto"
    sample_period_s: float = Field(0.2, gt=0, le=10)
    history_maxlen: int = Field(20_000, ge=100, le=100_000_000, description="capped length of the telemetry history stream")
    idle_util_threshold: float = Field(10.0, ge=0, le=100, description="percent utilization below which a GPU looks idle")
    idle_window_s: float = Field(0.2, ge=0, le=3600, description="how long utilization must stay low before a drained GPU is lendable")
    lease_ttl_s: float = Field(2.0, gt=0, le=60)
    leader_ttl_s: float = Field(3.0, gt=0, le=60, description="lifetime of the leader key among a cluster's "
                                "schedulers: the leader renews it every tick (keep it several tick_s); a standby "
                                "takes over within this (plus a tick) of the leader's death or partition")
    stop_deadline_s: float = Field(1.0, gt=0, le=60, description="after this a revoked GPU counts as reclaimed")
    session_startup_s: float = Field(0.5, ge=0, le=3600, description="expected session start-up cost; lend only if the tail is longer")
    mode: Literal["local", "ray"] = "local"
    warm_sessions: int = Field(0, ge=0, le=64, description="session processes kept pre-started (imports done) "
                               "in single-node mode, so a lent GPU starts training at once")
    warm_policy: str | None = Field(None, description="a policy directory (absolute) whose model the warm session "
                                    "processes build while they wait: each session then loads its own policy "
                                    "version's weights into it (same config.json), not the modules anew")
    warm_read_ahead: bool = Field(True, description="warm session processes read the newest policy and lineage "
                                  "head into host memory between lends, on the host's CPU share (tailspec/warm.py)")
    lend: bool = Field(True, description="false: watch and count idle GPU time but never lend (baselines)")
    session_nice: int = Field(0, ge=0, le=19, description="niceness of single-node session processes; >0 where "
                              "simulated GPUs share the host's CPU cores with rollout workers, so a session takes "
                              "only the CPU the tail leaves idle (on real GPUs leave 0)")
    session_entry: str = Field(
        "tailspec.session_entry:ENTRY",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="module:attribute of the session entry started on a lent GPU: an object with run(ctx), "
        "warm_up() and prestage() (scheduler.session_process.SessionEntry), or a plain function of the context "
        "(nothing to warm up or read ahead)",
    )
    tick_s: float = Field(0.05, gt=0, le=5, description="period of the scheduler's decision loop")
    simulated_gpus: int = Field(4, ge=1, le=64, description="GPUs per node shown by simulated telemetry")
    simulated_gpu_cpus: Literal["split", "shared"] = Field(
        "split", description="split: each simulated GPU owns an equal share of the host's cores, used by its rollout "
        "worker and any session lent on it: whole cores, or, with more GPUs than cores, 0.45 of a core each under "
        "a CPU quota (cgroup; a tenth stays the host's) where one can be set, else fewer GPUs; shared: all cores "
        "shared by everything")
    simulated_gpu_env: dict[int, dict[str, str]] = Field(
        default_factory=dict, description="per simulated GPU, environment its sessions start with, over the "
        "dispatcher's (CUDA_VISIBLE_DEVICES = the GPU's index): where simulated GPUs are shares of real CUDA devices "
        "(`tailspec demo --device cuda`), the device each one runs on and its CUDA MPS share")
    simulated_gpu_device: int | None = Field(
        None, ge=0, description="NVML index of the CUDA device the simulated GPUs share, if they do: each simulated "
        "GPU's sample then carries that device's NVML readings (utilisation, memory, power) beside its simulated "
        "utilisation, and `simulated_gpu_sharing` as its label")
    simulated_gpu_sharing: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$",  # a one-line label
                                       description="how the simulated GPUs share `simulated_gpu_device` (e.g. 'MPS "
                                       "25% of the SMs each', 'time-sliced')")
    progress_ttl_s: float = Field(5.0, gt=0, le=3600, description="a worker's progress expires unless re-reported within this")
    require_release: bool = Field(False, description="lend a drained GPU only after its worker reported its memory "
                                  "released (report_progress(mem_released=True)); a worker that reports "
                                  "mem_released=False is never lent before it reports True, whatever this says")
    lend_on_release: bool = Field(True, description="a drained GPU whose worker reported its memory released is "
                                  "idle at once, without idle_window_s (a busy sample after the drain still "
                                  "puts it back on the window); false: the window applies to every GPU")
    min_free_mem_gib: float = Field(0.0, ge=0, le=1e6, description="lend only when at least this much GPU memory is free "
                                    "(telemetry, and the worker's own report); sessions that declined raise the bar "
                                    "to what they computed they need")
    simulated_gpu_mem_gib: float = Field(80.0, gt=0, le=1e6, description="memory of each simulated GPU (what simulated "
                                         "telemetry shows and what a session on one checks its footprint against)")

    @field_validator("warm_policy")
    @classmethod
    def _warm_policy(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isabs(_check_path(v)):
            raise ValueError(f"must be an absolute path (every node's sessions read it), got {v[:200]!r}")
        return v


class TrainerConfig(_Section):
    backend: Literal["torch", "deepspeed"] = "torch"
    lr: float = Field(3e-4, gt=0, le=1)
    bootstrap_lr: float | None = Field(None, gt=0, le=1, description="lr of the offline first drafter (the demo's "
                                       "bootstrap); None: lr. Sessions on lent GPUs fine-tune it at lr")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay (momentum) of the drafter's optimizer")
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    batch_size: int = Field(16, ge=1, le=4096)
    micro_batch_size: int = Field(
        0, ge=0, le=4096, description="split a step's batch, sorted by length, into micro-batches of this many samples "
        "whose gradients accumulate; a stop after one of them still takes the step on those done (0 = the whole "
        "batch at once; torch backend only)")
    ttt_length: int = Field(3, ge=1, le=7, description="test-time-training unroll length L")
    step_decay: float = Field(0.8, gt=0, le=1, description="loss weight 0.8^i of unroll step i")
    weighting: Literal["reward", "advantage", "uniform"] = "reward"
    weight_min: float = Field(0.1, ge=0, le=1e6)
    weight_max: float = Field(5.0, gt=0, le=1e6)
    draft_vocab_size: int | None = Field(None, ge=2, le=1 << 24, description="None = the target's vocabulary")
    max_seq_len: int = Field(1024, ge=8, le=1 << 20)
    buffer_size: int = Field(4096, ge=1, le=10_000_000, description="samples kept in the replay buffer")
    keep_policy_versions: int = Field(2, ge=1, le=1_000_000, description="keep samples of the most recent N policy versions")
    stale_version_weight: float = Field(
        0.5, ge=0, le=1, description="a sample n policy versions older than the newest is drawn with weight w^n "
        "(0 = train on the newest version's samples only)")
    checkpoint_dir: str = "runs/drafter"
    target_source: Literal["rollout", "teacher"] = Field(
        "rollout", description="a training batch's targets (aux states, logits): `rollout` uses those the rollout "
        "shipped with its samples when every sample has them, else the teacher's forward; `teacher` always runs "
        "the current policy's forward (drafter_trainer/rollout_targets.py)")
    validation_k: int = Field(4, ge=1, le=16)
    seed: int = Field(0, ge=0, lt=2**32, description="random seed (numpy takes 0..2^32-1)")
    holdout_fraction: float = Field(0.1, ge=0, lt=1, description="share of samples held out for validation")
    validation_samples: int = Field(64, ge=1, le=1_000_000, description="held-out samples a candidate is validated on")
    validate_every_s: float = Field(30.0, gt=0, le=1e7, description="a long session proposes a candidate this often")
    merge_every_steps: int = Field(10, ge=0, le=1_000_000_000, description="a session merges its work into the lineage head this "
                                   "often (and when it stops); 0 = only when it stops. Rounds: a head is published "
                                   "every this many rounds (at least 1)")
    merge_moments_every: int = Field(4, ge=1, le=1_000_000_000, description="a merge writes the session's AdamW "
                                     "moments this often (and in the merge a stop makes); the merges between "
                                     "carry the head's, a few merges old (1: every merge writes its own)")
    merge_rule: Literal["async", "rounds"] = Field(
        "rounds", description="how contributors combine their work: `rounds` (default) takes one optimizer step per "
        "round over every contributor's gradient, exchanged over a collective (rounds.py; needs Redis and the torch "
        "backend: a lineage without Redis, or the DeepSpeed backend, merges `async`); `async` merges each session's local steps into the head "
        "(lineage.py)")
    round_wait: float = Field(2.0, ge=0, le=100, description="rounds: a round closes when every member is in, or "
                              "this many times its first entry's compute time after that entry")
    round_timeout_s: float = Field(10.0, gt=0, le=3600, description="rounds: each collective of a round (the "
                                   "rendezvous, a joiner's catch-up, the all-reduce) and its commit vote waits at "
                                   "most this, or round_wait x the round's compute time when that is longer")
    round_max_lr_scale: float = Field(2.0, ge=1, le=64, description="rounds: a round steps at lr x the sum of its "
                                      "entries' batch shares, at most this (linear scaling, capped)")
    merge_outer_lr: float = Field(1.0, gt=0, le=2, description="outer step: head += merge_outer_lr * (local - base)")
    merge_delayed_beta1: float | None = Field(
        None, ge=0, lt=1, description="AdamW's beta1 for the chunk after a merge that found other sessions' merges "
        "since its base (asynchrony acts as momentum); beta1 after a merge that found none, so one contributor "
        "is plain training. None (default): beta1 throughout, the rule off; 0 helped two contributors training "
        "a fresh drafter, and made the demo's mid-run heads worse (docs/architecture.md, Delay)")
    promotion_level: float = Field(0.05, gt=0, lt=0.5, description="a candidate is promoted when a one-sided "
                                   "lower confidence bound of its paired gain is above zero; the test looks twice "
                                   "(at promotion_min_pairs samples and at the end), each at level / 2")
    promotion_min_pairs: int = Field(16, ge=2, le=1_000_000, description="held-out samples a promotion test needs at "
                                     "least; the interim look is made when this many are scored")
    propose_min_steps: int = Field(
        1, ge=1, le=1_000_000_000, description="a lineage head is proposed (validated) only when it holds at least this "
        "many optimizer steps more than the last head proposed: on lends shorter than a validation, validating every "
        "merged step would spend the lent time validating instead of training")

    @model_validator(mode="after")
    def _weights_ordered(self) -> "TrainerConfig":
        if self.weight_min > self.weight_max:
            raise ValueError(f"weight_min ({self.weight_min}) must not exceed weight_max ({self.weight_max})")
        return self

    @field_validator("checkpoint_dir")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_path(v)


class RolloutConfig(_Section):
    """The native engine's settings (the demo's rollout workers build their engines from this section)."""

    drafter: Literal["eagle3", "ngram", "draft_model", "none"] = Field(
        "eagle3", description="drafter kind; none = plain decoding (the demo has eagle3, ngram and none)")
    selector: Literal["adaptive", "fixed", "beg", "threshold"] = "adaptive"
    k: int = Field(4, ge=0, le=16, description="draft length for the fixed and threshold selectors")
    k_max: int = Field(8, ge=1, le=16, description="longest draft any selector may pick")
    max_batch: int = Field(64, ge=1, le=4096, description="running requests per engine (more wait their turn)")
    max_seq_len: int = Field(1024, ge=8, le=1 << 20, description="prompt + response tokens per request (the KV "
                             "cache's length)")
    epsilon: float = Field(0.05, ge=0, le=1, description="exploration rate of the adaptive selector")
    drafter_carry: float = Field(1.0, ge=0, le=1, description="share of the adaptive selector's acceptance counts "
                                 "a promoted drafter version keeps from the version before it (1: all of them, a "
                                 "conservative start, since a promoted version's paired test showed it at least as "
                                 "good; 0: it starts over from its validated acceptance)")
    verify_rule: Literal["residual", "coupled"] = Field(
        "coupled", description="exact speculative sampling rule of the native engine: coupled (drafter-invariant: "
        "a Gumbel race shared by drafter and target, so a rollout is the same tokens with or without speculation, "
        "whatever the drafter and k: speculation changes an RL run's speed and nothing else) or residual (accept "
        "with min(1, p/q), else draw from the residual: the highest acceptance, tokens depend on the drafter). "
        "vLLM rollouts sample with vLLM's own rule")
    trees: bool = Field(True, description="the adaptive selector's space holds token trees beside the chains "
                        "(rollout.cost_model.DEFAULT_TREES, with a drafter that drafts trees: EAGLE-3); false: chains only")
    cuda_graphs: bool = Field(True, description="capture the verify forward's CUDA graphs (on CUDA only)")
    graph_memory_budget_mb: int = Field(2048, ge=0, le=1 << 24, description="memory the CUDA graph pool may take")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the policy's dtype in the engine")
    guard: bool = Field(True, description="drafter health guard: after each drafter load/reload and policy sync, "
                        "turn speculation off when live acceptance shows the drafter broken (rollout.health_guard)")
    guard_window_steps: int = Field(16, ge=1, le=10_000, description="speculative decode steps per guard verdict")
    guard_floor: float = Field(1.05, ge=1.0, le=2.0, description="tokens per forward at or below which the "
                               "drafter is broken, whatever it was validated at")
    guard_min_gain_share: float = Field(0.5, ge=0.0, le=1.0, description="live gain below this share of the "
                                        "validated gain (at the same draft lengths): broken")


class DashboardConfig(_Section):
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9_.:\[\]%-]{1,255}$", description="address to bind")
    port: int = Field(8300, ge=1, le=65535)
    metrics_port: int = Field(9300, ge=1, le=65535)
    allow_remote: bool = Field(False, description="must be true to bind a non-loopback host")


class TaskConfig(_Section):
    name: Literal["runsum"] = "runsum"
    modulus: int = Field(10, ge=2, le=1000)
    steps_median: float = Field(5.0, gt=1, le=1e6)
    steps_sigma: float = Field(0.8, ge=0, le=100)
    steps_min: int = Field(2, ge=1, le=1_000_000)
    steps_max: int = Field(48, ge=2, le=1_000_000)
    format_score: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _steps_ordered(self) -> "TaskConfig":
        if self.steps_min > self.steps_max:
            raise ValueError(f"steps_min ({self.steps_min}) must not exceed steps_max ({self.steps_max})")
        return self
    # The second scratchpad style (tailspec/tasks/runsum.py): the share of the pre-training corpus written in
    # it (None: the policy preset's own rate, 0.1 for `deep`, 0 for the others), and the reward bonus a
    # well-formed response in that style earns (what GRPO shifts the policy toward: the drift that makes a
    # frozen drafter go stale).
    alt_style_rate: float | None = Field(None, ge=0, le=0.5, description="share of the pre-training corpus in "
                                         "the alternative style (None: the policy preset's)")
    # 1.0: enough for the demo's GRPO (10 steps, lr 1e-4) to move `deep` to the alternative style, the drift a
    # frozen drafter goes stale on; a smaller bonus leaves the coupled verify rule's trajectory nearly in place
    style_bonus: float = Field(1.0, ge=0, le=2, description="reward bonus of a well-formed response in the "
                               "alternative style")


class TailspecConfig(_Section):
    cluster: ClusterConfig = ClusterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    trainer: TrainerConfig = TrainerConfig()
    rollout: RolloutConfig = RolloutConfig()
    dashboards: DashboardConfig = DashboardConfig()
    task: TaskConfig = TaskConfig()
    cache_dir: str = Field(default_factory=lambda: os.environ.get("TAILSPEC_CACHE", str(Path.home() / ".cache" / "tailspec")))

    @field_validator("cache_dir")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_path(v)


def _set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    keys = [k for k in path.split(".") if k]
    if not keys:
        raise ConfigError(f"empty key path in override {path!r}")
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{path}: {k!r} is a value, not a section")
        node = nxt
    node[keys[-1]] = value


def _parse_scalar(raw: str) -> Any:
    # YAML's scalar rules: "3" → 3, "true" → True, "null" → None, "[1, 2]" → list.
    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an integer too long to convert
        return raw
    if isinstance(value, str):  # YAML 1.1 leaves "1e-3" a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`TAILSPEC_SCHEDULER__LEASE_TTL_S=3` → {"scheduler": {"lease_ttl_s": 3}} (double underscore nests)."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == "TAILSPEC_CACHE" or key == "TAILSPEC_CONFIG":
            continue
        path = ".".join(part.lower() for part in key[len(ENV_PREFIX):].split("__"))
        _set_path(tree, path, _parse_scalar(raw))
    return tree


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(root)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key (check the spelling; `tailspec config show` lists every key)")
            continue
        got = e.get("input")
        allowed = e.get("ctx", {}).get("expected")
        try:
            shown = repr(got)
        except ValueError:  # an integer too long to print
            shown = f"an integer of {got.bit_length()} bits"
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        msg = f"{path}: {e['msg']} (got {shown})"
        if allowed:
            msg += f"; allowed: {allowed}"
        lines.append(msg)
    return f"invalid configuration from {source}:\n  " + "\n  ".join(lines)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TailspecConfig:
    """Build the effective config: defaults < YAML file < TAILSPEC_* env < `key.path=value` overrides."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("TAILSPEC_CONFIG")
    tree: dict[str, Any] = {}
    source = "defaults"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
        source = str(p)
    env_tree = env_overrides(environ)
    if env_tree:
        tree = _merge(tree, env_tree)
        source += " + TAILSPEC_* environment"
    cli_tree: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        k, v = item.split("=", 1)
        _set_path(cli_tree, k.strip(), _parse_scalar(v))
    if cli_tree:
        tree = _merge(tree, cli_tree)
        source += " + command-line overrides"
    try:
        return TailspecConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def dump_config(cfg: TailspecConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
