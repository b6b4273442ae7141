"""The drafter lineage: concurrent merges lose nothing and apply nothing twice, fencing refuses a session
without its GPU, the head always loads, collection leaves no stale directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tailspec.core import state
from tailspec.drafter_trainer.checkpoint import load_checkpoint
from tailspec.drafter_trainer.lineage import DUPLICATE, FENCED, MERGED, Fence, Lineage, snapshot
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
from tailspec.scheduler.leases import Leases

torch.set_num_threads(1)


def tiny_drafter() -> Eagle3Module:
    cfg = Eagle3Config(target_hidden_size=16, hidden_size=16, vocab_size=32, draft_vocab_size=32, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=64, aux_layer_ids=(1, 2, 3), target_num_layers=4)
    torch.manual_seed(0)
    d = Eagle3Module(cfg)
    with torch.no_grad():  # integer-valued weights: sums of integer deltas are exact in float32
        for p in d.parameters():
            p.copy_(torch.randint(-4, 5, p.shape).float())
    return d


@pytest.fixture(params=["redis", "local"])
def lineage_root(request, tmp_path, redis_client):
    return tmp_path / "lineage", (redis_client if request.param == "redis" else None)


def test_concurrent_merges_lose_nothing(lineage_root):
    root, r = lineage_root
    init = tiny_drafter()
    Lineage(root, r, "c").seed(init)
    start = snapshot(init)
    n_threads, merges_each = 4, 6
    errors: list[BaseException] = []

    def contributor(t: int) -> None:
        try:
            lin = Lineage(root, r, "c")
            head, ck = lin.pull()
            d, base = ck.drafter, snapshot(ck.drafter)
            for seq in range(1, merges_each + 1):
                with torch.no_grad():  # this merge's update: +(t+1) on every weight, over seq steps
                    for p in d.parameters():
                        p.add_(float(t + 1))
                res = lin.merge(head, base, d, None, {"step": 0}, f"s{t}", seq, steps=t + 1)
                assert res.code == MERGED
                head = res.head
                with torch.no_grad():  # continue from the merged head
                    for n, p in d.named_parameters():
                        p.copy_(res.weights[n])
                base = snapshot(d)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=contributor, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    lin = Lineage(root, r, "c")
    head, ck = lin.pull()
    total = sum((t + 1) * merges_each for t in range(n_threads))
    # every update is in the head exactly once
    for n, p in ck.drafter.named_parameters():
        assert torch.equal(p.detach(), start[n] + total), n
    assert head.steps == total == sum(lin.contributions().values())
    assert head.merges == n_threads * merges_each
    assert lin.contributions() == {"seed": 0, **{f"s{t}": (t + 1) * merges_each for t in range(n_threads)}}
    # collection keeps the head and the head it replaced (the fallback if the head's files are damaged) only;
    # no temp directory is left
    left = sorted(p.name for p in root.iterdir() if p.name.startswith(("head-", ".head-")))
    assert head.path.split("/")[-1] in left and len(left) == 2, left
    assert f"head-{head.number - 1:08d}-" in [n[:14] for n in left], left


def test_a_merge_is_applied_once(lineage_root):
    root, r = lineage_root
    d = tiny_drafter()
    lin = Lineage(root, r, "c")
    lin.seed(d)
    head, ck = lin.pull()
    base = snapshot(ck.drafter)
    with torch.no_grad():
        next(ck.drafter.parameters()).add_(1.0)
    assert lin.merge(head, base, ck.drafter, None, {}, "s", 1, steps=3).code == MERGED
    # the same (session, seq) again — a retry whose answer was lost — is refused, whatever the head is now
    again = lin.merge(lin.head(), base, ck.drafter, None, {}, "s", 1, steps=3)
    assert again.code == DUPLICATE
    assert lin.head().steps == 3 and lin.contributions() == {"seed": 0, "s": 3}


def test_merges_are_fenced_by_the_lease(redis_client, tmp_path):
    leases = Leases(redis_client, "c")
    lease = leases.acquire("n0", 0, "s", ttl_s=30)
    d = tiny_drafter()
    Lineage(tmp_path, redis_client, "c").seed(d)

    def merge(fence: Fence, seq: int) -> int:
        lin = Lineage(tmp_path, redis_client, "c", fence=fence)
        head, ck = lin.pull()
        base = snapshot(ck.drafter)
        with torch.no_grad():
            next(ck.drafter.parameters()).add_(1.0)
        return lin.merge(head, base, ck.drafter, None, {}, "s", seq, steps=1).code

    assert merge(Fence("n0", 0, lease.token), 1) == MERGED
    assert merge(Fence("n0", 0, lease.token + 99), 2) == FENCED  # not this GPU's token
    leases.revoke("n0", 0, lease.token)
    assert merge(Fence("n0", 0, lease.token), 3) == MERGED  # revoked: its stop may still merge
    redis_client.delete(state.key("c", "revoke", node="n0", gpu=0))
    assert merge(Fence("n0", 0, lease.token), 4) == FENCED  # lease gone, no revocation covers it
    assert Lineage(tmp_path, redis_client, "c").head().steps == 2


def test_one_contributor_is_plain_training(tmp_path):
    """With nobody else merging, the head is the session's weights bit for bit."""
    d = tiny_drafter()
    lin = Lineage(tmp_path, None, "c")
    lin.seed(d)
    head, ck = lin.pull()
    base = snapshot(ck.drafter)
    with torch.no_grad():
        for p in ck.drafter.parameters():
            p.mul_(1.37).add_(0.11)
    res = lin.merge(head, base, ck.drafter, None, {}, "s", 1, steps=1)
    merged = load_checkpoint(res.head.path).drafter
    for (n, a), b in zip(merged.named_parameters(), ck.drafter.parameters()):
        assert torch.equal(a, b), n


