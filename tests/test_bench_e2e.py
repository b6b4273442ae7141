"""bench e2e's step split: the slowest worker's setup / decode / rest, per mode (the JSON's `tail_worker_s`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tailspec.benchmarks.e2e import _tail_split


def test_tail_split_is_the_slowest_workers_seconds_per_step():
    rows = [SimpleNamespace(worker_busy_s={"w0": 1.0, "w1": 3.0}, worker_setup_s={"w0": 0.1, "w1": 0.2},
                            worker_decode_s={"w0": 0.8, "w1": 2.5}),
            SimpleNamespace(worker_busy_s={"w0": 2.0, "w1": 1.0}, worker_setup_s={"w0": 0.3, "w1": 0.1},
                            worker_decode_s={"w0": 1.5, "w1": 0.7})]
    got = _tail_split(rows)  # step 1: w1 (3.0 s), step 2: w0 (2.0 s)
    assert got == pytest.approx({"setup": 0.25, "decode": 2.0, "other": 0.25})
    assert sum(got.values()) == pytest.approx((3.0 + 2.0) / 2)  # the parts add up to the slowest worker's time
