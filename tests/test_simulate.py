"""`tailspec simulate`: the decode model against a step-by-step reference, the projection's properties, the
published-configuration check, calibration on a recorded demo run, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailspec.simulate import hardware as hw
from tailspec.simulate.calibrate import calibrate
from tailspec.simulate.drafter import DrafterCurve, DrafterState
from tailspec.simulate.fit import alpha_for
from tailspec.simulate.replica import finish_times
from tailspec.simulate.run import Scenario, simulate

RUN = Path(__file__).parent / "data" / "demo-run"


def reference_finish(lengths: list[float], max_batch: int, g: np.ndarray) -> list[float]:
    """Continuous batching, one request at a time: the row closest to done finishes next."""
    waiting, active, t, p = list(range(len(lengths))), {}, 0.0, 0.0
    out = [0.0] * len(lengths)
    while waiting and len(active) < max_batch:
        i = waiting.pop(0)
        active[i] = lengths[i]
    while active:
        i = min(active, key=lambda j: (active[j], j))
        t += (active[i] - p) * g[len(active)]
        p = active.pop(i)
        out[i] = t
        if waiting:
            j = waiting.pop(0)
            active[j] = p + lengths[j]
    return out


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.lists(st.lists(st.integers(1, 60), min_size=7, max_size=7), min_size=1, max_size=4),
       st.lists(st.floats(0.1, 3.0), min_size=6, max_size=6))
def test_finish_times_match_a_step_by_step_reference(max_batch, rows, g_vals):
    g = np.array([0.0] + g_vals)
    got = finish_times(np.array(rows, dtype=float), max_batch, g)
    for r, lengths in enumerate(rows):
        assert np.allclose(got[r], reference_finish([float(x) for x in lengths], max_batch, g))


SMALL = Scenario(gpus=16, steps=4, prompts_per_replica=2, group=8, length_median=800, max_len=4096)


@settings(max_examples=12, deadline=None)
@given(st.integers(200, 3000), st.sampled_from(["sync", "async"]))
def test_no_tail_nothing_lent(median, pipeline):
    proj = simulate(replace(SMALL, length_sigma=0.0, length_median=median, pipeline=pipeline))
    assert all(r.lent_gpu_s == 0 and r.training_gpu_s == 0 for r in proj.rows)
    sync = [r for r in proj.rows if r.mode == "nospec"]
    if pipeline == "sync":
        assert all(r.tail_idle_gpu_s < 1e-6 for r in sync)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["qwen2.5-7b", "qwen3-32b"]), st.sampled_from(["sync", "async"]), st.integers(0, 5))
def test_no_acceptance_never_speeds_up(model, pipeline, seed):
    proj = simulate(replace(SMALL, model=model, pipeline=pipeline, seed=seed, curve=DrafterCurve(alpha0=0.0, alpha_max=0.0)))
    s = proj.summary()
    assert s["speedup_frozen"] <= 1 + 1e-9 and s["speedup_cotrained"] <= 1 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 0.95), st.floats(0, 0.95), st.floats(0, 0.2), st.floats(0, 1e8), st.floats(0, 1e8),
       st.integers(0, 30))
def test_more_training_never_lowers_acceptance(a0, amax, decay, t1, extra, staleness):
    a0, amax = min(a0, amax), max(a0, amax)
    a, b = DrafterState(DrafterCurve(a0, amax, decay)), DrafterState(DrafterCurve(a0, amax, decay))
    for d in (a, b):
        d.staleness = staleness
    a.train(t1)
    b.train(t1 + extra)
    assert b.alpha >= a.alpha - 1e-12
    with pytest.raises(ValueError, match="below alpha0"):
        DrafterCurve(alpha0=0.7, alpha_max=0.6)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["qwen2.5-7b", "qwen3-32b", "qwen3-235b-a22b"]), st.sampled_from(["sync", "async"]),
       st.sampled_from([16, 32, 64]), st.integers(0, 3))
def test_gpu_states_sum_to_gpus_times_step(model, pipeline, gpus, seed):
    tp = hw.min_tp(hw.MODELS[model], hw.GPUS["H100"])
    if gpus % tp or (pipeline == "async" and gpus < 2 * tp):
        return
    proj = simulate(replace(SMALL, model=model, gpus=gpus, pipeline=pipeline, seed=seed))
    for r in proj.rows:
        assert sum(r.states.values()) == pytest.approx(gpus * r.step_s, rel=1e-9)
        assert min(r.states.values()) >= -1e-6


def test_published_setting_projects_a_rollout_speedup():
    """NeMo-RL's Qwen3-8B setting (32 GB200, frozen drafter at 2.47 tokens per step, k = 3) projects a rollout
    speedup above 1 and at most the draft length's ceiling; BENCHMARKS.md compares it with the 1.5-1.8x
    reported."""
    curve = DrafterCurve(alpha0=alpha_for(2.47, 3), decay=0.0)
    s = simulate(Scenario(model="qwen3-8b", gpu="GB200", gpus=32, k=3, k_max=3, length_median=1000, steps=4,
                          curve=curve)).summary()
    assert 1.3 < s["rollout_speedup_frozen"] < 2.47


def test_hf_config_counts_parameters(tmp_path):
    cfg = {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = hw.model_from_hf_config(tmp_path)
    assert m.params_b == pytest.approx(7.6, rel=0.03)  # Qwen2.5-7B's published 7.61B
    with pytest.raises(ValueError, match="not a decoder config"):
        (tmp_path / "config.json").write_text("{}")
        hw.model_from_hf_config(tmp_path)


def test_calibration_on_a_recorded_demo_run():
    """Replaying a recorded default demo run (deep policy, 6 co-trained steps, 2 simulated GPUs) with its own
    measured costs predicts the mean rollout time, the idle GPU-seconds the scheduler counted and the reclaimed
    share within 15%."""
    from tailspec.commands.simulate import run_policy_model

    c = calibrate(RUN, model=run_policy_model(str(RUN)))
    assert c.steps == 6 and c.mode == "cotrained"
    assert c.rel_error["rollout_s"] <= 0.15
    assert c.rel_error["reclaimed_share"] <= 0.15
    assert c.rel_error["idle_gpu_s"] <= 0.15


def test_cli_projection_and_gantt(tmp_path):
    png = tmp_path / "gantt.png"
    out = subprocess.run([sys.executable, "-m", "tailspec.cli", "simulate", "--gpus", "32", "--steps", "3",
                          "--gantt", str(png), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["label"] == "projection" and result["gpus"] == 32
    assert "projection:" in out.stdout
    assert png.stat().st_size > 1000


def test_cli_bad_input_is_named(tmp_path):
    bad = tmp_path / "lengths.jsonl"
    bad.write_text('{"length": 100}\n{"length": -3}\n')
    out = subprocess.run([sys.executable, "-m", "tailspec.cli", "simulate", "--lengths-trace", str(bad), "--steps", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lengths.jsonl:2" in out.stderr
    out = subprocess.run([sys.executable, "-m", "tailspec.cli", "simulate", "--model", "gpt-9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown model 'gpt-9'" in out.stderr


def reference_finish_wide(lengths, ctx0, max_batch, g, h, width=max):
    """Continuous batching token by token: each step of `dp` tokens of progress costs (g(b) + h(b) W) dp, W the
    widest running row's width (its ctx0 plus the progress since it entered), or with `width=sum` the running
    rows' widths summed. Widths grow linearly, so the step's midpoint is exact."""
    waiting, active, t, p, dp = list(range(len(lengths))), {}, 0.0, 0.0, 1e-3
    out, start = [0.0] * len(lengths), {}
    while waiting and len(active) < max_batch:
        i = waiting.pop(0)
        active[i], start[i] = lengths[i], 0.0
    while active:
        i = min(active, key=lambda j: (active[j], j))
        while p < active[i] - 1e-12:
            step = min(dp, active[i] - p)
            w = width(ctx0[j] + p + step / 2 - start[j] for j in active)
            t += step * (g[len(active)] + h[len(active)] * w)
            p += step
        p = active.pop(i)
        out[i] = t
        if waiting:
            j = waiting.pop(0)
            active[j], start[j] = p + lengths[j], p
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(1, 6), st.integers(0, 9)), min_size=5, max_size=5),
       st.lists(st.floats(0.1, 2.0), min_size=4, max_size=4), st.lists(st.floats(0.0, 0.5), min_size=4, max_size=4))
def test_finish_times_with_a_growing_attention_width(max_batch, reqs, g_vals, h_vals):
    """The context term: every step also pays h(b) per position of its widest running row's width."""
    lengths = [float(a) for a, _ in reqs]
    ctx0 = [float(c) for _, c in reqs]
    g, h = np.array([0.0] + g_vals), np.array([0.0] + h_vals)
    got = finish_times(np.array([lengths]), max_batch, g, h, np.array([ctx0]))[0]
    want = reference_finish_wide(lengths, ctx0, max_batch, g, h)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.allclose(finish_times(np.array([lengths]), max_batch, g, np.zeros_like(h), np.array([ctx0]))[0],
                       finish_times(np.array([lengths]), max_batch, g)[0])


