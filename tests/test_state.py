import time

import pytest
from tailspec.core import state
from tailspec.core.state import GpuState, GpuStatus, Lease, Sample, StateError


def test_key_names_are_namespaced():
    assert state.key("c1", "lease", node="n0", gpu=3) == "tailspec:c1:lease:n0:3"
    assert state.key("c1", "samples") == "tailspec:c1:samples"
    with pytest.raises(StateError, match="needs field 'gpu'"):
        state.key("c1", "lease", node="n0")
    with pytest.raises(StateError, match="unknown state key"):
        state.key("c1", "nope")


def test_every_key_is_unique_and_documented():
    templates = [s.template for s in state.KEYS.values()]
    assert len(templates) == len(set(templates))
    assert all(s.doc and s.owner for s in state.KEYS.values())
    table = state.schema_table()
    assert table.count("\n") == len(state.KEYS) + 1


def test_put_get_round_trip_on_real_redis(redis_client):
    k = state.key("t", "gpu_status", node="n0", gpu=0)
    st = GpuStatus(node="n0", gpu=0, state=GpuState.LENT, since=time.time(), lease_token=7)
    state.put(redis_client, k, st)
    assert state.get(redis_client, k, GpuStatus) == st
    assert state.get(redis_client, state.key("t", "gpu_status", node="n0", gpu=1), GpuStatus) is None
    # payloads are plain JSON, readable by any client (no pickle)
    assert redis_client.get(k).startswith(b"{")


def test_expiring_put(redis_client):
    k = state.key("t", "lease", node="n0", gpu=0)
    state.put(redis_client, k, Lease(node="n0", gpu=0, token=1, holder="s", granted_at=0, ttl_s=1), px_ms=50)
    assert redis_client.pttl(k) > 0
    time.sleep(0.1)
    assert state.get(redis_client, k, Lease) is None


def test_malformed_payloads_raise_state_error(redis_client):
    k = state.key("t", "gpu_status", node="n0", gpu=0)
    redis_client.set(k, b'{"node":"n0","gpu":-1,"state":"lent","since":0}')
    with pytest.raises(StateError, match="gpu"):
        state.get(redis_client, k, GpuStatus)
    redis_client.set(k, b"\x80\x04pickle")
    with pytest.raises(StateError):
        state.get(redis_client, k, GpuStatus)
    redis_client.set(k, b'{"node":"n0","gpu":0,"state":"sleeping","since":0}')
    with pytest.raises(StateError, match="state"):
        state.get(redis_client, k, GpuStatus)


def test_stream_append_and_read_skips_bad_entries(redis_client):
    k = state.key("t", "samples")
    good = [Sample(prompt_ids=[1, 2], response_ids=[3, i], reward=1.0, policy_version=0) for i in range(3)]
    state.append(redis_client, k, good[0])
    redis_client.xadd(k, {"data": b"not json"})
    state.append(redis_client, k, good[1])
    bad = []
    got, last = state.read_stream(redis_client, k, Sample, on_bad=lambda i, e: bad.append(i))
    assert [s for _, s in got] == good[:2] and len(bad) == 1
    state.append(redis_client, k, good[2])
    got2, _ = state.read_stream(redis_client, k, Sample, after=last)
    assert [s for _, s in got2] == [good[2]]


def test_encode_rejects_nan_free_form():
    with pytest.raises(ValueError):
        state.encode_dict({"x": float("nan")})


def test_a_samples_targets_path_must_be_absolute():
    """Sessions on any node read a sample's shipped targets: a relative path would name another place on each."""
    from pydantic import ValidationError

    ok = Sample(prompt_ids=[1], response_ids=[2], reward=0.0, policy_version=0, states_path="/shared/t", states_key="0")
    assert ok.states_path == "/shared/t"
    with pytest.raises(ValidationError, match="states_path"):
        Sample(prompt_ids=[1], response_ids=[2], reward=0.0, policy_version=0, states_path="runs/t", states_key="0")
