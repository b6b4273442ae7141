"""The run directory's report: report.md, and PNG plots of the per-GPU timeline, acceptance (co-trained vs
frozen), the step-time split and the reward curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailspec.core import state

STATE_COLORS = {
    "generating": "#4c78a8",
    "drained": "#bab0ac",
    "lent": "#54a24b",
    "reclaiming": "#f58518",
    "unknown": "#eeeeee",
}
STATE_LABELS = {"generating": "generating", "drained": "idle", "lent": "training drafter",
                "reclaiming": "reclaiming", "unknown": "RL trainer / unknown"}


def read_timeline(r: Any, cluster: str) -> list[dict]:
    """Every GPU state transition of the run, oldest first, from the status history stream."""
    entries, _ = state.read_stream(r, state.key(cluster, "status_history"), state.GpuStatus)
    return [e.model_dump(mode="json") for _, e in entries]


def _plt():
    # deferred: matplotlib (about a second) with the Agg backend chosen before pyplot loads; the CLI imports
    # this module to build its parser, and only a report's plots need it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, out: Path, title: str, ylabel: str, xlabel: str = "RL step", legend: bool = True,
          grid: bool = False) -> Path:
    """The per-step plots' shared finish: labels, title, legend/grid, write the PNG, free the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend()
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _plt().close(fig)
    return out


def plot_timeline(timeline: list[dict], steps: list[dict], out: Path, title_note: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 0.6 * max(2, len({(t["node"], t["gpu"]) for t in timeline})) + 1.8))
    t_min = min([t["since"] for t in timeline if t["since"] > 0] + [s["t_start"] for s in steps if "t_start" in s] or [0])
    t_end = max([s.get("t_end", 0) for s in steps] + [t["since"] for t in timeline] or [t_min + 1])
    gpus = sorted({(t["node"], t["gpu"]) for t in timeline})
    seen: set[str] = set()
    for row, g in enumerate(gpus):
        trans = sorted((t for t in timeline if (t["node"], t["gpu"]) == g and t["since"] > 0), key=lambda t: t["since"])
        for a, b in zip(trans, trans[1:] + [None]):
            start, stop = a["since"], (b["since"] if b else t_end)
            st = a["state"]
            label = STATE_LABELS.get(st, st) if st not in seen else None
            seen.add(st)
            ax.barh(row, stop - start, left=start - t_min, color=STATE_COLORS.get(st, "#999"), label=label, height=0.7)
    for s in steps:
        if "t_start" in s:
            ax.axvline(s["t_start"] - t_min, color="black", lw=0.6, ls=":")
    ax.set_yticks(range(len(gpus)))
    ax.set_yticklabels([f"{n}:gpu{g}" for n, g in gpus])
    ax.set_xlabel("seconds since the first rollout (dotted: RL step starts)")
    ax.set_title(f"Per-GPU timeline: generating / idle / training the drafter {title_note}".strip())
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def tail_idle_share(rows: list[dict]) -> float:
    """The long tail's idle GPU-seconds (workers' clocks) ÷ workers x rollout time, over metrics rows."""
    gpu_s = sum(len(r.get("worker_busy_s") or {}) * r["rollout_time_s"] for r in rows)
    return sum(r.get("tail_idle_gpu_seconds", 0.0) for r in rows) / gpu_s if gpu_s else 0.0


def lent_in_tail(rows: list[dict], timeline: list[dict]) -> tuple[float, float]:
    """(GPU-seconds lent while the long tail idled them, the tail's idle GPU-seconds), both on the workers' clocks:
    per step and worker, the GPU's LENT spans (the scheduler's status history) inside [the worker's last result,
    the step's last result]. Unlike the scheduler's own counters, whose idle count starts when the scheduler
    sees a drain, this charges lending with every delay from the drain on."""
    spans: dict[str, list[tuple[float, float]]] = {}
    by_gpu: dict[tuple, list[dict]] = {}
    for t in timeline:
        by_gpu.setdefault((t["node"], t["gpu"]), []).append(t)
    for trans in by_gpu.values():
        trans.sort(key=lambda t: t["since"])
        for cur, nxt in zip(trans, trans[1:] + [None]):
            if cur["state"] == "lent" and cur.get("worker"):
                end = nxt["since"] if nxt is not None else float("inf")
                spans.setdefault(cur["worker"], []).append((cur["since"], end))
    lent = idle = 0.0
    for r in rows:
        done = r.get("worker_finished_at") or {}
        if not done:
            continue
        last = max(done.values())
        for w, f in done.items():
            idle += last - f
            lent += sum(max(0.0, min(e, last) - max(s, f)) for s, e in spans.get(w, []))
    return lent, idle


