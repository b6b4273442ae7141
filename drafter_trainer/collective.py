"""A round's gradient exchange over a collective (torch.distributed: gloo on the CPU, NCCL on CUDA).

The round's participants are fixed when the round closes (rounds.py): its entries, in session order, are the
ranks. They meet through the Redis the cluster already has: `RedisStore` is a torch.distributed Store whose
keys live under `lineage:collective:<group>/` (expiring), so no address is published and no extra server runs.
A group is built once per participant set and reused while the set does not change (the round log names it,
`{r}:g`); a failed collective drops it and the next round builds a new one.

Every operation has a timeout: the group's own (gloo's and NCCL's per-operation timeout) and the wait on its
result. A member SIGKILLed inside an all-reduce ends it with an error at the others (a closed connection), a
member that stops answering ends it at the timeout; either way `CollectiveFailed` is raised and the caller loses
that round only. Nothing is pickled: the exchange moves flat tensors, and the rendezvous's keys and values are
bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Fault-injection seam for tests: called with the operation's name ("all-reduce", "broadcast") when a member enters
# it, before it sends anything (the others are then inside it, waiting); a test process pauses there and is
# SIGKILLed.
FAULT_HOOK: Callable[[str], None] | None = None

STORE_TTL_S = 3600  # a rendezvous key expires this long after it is written (groups are built in seconds)
STORE_POLL_S = 0.001


class CollectiveFailed(RuntimeError):
    """A collective of a round did not complete (a member died, stopped answering, or the rendezvous timed out)."""


class RedisStore(dist.Store):
    """torch.distributed's key-value rendezvous on Redis: the keys a process group's ranks exchange to connect
    (addresses, sequence numbers), under `prefix`, each expiring after STORE_TTL_S."""

    def __init__(self, redis: Any, prefix: str, timeout_s: float):
        super().__init__()
        self.redis, self.prefix, self.timeout_s = redis, prefix, timeout_s

    def set(self, key: str, value: Any) -> None:
        self.redis.set(self.prefix + key, _bytes(value), ex=STORE_TTL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.redis.get(self.prefix + key)
        if value is None:
            raise CollectiveFailed(f"rendezvous key {self.prefix + key} expired")
        return value

    def add(self, key: str, amount: int) -> int:
        pipe = self.redis.pipeline()
        pipe.incrby(self.prefix + key, amount)
        pipe.expire(self.prefix + key, STORE_TTL_S)
        return int(pipe.execute()[0])

    def check(self, keys: list[str]) -> bool:
        return self.redis.exists(*[self.prefix + k for k in keys]) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self.timeout_s
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise CollectiveFailed(f"rendezvous timed out after {limit:.1f} s waiting for {keys[:3]}")
            time.sleep(STORE_POLL_S)

    def delete_key(self, key: str) -> bool:
        return bool(self.redis.delete(self.prefix + key))

    def num_keys(self) -> int:
        return len(self.redis.keys(self.prefix + "*"))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()


def _bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # a list of byte values, as the C++ side hands them


def backend_for(device: torch.device) -> str:
    """The collective backend a round's tensors on `device` use: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Group:
    """One participant set's process group: `gid` is the round log's name for it."""

    gid: str
    rank: int
    size: int
    pg: Any


def make_group(store: dist.Store, rank: int, size: int, timeout_s: float, device: torch.device) -> Any:
    """A process group of `size` ranks rendezvousing through `store`, every operation bounded by `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Exchange:
    """A member's side of its rounds' collectives: the group it is in (one at a time) and the operations on it."""

    def __init__(self, redis: Any, key_prefix: str, device: torch.device):
        self.redis, self.key_prefix, self.device = redis, key_prefix, device
        self.group: Group | None = None
        self.built = 0  # groups built (each a rendezvous)

    def join(self, gid: str, rank: int, size: int, timeout_s: float) -> Group:
        """The group `gid` with this member at `rank`: the one held when it is that one, else a new rendezvous."""
        g = self.group
        if g is not None and (g.gid, g.rank, g.size) == (gid, rank, size):
            return g
        self.drop()
        store = RedisStore(self.redis, f"{self.key_prefix}{gid}/", timeout_s)
        try:
            pg = make_group(store, rank, size, timeout_s, self.device)
        except (RuntimeError, CollectiveFailed) as e:
            raise CollectiveFailed(f"group {gid} (rank {rank} of {size}) did not form: {str(e)[:300]}") from e
        self.group = Group(gid, rank, size, pg)
        self.built += 1
        return self.group

    def drop(self) -> None:
        """Forget the group (after a failure, or when the next round's participants differ)."""
        self.group = None

    def all_reduce(self, flat: torch.Tensor, timeout_s: float) -> None:
        """Sum `flat` across the group, in place (every rank receives the same sum)."""
        self._run(lambda pg: pg.allreduce([flat]), timeout_s, "all-reduce")

    def broadcast(self, flat: torch.Tensor, src: int, timeout_s: float) -> None:
        """`flat` of rank `src` into every rank's `flat`, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._run(lambda pg: pg.broadcast([flat], opts), timeout_s, "broadcast")

    def _run(self, op: Any, timeout_s: float, what: str) -> None:
        g = self.group
        if g is None:
            raise CollectiveFailed(f"{what} without a group")
        if FAULT_HOOK is not None:
            FAULT_HOOK(what)
        try:
            work = op(g.pg)
            if not work.wait(timedelta(seconds=timeout_s)):
                raise CollectiveFailed(f"{what} did not complete within {timeout_s:.1f} s")
        except RuntimeError as e:  # gloo: a closed connection or its own timeout; NCCL: a watchdog abort
            self.drop()
            raise CollectiveFailed(f"{what} in group {g.gid} failed: {str(e)[:300]}") from e
        except CollectiveFailed:
            self.drop()
            raise


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous fp32 tensor of `tensors` in order (the exchange's single message)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut back into tensors shaped (and typed) as `like`."""
    out, at = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[at : at + n].view(t.shape).to(t.dtype))
        at += n
    return out
