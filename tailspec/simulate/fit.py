"""Drafter curves from measured runs: a recorded demo's frozen and co-trained acceptance per step."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tailspec.rollout.selector import geometric_tokens
from tailspec.simulate.drafter import DrafterCurve


def alpha_for(tokens: float, k: int) -> float:
    """The per-token acceptance whose chain of k drafts yields `tokens` per row per step."""
    if k < 1 or not 1 <= tokens <= k + 1:
        raise ValueError(f"acceptance length {tokens} impossible at k={k}")
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if geometric_tokens(mid, k) < tokens else (lo, mid)
    return lo


def curve_from_run(run_dir: str | Path) -> DrafterCurve:
    """alpha0 from the frozen drafter's first measured acceptance, decay from its per-step trend (a log-linear
    fit), alpha_max from the best co-trained acceptance. The demo measures the expected acceptance length
    at the rollout's k (`rollout.k`)."""
    d = Path(run_dir)
    try:
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        k = int(json.loads((d / "run.json").read_text())["config"]["rollout"]["k"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{d}: cannot read metrics.jsonl and run.json: {e}") from e
    frozen = [(r["step"], r["acceptance_frozen"]) for r in rows if r.get("acceptance_frozen")]
    co = [r["acceptance_cotrained"] for r in rows if r.get("acceptance_cotrained")]
    if len(frozen) < 2:
        raise ValueError(f"{d}: fewer than two steps measured the frozen drafter's acceptance")
    alphas = [(s, alpha_for(min(a, k + 1), k)) for s, a in frozen]
    n = len(alphas)
    ms, ml = sum(s for s, _ in alphas) / n, sum(math.log(a) for _, a in alphas) / n
    cov = sum((s - ms) * (math.log(a) - ml) for s, a in alphas)
    var = sum((s - ms) ** 2 for s, _ in alphas)
    slope = cov / var if var else 0.0
    decay = min(max(0.0, 1 - math.exp(slope)), 0.5)
    a0 = alphas[0][1]
    a_max = max([a0] + [alpha_for(min(a, k + 1), k) for a in co])
    return DrafterCurve(alpha0=a0, alpha_max=a_max, decay=decay)
