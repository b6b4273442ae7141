"""Published RL results as checks: each published setting configured as closely as the projection allows, its
published figure beside the projected one.

Each `Anchor` names its source (RESEARCH.md, "Newer anchors" and "2026"), the figure compared, what of the
setting is published and what the projection had to assume where the source does not say; a miss comes with its
likely cause. No constant of the model is set per anchor: every anchor runs the model's defaults (hardware.py's
CONSTANTS) on its own setting, and only what the source publishes (model, GPUs, pipeline, drafter, k, acceptance)
or what the anchor's assumptions name differs from `Scenario()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tailspec.simulate.drafter import DrafterCurve
from tailspec.simulate.fit import alpha_for
from tailspec.simulate.run import Scenario, simulate

TOLERANCE = 0.25  # |projected / published - 1| within this counts as a hit

FIGURES: dict[str, Callable[[dict], float]] = {
    "rollout_speedup_frozen": lambda s: s["rollout_speedup_frozen"],
    "speedup_frozen": lambda s: s["speedup_frozen"],
    "speedup_cotrained": lambda s: s["speedup_cotrained"],
}


def steady(acceptance: float, k: int) -> DrafterCurve:
    """A drafter at a published acceptance length at draft length k, not decaying (the anchors' drafters were
    reported steady or are scored at their mean)."""
    a = alpha_for(acceptance, k)
    return DrafterCurve(alpha0=a, alpha_max=a, decay=0.0)


@dataclass(frozen=True)
class Anchor:
    name: str
    source: str
    figure: str  # a key of FIGURES
    published: float
    bound: str  # "=" a reported value, ">" a lower bound ("over"), "<=" a best case ("up to")
    scenario: Scenario
    assumed: list[str] = field(default_factory=list)  # what the source does not say
    miss_cause: str = ""  # the likely cause where the projection misses


DAPO = {"prompts_per_replica": 64.0, "group": 16, "max_len": 20480}  # the DAPO paper's recipe: 512 prompts x 16, 20,480


def anchors(steps: int = 5) -> list[Anchor]:
    nemo = Scenario(model="qwen3-8b", gpu="GB200", gpus=32, k=3, k_max=3, length_median=1000, steps=steps,
                    curve=steady(2.47, 3))
    nemo_assumed = ["response lengths log-normal, median 1,000 tokens, sigma 0.9 (not published)",
                    "4 prompts x 16 responses per replica (not published)"]
    return [
        Anchor("NeMo-RL rollout, Qwen3-8B RL-Zero", "NeMo-RL (arXiv 2604.26779): generation 100 -> 56.6 s, "
               "EAGLE-3 k = 3, acceptance 2.47, 32 GB200, synchronous", "rollout_speedup_frozen", 1.8, "=", nemo,
               nemo_assumed, "the roofline's verify and drafter costs; the lengths"),
        Anchor("NeMo-RL rollout, Qwen3-8B RL-Think", "NeMo-RL (arXiv 2604.26779): generation 133.6 -> 87.0 s, "
               "acceptance 2.05 at k = 3", "rollout_speedup_frozen", 1.54, "=", replace(nemo, curve=steady(2.05, 3)),
               nemo_assumed + ["RL-Think's longer traces not modelled: the RL-Zero lengths"],
               "RL-Think's traces are longer than the assumed lengths"),
        Anchor("SkyRL step, Qwen3.5-9B DAPO", "SkyRL with MTP: 8 x H100, k = 3, acceptance 3.32, step 1.62x",
               "speedup_frozen", 1.62, "=",
               Scenario(model="qwen3-8b", gpu="H100", gpus=8, k=3, k_max=3, steps=steps, curve=steady(3.32, 3), **DAPO),
               [("Qwen3.5-9B modelled as Qwen3-8B (its config is not in our sources; its linear-attention layers "
                 "keep no growing KV cache)"), "the MTP head costed as a one-layer EAGLE-3 drafter",
                ("the DAPO paper's batch (512 prompts x 16, responses up to 20,480) with the default length "
                 "distribution"), "the update at the assumed MFU 0.4"],
               "the update's share of the step (the assumed MFU and the lengths decide it)"),
        Anchor("SkyRL rollout, Qwen3.5-9B DAPO", "SkyRL with MTP: rollout 2.03x", "rollout_speedup_frozen", 2.03, "=",
               Scenario(model="qwen3-8b", gpu="H100", gpus=8, k=3, k_max=3, steps=steps, curve=steady(3.32, 3), **DAPO),
               ["as SkyRL step"],
               "an MTP head over Qwen3.5's hybrid attention costs more per draft than the roofline's drafter"),
        Anchor("Marin RL steps, frozen EAGLE-3, GH200", "Marin: 1.42x RL steps, acceptance 2.53-2.56 over 36 steps",
               "speedup_frozen", 1.42, "=",
               Scenario(model="qwen3-8b", gpu="GH200", gpus=64, k=3, k_max=3, steps=steps, curve=steady(2.545, 3)),
               ["an 8B policy (Marin's model and GPU count are not in our sources): Qwen3-8B on 64 GH200",
                "k = 3", "the default batch and lengths"],
               "the policy, batch and lengths are assumed; the update's share of a step decides a step figure"),
        Anchor("Bebop end to end, async", "Bebop (Qwen): up to 1.8x end to end, asynchronous, MTP",
               "speedup_frozen", 1.8, "<=",
               Scenario(model="qwen3-235b-a22b", gpu="H100", gpus=256, pipeline="async", k=3, k_max=3, steps=steps,
                        curve=steady(3.32, 3)),
               [("model, GPUs and acceptance not in our sources: Qwen3-235B-A22B on 256 H100 with SkyRL's MTP "
                 "acceptance 3.32 at k = 3")],
               "the setting is assumed almost whole; only the shape (acceptance linear in entropy) is used, as a "
               "drift prior"),
        Anchor("TLT end to end", "TLT: over 1.7x end to end (adaptive drafter trained on idle rollout GPUs)",
               "speedup_cotrained", 1.7, ">",
               Scenario(model="qwen2.5-7b", gpu="H100", gpus=64, steps=steps),
               ["Qwen2.5-7B on 64 H100, synchronous, the default drafter curve (drafter.py: assumed)"],
               "the co-trained drafter's curve is assumed, not measured at this scale"),
        Anchor("NeMo-RL 235B async end to end (their simulator)", "NeMo-RL: 2.5x end to end projected at 235B, "
               "asynchronous (a projection, not a measurement)", "speedup_frozen", 2.5, "<=",
               Scenario(model="qwen3-235b-a22b", gpu="GB200", gpus=256, pipeline="async", k=3, k_max=3, steps=steps,
                        curve=steady(2.47, 3)),
               ["256 GB200, EAGLE-3 at the 8B run's acceptance 2.47, k = 3"],
               ("two projections; in ours a verify of k + 1 tokens a row reads more of an MoE's experts than a "
                "plain step does (ModelSpec.weight_bytes_read), so speculation gains a 235B MoE little")),
    ]


def check(a: Anchor) -> dict:
    """Project the anchor's setting; published beside projected, and whether it hits."""
    s = simulate(a.scenario).summary()
    projected = FIGURES[a.figure](s)
    ratio = projected / a.published
    # a lower bound is met by anything above it; a reported value, or a best case ("up to"), within TOLERANCE
    hit = ratio >= 1 - TOLERANCE if a.bound == ">" else abs(ratio - 1) <= TOLERANCE
    return {"name": a.name, "figure": a.figure, "published": a.published, "bound": a.bound, "projected": projected,
            "ratio": ratio, "hit": hit, "source": a.source, "assumed": a.assumed,
            "likely_cause": "" if hit else a.miss_cause, "label": "projection vs published"}


def check_all(steps: int = 5) -> list[dict]:
    return [check(a) for a in anchors(steps)]