SPEC_OFF = dict(sampler_bytes_per_logit=0.0, kv_write_share=0.0, drafter_attention=0.0, draft_rescore=False,
                spec_host_s=0.0)


def old_roofline_step(r: hw.Roofline, b: int, k: int, c: float) -> float:
    """The roofline before the speculation terms: verify bytes = weights + KV reads, k drafter forwards of its
    weights and 2 FLOPs per parameter per row."""
    m, tokens = r.model, b * (k + 1)
    verify = r._forward(m.weight_bytes_read(tokens) + b * c * m.kv_bytes_per_token,
                        tokens * m.flops_per_token(c)) + r.step_overhead_s
    p = m.drafter_params
    return verify + k * (r._forward(p * 2 * r.tp, 2 * p * b * r.tp) + r.draft_overhead_s)


@pytest.mark.parametrize("model,gpu,tp", [("qwen3-8b", "GB200", 1), ("qwen3-32b", "H100", 2),
                                          ("qwen3-235b-a22b", "H100", 16)])
def test_speculation_terms_zero_give_the_plain_roofline(model, gpu, tp):
    off = hw.Roofline(hw.MODELS[model], hw.GPUS[gpu], tp, **SPEC_OFF)
    for b in (1, 7, 64, 256):
        for k in (0, 1, 3, 8):
            assert off.step_s(b, k, 2000.0) == pytest.approx(old_roofline_step(off, b, k, 2000.0), rel=1e-12)


