"""The projection's KV reads per running row (paged attention: each row reads its own context) against a
token-by-token reference, and what the roofline's context slope is."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tailspec.simulate import hardware as hw
from tailspec.simulate.replica import finish_times
from tailspec.simulate.run import context_slope
from tests.test_simulate import reference_finish_wide


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(1, 6), st.integers(-5, 9)), min_size=5, max_size=5),
       st.lists(st.floats(0.1, 2.0), min_size=4, max_size=4), st.lists(st.floats(0.0, 0.5), min_size=4, max_size=4))
def test_finish_times_with_every_rows_own_context(max_batch, reqs, g_vals, h_vals):
    lengths = [float(a) for a, _ in reqs]
    ctx0 = [float(c) for _, c in reqs]  # below the table's context too: the term is a correction either way
    g, h = np.array([0.0] + g_vals), np.array([0.0] + h_vals)
    got = finish_times(np.array([lengths]), max_batch, g, h, np.array([ctx0]), per_row=True)[0]
    want = reference_finish_wide(lengths, ctx0, max_batch, g, h, width=sum)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_roofline_context_slope_is_its_kv_reads_per_row_position():
    """Plain decode at 64 rows of a 7B on an H100 is memory-bound at every context: one more position of one
    row's context costs its KV bytes at the achieved bandwidth. A speculative step at one row also reads the
    drafter layer's own K/V once per drafter forward (k of them)."""
    roof = hw.Roofline(hw.resolve_model("qwen2.5-7b"), hw.resolve_gpu("H100"))
    bw = roof.bandwidth_bytes_s
    slope = context_slope(roof, 512, 512 + 16384)
    assert np.isclose(slope(None, 64, 0), roof.model.kv_bytes_per_token / bw, rtol=1e-6)
    drafter = roof.drafter_kv_bytes_per_token * roof.drafter_attention / bw
    assert np.isclose(slope(None, 1, 3), roof.model.kv_bytes_per_token / bw + 3 * drafter, rtol=1e-6)


def test_the_secant_never_undercuts_the_roofline():
    """Where a verify of many rows is compute-bound at short contexts, the linear term errs toward the slower
    step: the table's time at the first-step context plus the slope is >= the roofline at every context between."""
    roof = hw.Roofline(hw.resolve_model("qwen2.5-7b"), hw.resolve_gpu("H100"))
    lo, hi = 512, 512 + 16384
    slope = context_slope(roof, lo, hi)
    for b in (1, 8, 64):
        for k in (0, 2, 4):
            for ctx in np.linspace(lo, hi, 9):
                linear = roof.step_s(b, k, lo) + slope(None, b, k) * b * (ctx - lo)
                assert linear >= roof.step_s(b, k, ctx) * (1 - 1e-9), (b, k, ctx)
