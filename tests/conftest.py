"""Shared fixtures: a private redis-server per test session, a local Ray cluster with fake GPUs,
and marker handling (gpu / vllm tests skip cleanly where their hardware or package is missing)."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Tests run on 2 shared cores: one intra-op thread per process keeps parallel workers from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (make vllm-env installs the CPU build)"))


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free loopback port, no persistence; stopped by pid at the end."""
    from tailspec.redis_server import start_redis

    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session's redis-server, flushed before each test."""
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 4 fake GPUs (num_gpus=4); shut down at the end of the session."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def test_output_dir(tmp_path_factory):
    """Where tests leave artefacts worth looking at (screenshots, plots): test-output/ at the repo root."""
    from pathlib import Path

    out = Path(__file__).resolve().parent.parent / "test-output"
    out.mkdir(exist_ok=True)
    return out


@pytest.fixture(scope="session", autouse=True)
def _cpu_quotas_left_behind():
    """Tests that SIGKILL a scheduler leave its simulated GPUs' CPU quotas (scheduler/cpu_quota.py) behind: remove
    the ones made while this test session ran that no process is in any more. A quota with processes in it is a
    live run's, perhaps not this session's: a bench run beside the tests lost its quotas to this clean-up (its
    lends failed on the missing cgroup.procs) when it emptied and removed every new one."""
    from tailspec.scheduler import cpu_quota

    base, _ = cpu_quota.root()
    before = set(os.listdir(base)) if base is not None else set()
    yield
    if base is not None:
        for name in set(os.listdir(base)) - before:
            path = os.path.join(base, name)
            try:
                empty = not open(os.path.join(path, "cgroup.procs")).read().split()
            except OSError:
                continue
            if name.startswith("tailspec-") and empty:
                cpu_quota.remove(path)