def plot_acceptance(rows: list[dict], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    # measured every few steps (instrumentation is subsampled): plot the steps that have a value
    for key, style, color, label in (("acceptance_cotrained", "o-", "#54a24b", "co-trained drafter (current version)"),
                                      ("acceptance_frozen", "s--", "#e45756", "frozen copy of the first drafter")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
    return _save(fig, ax, out, "Acceptance on each step's own samples: co-trained vs frozen",
                 "expected acceptance length (k = 4)", grid=True)


def plot_step_split(rows: list[dict], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["step"] for r in rows]
    roll = [r["rollout_time_s"] for r in rows]
    train = [r["train_time_s"] for r in rows]
    ax.bar(x, roll, color="#4c78a8", label="rollout")
    ax.bar(x, train, bottom=roll, color="#f58518", label="RL update + sync")
    return _save(fig, ax, out, "Step-time split", "seconds")


def plot_reward(rows: list[dict], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["step"] for r in rows]
    ax.plot(x, [r["mean_reward"] for r in rows], "o-", label="mean reward")
    ax.set_ylim(0, 1)
    return _save(fig, ax, out, "Reward curve (GRPO on the tiny policy)", "mean reward (exact answer)",
                 legend=False, grid=True)


def num(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def session_split(rows: list[dict]) -> dict[str, float]:
    """The sessions' seconds over the run (ready, train — of it "wait" in synchronous rounds —, validate, all), and
    what none of those covers (merges, the stop, the process's own start and end) as "other"."""
    total = {k: sum((r.get("session_seconds") or {}).get(k, 0.0) for r in rows) for k in ("ready", "train",
                                                                                           "validate", "all", "wait")}
    total["other"] = max(0.0, total["all"] - total["ready"] - total["train"] - total["validate"])
    return total


def lent_split(rows: list[dict], idle: float) -> str:
    s = session_split(rows)
    share = s["train"] / idle if idle else 0.0
    wait = f", {s['wait']:.1f} of them waiting for their round's other members" if s["wait"] else ""
    return (f"- of that, sessions spent {s['train']:.1f} GPU-s in training steps (**{share:.2f}** of the idle "
            f"GPU-seconds{wait}), {s['validate']:.1f} validating candidates, {s['ready']:.1f} starting up and "
            f"{s['other']:.1f} merging and stopping")


def scoring_line(run_dir: Path) -> str | None:
    """Under which strategy mix each promoted, validated version was scored (the demo's version store keeps its
    history under run_dir/drafter/versions): the rollouts' mix when one was published, else a chain of the
    validation k. None when the run promoted none."""
    f = Path(run_dir) / "drafter" / "versions" / "history.jsonl"
    versions = []
    for line in f.read_text().splitlines() if f.is_file() else ():
        try:
            v = state.DrafterVersion.model_validate_json(line)
        except ValueError:
            continue  # a damaged record: the version store's own history says so
        if v.promoted and v.acceptance_length is not None:
            versions.append(v)
    if not versions:
        return None

    def mix(v: state.DrafterVersion) -> str:
        if not v.scored_under:
            return f"chain{v.validation_k or 4} (no rollout strategy mix published yet)"
        return " + ".join(f"{w:.2f} {label}" for label, w in sorted(v.scored_under.items(), key=lambda x: -x[1]))

    return "- promoted versions were scored under (share of decode steps, strategy): " + "; ".join(
        f"v{v.version} {mix(v)}" for v in versions)


def write_report(run_dir: Path, rows: list[dict], timeline: list[dict], meta: dict) -> Path:
    run_dir = Path(run_dir)
    plots = {
        "timeline": plot_timeline(timeline, rows, run_dir / "timeline.png", "(simulated GPUs)"),
        "acceptance": plot_acceptance(rows, run_dir / "acceptance.png"),
        "split": plot_step_split(rows, run_dir / "step_time.png"),
        "reward": plot_reward(rows, run_dir / "reward.png"),
    }
    idle = sum(r["idle_gpu_seconds"] for r in rows)
    lent = sum(r["lent_gpu_seconds"] for r in rows)
    lines = [
        f"# tailspec demo — {meta.get('mode', '')} run",
        "",
        f"- run directory: `{run_dir}`",
        f"- policy: `{meta.get('policy')}`; {meta.get('workers')} rollout workers on **simulated** GPUs "
        "(telemetry derived from the workers' own activity)",
        *([f"- CPU split: {meta['placement']}"] if meta.get("placement") else []),
        f"- steps: {len(rows)}; prompts × group per step: {meta.get('prompts_per_step')} × {meta.get('group_size')}",
        f"- idle GPU-seconds in the long tail: {idle:.1f}; lent to drafter training: {lent:.1f} "
        f"(reclaimed share {lent / idle if idle else 0:.2f})",
        *([lent_split(rows, idle)] if any(r.get("session_seconds") for r in rows) else []),
        f"- long-tail idle share of the rollouts' GPU-seconds (workers' clocks): "
        f"{tail_idle_share(rows):.2f}",
        *([line] if (line := scoring_line(run_dir)) else []),
    ]
    if meta.get("dashboard"):
        lines.append(f"- live dashboard while the run went on: {meta['dashboard']} (read-only; gone with the run)")
    for fmt, path in (meta.get("exported") or {}).items():
        what = "EAGLE-3 directory for vLLM / SGLang" if fmt == "eagle3" else "HF directory (carries embed_tokens)"
        lines.append(f"- exported drafter ({what}): `{path}`")
    for fmt, err in (meta.get("export_errors") or {}).items():
        lines.append(f"- export {fmt} skipped: {err}")
    lines += ["", "| step | step s | rollout s | idle GPU·s | lent GPU·s | drafter v | acc. len | acc. co-trained | "
              "acc. frozen | tok/s | reward | logprob Δ |", "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['step_time_s']:.1f} | {r['rollout_time_s']:.1f} | {r['idle_gpu_seconds']:.1f} | "
            f"{r['lent_gpu_seconds']:.1f} | {num(r['drafter_version'], 'd')} | {r['acceptance_length']:.2f} | "
            f"{num(r['acceptance_cotrained'])} | {num(r['acceptance_frozen'])} | {r['rollout_tokens_per_s']:.0f} | "
            f"{r['mean_reward']:.2f} | {r['logprob_max_abs_diff']:.1e} |")
    lines += ["", "acc. len = tokens emitted per target forward in the rollout itself; acc. co-trained / frozen = expected "
              "acceptance length at k = 4 of each drafter on that step's own samples, current policy as teacher.", ""]
    for name, p in plots.items():
        lines += [f"![{name}]({p.name})", ""]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines).rstrip("\n") + "\n")  # a text file: every line ends with a newline
    (run_dir / "timeline.json").write_text(json.dumps(timeline))
    return out
