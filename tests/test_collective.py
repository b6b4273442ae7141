"""A round's collective (drafter_trainer/collective.py) on a real redis-server and gloo: ranks meet through Redis,
all-reduce and broadcast move flat tensors, a rank that never comes ends the rendezvous at its timeout, and a rank
SIGKILLed inside an all-reduce ends it at the others with CollectiveFailed, well within the timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from tailspec.drafter_trainer.collective import CollectiveFailed, Exchange, RedisStore, flatten, unflatten

REPO = Path(__file__).resolve().parent.parent

# A rank of a 3-rank all-reduce in its own process: `python test_collective.py URL RANK N`. It prints "in" just
# before the all-reduce and then "ok SECONDS" or "failed SECONDS".
_RANK = """
import sys, time, redis, torch
from tailspec.drafter_trainer.collective import CollectiveFailed, Exchange
url, rank, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ex = Exchange(redis.Redis.from_url(url), "t:collective:", torch.device("cpu"))
ex.join("kill", rank, 3, timeout)
flat = torch.ones(n)
for i in range(1000):
    print("in", flush=True)
    t0 = time.monotonic()
    try:
        ex.all_reduce(flat, timeout)
    except CollectiveFailed as e:
        print("failed", time.monotonic() - t0, str(e)[:200], flush=True)
        break
"""


def in_threads(fn, size: int) -> list:
    out: list = [None] * size

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except (CollectiveFailed, RuntimeError, AssertionError) as e:  # the test reads it
            out[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_ranks_meet_through_redis_and_sum_and_broadcast(redis_url):
    def rank_fn(rank: int):
        ex = Exchange(redis.Redis.from_url(redis_url), "t:collective:", torch.device("cpu"))
        ex.join("g1", rank, 3, 10.0)
        flat = torch.full((1000,), float(rank + 1))
        ex.all_reduce(flat, 10.0)
        b = torch.full((5,), float(rank))
        ex.broadcast(b, 2, 10.0)
        again = ex.join("g1", rank, 3, 10.0)  # the same group is kept
        return flat, b, again is ex.group, ex.built

    for flat, b, kept, built in in_threads(rank_fn, 3):
        assert torch.equal(flat, torch.full((1000,), 6.0)) and torch.equal(b, torch.full((5,), 2.0))
        assert kept and built == 1


def test_a_rank_that_never_comes_ends_the_rendezvous_at_its_timeout(redis_url):
    ex = Exchange(redis.Redis.from_url(redis_url), "t:collective:", torch.device("cpu"))
    t0 = time.monotonic()
    with pytest.raises(CollectiveFailed):
        ex.join("alone", 0, 2, 1.0)
    assert time.monotonic() - t0 < 5.0 and ex.group is None


def test_a_rank_that_stops_answering_ends_the_all_reduce_at_its_timeout(redis_url):
    def rank_fn(rank: int):
        ex = Exchange(redis.Redis.from_url(redis_url), "t:collective:", torch.device("cpu"))
        ex.join("g2", rank, 2, 1.0)
        if rank == 1:
            time.sleep(4.0)  # in the group (its connections open), never in the all-reduce
            return None
        t0 = time.monotonic()
        try:
            ex.all_reduce(torch.ones(10), 1.0)
        except CollectiveFailed:
            return time.monotonic() - t0
        return -1.0

    took, _ = in_threads(rank_fn, 2)
    assert isinstance(took, float) and 0.5 < took < 5.0


def test_a_rank_sigkilled_inside_an_all_reduce_fails_it_at_the_others_within_the_timeout(redis_url):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, redis_url, str(rank), str(8_000_000), "30"],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) for rank in range(3)]
    try:
        victim = procs[2]
        for _ in range(3):  # a few all-reduces in, then SIGKILL it inside one
            assert victim.stdout.readline().strip() == "in"
        time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        for p in procs[:2]:
            out = p.communicate(timeout=60)[0].splitlines()
            failed = [line for line in out if line.startswith("failed")]
            assert failed and float(failed[0].split()[1]) < 30.0, out[-3:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def test_flatten_and_unflatten_keep_every_value():
    ts = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    back = unflatten(flatten(ts), ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, back))


def test_the_store_keeps_bytes_and_counts(redis_client):
    store = RedisStore(redis_client, "t:s/", 1.0)
    store.set("k", b"\x00\x01")
    assert store.get("k") == b"\x00\x01" and store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["k", "n"]) and not store.check(["k", "nope"])
    assert 0 < redis_client.ttl("t:s/k") <= 3600
    with pytest.raises(CollectiveFailed):
        store.wait(["nope"], None)