def test_concurrent_seeders_agree_on_one_head(lineage_root):
    """Every fresh session seeds with its own drafter at once: one wins, the head loads, nobody deletes it."""
    root, r = lineage_root
    heads, errors = [], []

    def seeder(i: int) -> None:
        try:
            d = tiny_drafter()
            with torch.no_grad():
                next(d.parameters()).add_(float(i))
            lin = Lineage(root, r, "c")
            lin.seed(d, session_id=f"s{i}")
            heads.append(lin.pull()[0])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=seeder, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    lin = Lineage(root, r, "c")
    head, ck = lin.pull()
    assert head.number == 1 and {h.path for h in heads} == {head.path}
    assert lin.contributions() == {"seed": 0}


def _adam_state(d: Eagle3Module, fill: float) -> dict:
    """An AdamW state over the drafter's trainable parameters whose moments all hold `fill`."""
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    for st in opt.state.values():
        st["exp_avg"].fill_(fill)
        st["exp_avg_sq"].fill_(fill)
    return opt.state_dict()


def _moments(ck) -> float:
    vals = {float(t.flatten()[0]) for st in ck.optimizer_state["state"].values() for t in (st["exp_avg"], st["exp_avg_sq"])}
    assert len(vals) == 1, vals
    return vals.pop()


def test_merges_carry_the_heads_moments_and_write_their_own_where_it_cannot_be_carried(tmp_path):
    """A merge with carry_moments links the head's optimizer file (the same file, not a copy) and the new head
    loads whole, also once the head it came from is collected; without carry_moments, or where the head's file is
    damaged, the merge writes the session's own moments."""
    import os  # deferred: only this test looks at inodes

    d = tiny_drafter()
    lin = Lineage(tmp_path, None, "c")
    lin.seed(d, optimizer_state=_adam_state(d, 1.0))
    first = Path(lin.head().path)

    def merge(seq: int, fill: float, carry: bool):
        head, ck = lin.pull()
        with torch.no_grad():
            next(ck.drafter.parameters()).add_(1.0)
        res = lin.merge(head, snapshot(d), ck.drafter, _adam_state(ck.drafter, fill), {"step": seq}, "s", seq, steps=1,
                        carry_moments=carry)
        assert res.code == MERGED
        return Path(res.head.path), load_checkpoint(res.head.path)

    path, ck = merge(1, 2.0, carry=True)
    assert _moments(ck) == 1.0  # the seed's moments, carried
    assert os.stat(path / "optimizer.safetensors").st_ino == os.stat(first / "optimizer.safetensors").st_ino
    for seq in (2, 3):  # the first head is collected; the link keeps its file
        path, ck = merge(seq, float(seq + 1), carry=True)
    assert not first.exists() and _moments(ck) == 1.0
    path, ck = merge(4, 5.0, carry=False)
    assert _moments(ck) == 5.0
    raw = bytearray((path / "optimizer.safetensors").read_bytes())
    raw[-1] ^= 0xFF  # damaged on disk: never passed on
    os.chmod(path / "optimizer.safetensors", 0o644)
    (path / "optimizer.safetensors").unlink()
    (path / "optimizer.safetensors").write_bytes(bytes(raw))
    path, ck = merge(5, 6.0, carry=True)
    assert _moments(ck) == 6.0
