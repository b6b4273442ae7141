"""Per-GPU Gantt chart of one projected step (PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tailspec.simulate.step import StepOut

COLORS = {"decode": "#4878d0", "tail idle": "#d0d0d0", "lent: starting": "#f2c45a", "lent: training": "#6acc64",
          "lent: validating": "#2a7a3a", "reclaiming": "#ee854a", "train": "#8c613c"}


def gantt(out: StepOut, train_s: float, sync: bool, startup_s: float, path: str | Path, title: str,
          max_rows: int = 64) -> Path:
    # deferred: matplotlib (about a second); choosing its Agg backend is a process-wide side effect, made only
    # when a chart is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = np.argsort(out.finish)[::-1]
    if len(order) > max_rows:  # keep the shape: evenly spaced replicas by finish time
        order = order[np.linspace(0, len(order) - 1, max_rows).round().astype(int)]
    fig, ax = plt.subplots(figsize=(10, 0.12 * len(order) + 1.8))
    for y, r in enumerate(order):
        for state, a, b in _bars(out, r, train_s, sync, startup_s):
            ax.barh(y, b - a, left=a, color=COLORS[state], height=0.85, linewidth=0)
    ax.set_yticks([])
    ax.set_xlabel("seconds from the rollout's start")
    ax.set_ylabel(f"replicas ({len(order)} of {len(out.finish)}, by finish time)")
    ax.set_title(f"{title} (projection)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="lower right", fontsize=7, ncols=3)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _bars(out: StepOut, r: int, train_s: float, sync: bool, startup_s: float) -> list[tuple[str, float, float]]:
    f, lent, rec = out.finish[r], out.lending.lent[r], out.lending.reclaimed[r]
    end = out.phase_end + out.wait_s
    b = [("decode", 0.0, f)]
    if np.isnan(lent):
        b.append(("tail idle", f, end))
    else:
        started = min(out.phase_end, lent + startup_s)
        val = float(out.validating[r])
        b += [("tail idle", f, lent), ("lent: starting", lent, started), ("lent: training", started, out.phase_end - val),
              ("lent: validating", out.phase_end - val, out.phase_end), ("reclaiming", out.phase_end, rec),
              ("tail idle", rec, end)]
    if sync:
        b.append(("train", end, end + train_s))
    return [x for x in b if x[2] > x[1]]