def test_speculation_terms_grow_with_k():
    """A verify and a speculative step cost more the more tokens they draft and score; the terms never make a
    step cheaper, and a speculative one pays at least the host work a plain step hides (where a forward is
    compute-bound the extra bytes hide under its FLOPs, so the extra is not monotone in k by itself)."""
    m, g = hw.MODELS["qwen3-8b"], hw.GPUS["GB200"]
    on, off = hw.Roofline(m, g), hw.Roofline(m, g, **SPEC_OFF)
    for b in (1, 64, 256):
        extra = [on.step_s(b, k, 1500.0) - off.step_s(b, k, 1500.0) for k in range(0, 9)]
        assert all(x >= 0 for x in extra) and all(x >= on.spec_host_s for x in extra[1:])
        steps = [on.step_s(b, k, 1500.0) for k in range(0, 9)]
        assert all(later > earlier for earlier, later in zip(steps, steps[1:]))
        verify = [on.verify_s(b, k, 1500.0) for k in range(0, 9)]
        assert all(later > earlier for earlier, later in zip(verify, verify[1:]))
    # the drafter's attention reads grow with the context
    assert on.draft_s(64, 4000.0) > on.draft_s(64, 1000.0) > on.draft_s(64, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        hw.Roofline(m, g, spec_host_s=-1.0)


def test_calibration_context_term():
    """The native engine's attention grows with the widest running row: priced at the warm-up table's seconds
    per FLOP, it makes a long tail cost more, and on the recorded run it brings the idle GPU-seconds closer."""
    from tailspec.simulate.calibrate import EngineAttention, runsum_prompt_len

    assert runsum_prompt_len(19) == 7 and runsum_prompt_len(27) == 10  # 2 and 3 numbers: BOS + 3 per number
    m = hw.model_from_config({"num_hidden_layers": 20, "hidden_size": 128, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 72})
    warm = hw.Roofline(hw.MODELS["qwen2.5-7b"], hw.GPUS["H100"]).cost_model(32, 8, 100.0)
    att = EngineAttention.from_warmup(m, warm, 60.0)
    assert att.seconds_per_flop > 0
    assert att(warm, 1, 3) > att(warm, 1, 0) > 0 and att(warm, 8, 0) == pytest.approx(8 * att(warm, 1, 0))
    from tailspec.commands.simulate import run_policy_model

    deep = run_policy_model(str(RUN))  # the run's policy directory, else its preset (`deep`)
    assert deep is not None and (deep.layers, deep.hidden, deep.heads, deep.head_dim) == (20, 128, 4, 32)
    with_ctx, without = calibrate(RUN, model=deep), calibrate(RUN, model=deep, context=False)
    assert with_ctx.rel_error["idle_gpu_s"] < without.rel_error["idle_gpu_s"]
    assert with_ctx.predicted["idle_gpu_s"] > without.predicted["idle_gpu_s"]


def test_recorded_run_replays_without_the_policy_cache(tmp_path):
    """A run whose policy directory is gone takes the dimensions of the preset it was named after."""
    import shutil

    from tailspec.commands.simulate import run_policy_model

    shutil.copytree(RUN, tmp_path / "run")
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    rec["options"]["policy"] = str(tmp_path / "gone" / "deep-0123456789ab")
    (tmp_path / "run" / "run.json").write_text(json.dumps(rec))
    m = run_policy_model(str(tmp_path / "run"))
    assert m is not None and (m.layers, m.hidden, m.kv_heads, m.vocab) == (20, 128, 2, 72)
    assert calibrate(tmp_path / "run", model=m).rel_error == calibrate(RUN, model=run_policy_model(str(RUN))).rel_error
