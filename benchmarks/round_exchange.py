"""A round's gradient exchange at a real EAGLE-3 head's size (`tailspec bench cotrain --drafter-shape 8b|70b`).

The head is the one an EAGLE-3 drafter of that policy has (drafter_trainer/model.py at the policy's sizes: one
decoder layer, the fc over three hidden states, a 32k draft vocabulary); its weights are random and its gradients
synthetic (the transport does not look at the values). n member processes exchange one fp32 gradient each per
round, two ways:
- `files`: the exchange rounds used before the collective: each member writes its gradient as a safetensors file
  (temp file, rename) on the lineage's filesystem, the members meet in Redis, and each reads every member's file
  and sums them token-weighted (tensor by tensor, so a member holds its sum and one tensor);
- `collective`: drafter_trainer/collective.py as rounds.py runs it: one flat tensor pre-weighted and all-reduced in
  the round's group (built once, through Redis), then cut back into the parameters' shapes, and the round's commit
  vote (one Redis round trip each). The gradients are views of one flat buffer (DDP's bucket layout), so the
  figure leaves out the copy rounds.py makes of the parameters' separate gradients into one tensor.
A round's time is from a common start (a Redis barrier) to the last member done; the figure is the median over
the rounds. Memory: a member holds about one and a half gradients; a configuration that does not fit in the memory
available is skipped and says so.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The policies' sizes (Llama 3.1 8B and 70B) and the EAGLE-3 heads trained for them (32k draft vocabulary).
SHAPES: dict[str, dict] = {
    "8b": {"target_hidden_size": 4096, "hidden_size": 4096, "vocab_size": 128256, "draft_vocab_size": 32000,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
           "target_num_layers": 32},
    "70b": {"target_hidden_size": 8192, "hidden_size": 8192, "vocab_size": 128256, "draft_vocab_size": 32000,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672,
            "target_num_layers": 80},
}
MEMBERS = (2, 4)
_BARRIER_POLL_S = 0.002


def head_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable parameter of the EAGLE-3 head for policy size `name` (built on the meta
    device: no memory)."""
    # deferred: torch and the models (the CLI imports every bench module to build its parser)
    import torch
    from tailspec.drafter_trainer.eagle3_config import Eagle3Config
    from tailspec.drafter_trainer.model import Eagle3Module

    s = SHAPES[name]
    cfg = Eagle3Config(**s, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       aux_layer_ids=(2, s["target_num_layers"] // 2, s["target_num_layers"] - 3))
    with torch.device("meta"):
        m = Eagle3Module(cfg)
    return [(n, tuple(p.shape)) for n, p in m.named_parameters() if p.requires_grad]


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(shape: str, rounds: int, root: Path | None = None) -> dict:
    """round_exchange_s {files, collective} × {2, 4 members} (seconds; None where skipped for memory)."""
    # deferred: the CLI imports every bench module to build its parser
    from tailspec.redis_server import start_redis

    shapes = head_shapes(shape)
    numel = sum(_numel(s) for _, s in shapes)
    grad_bytes = numel * 4
    out: dict = {"drafter_shape": shape, "drafter_params": numel, "gradient_mb": round(grad_bytes / 2**20, 1),
                 "rounds": rounds, "round_exchange_s": {"files": {}, "collective": {}}, "group_s": {}, "skipped": []}
    server = start_redis()
    try:
        for n in MEMBERS:
            need = n * 1.5 * grad_bytes  # a member's gradient, and its sum (files) or gloo's buffers
            if available_bytes() and need > available_bytes():
                out["skipped"].append(f"{n} members: need ~{need / 2**30:.1f} GiB, "
                                      f"{available_bytes() / 2**30:.1f} GiB available")
                for t in ("files", "collective"):
                    out["round_exchange_s"][t][str(n)] = None
                continue
            for transport in ("files", "collective"):
                with tempfile.TemporaryDirectory(prefix="tailspec-exchange-", dir=root) as tmp:
                    res = _run_members(transport, n, shape, rounds, server.url, Path(tmp))
                out["round_exchange_s"][transport][str(n)] = res["round_s"]
                if transport == "collective":
                    out["group_s"][str(n)] = res["group_s"]
                print(f"  {shape} head ({numel / 1e9:.2f}B params, {grad_bytes / 2**30:.2f} GiB fp32), {n} members, "
                      f"{transport}: {res['round_s']:.2f} s a round (rounds {res['each']})", file=sys.stderr, flush=True)
    finally:
        server.stop()
    four = out["round_exchange_s"]
    f4, c4 = four["files"].get("4"), four["collective"].get("4")
    out["collective_over_files_4"] = (c4 / f4) if f4 and c4 is not None else None
    ratio = out["collective_over_files_4"]
    out["target_exchange_met"] = None if ratio is None else ratio <= 1 / 3  # None: 4 members did not fit
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _run_members(transport: str, n: int, shape: str, rounds: int, url: str, tmp: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tag = f"x{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, "-m", "tailspec.benchmarks.round_exchange", transport, str(rank), str(n),
                               shape, str(rounds), url, str(tmp), tag], env=env, stdout=subprocess.PIPE, text=True)
             for rank in range(n)]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"exchange member ({transport}, {n} members) exited {p.returncode}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    # a round ends when its last member is done; every member starts it at the same barrier
    each = [max(r["rounds"][i] for r in results) for i in range(rounds)]
    return {"round_s": statistics.median(each), "each": [round(x, 2) for x in each],
            "group_s": max(r.get("group_s", 0.0) for r in results)}


def _barrier(r, key: str, n: int) -> None:
    r.incr(key)
    while int(r.get(key) or 0) < n:
        time.sleep(_BARRIER_POLL_S)


def member(transport: str, rank: int, n: int, shape: str, rounds: int, url: str, tmp: Path, tag: str) -> dict:
    """One member's rounds (a process of its own): the seconds of each round's exchange."""
    # deferred: runs only in a member process
    import redis
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tailspec.drafter_trainer.collective import Exchange, unflatten

    torch.set_num_threads(1)
    r = redis.Redis.from_url(url)
    shapes = head_shapes(shape)
    like = [torch.empty(sh, device="meta") for _, sh in shapes]
    numel = sum(_numel(sh) for _, sh in shapes)
    tokens = [1000 + 10 * i for i in range(n)]
    weight = tokens[rank] / sum(tokens)
    out: dict = {"rounds": []}
    ex = None
    if transport == "collective":
        ex = Exchange(r, f"{tag}:collective:", torch.device("cpu"))
        t0 = time.monotonic()
        ex.join("bench", rank, n, 600.0)
        out["group_s"] = time.monotonic() - t0
    for i in range(rounds):
        # the round's gradient (synthetic: the transport does not read the values), made before the round starts
        value = float(rank + 1) + i / 8
        if transport == "files":  # the parameters' gradients, separate tensors (as a module's .grad)
            grads = {nm: torch.full(sh, value) for nm, sh in shapes}
        else:  # views of one flat buffer (DDP's bucket layout)
            flat = torch.full((numel,), value)
            grads = dict(zip((nm for nm, _ in shapes), unflatten(flat, like)))
        _barrier(r, f"{tag}:start:{i}", n)
        t0 = time.monotonic()
        if transport == "files":
            save_file(grads, str(tmp / f".{rank}-{i}.tmp"))
            os.replace(tmp / f".{rank}-{i}.tmp", tmp / f"{rank}-{i}.safetensors")
            del grads  # a member keeps its sum and one tensor read
            _barrier(r, f"{tag}:in:{i}", n)
            combined: dict[str, torch.Tensor] = {}
            for m in range(n):
                w = tokens[m] / sum(tokens)
                with safe_open(str(tmp / f"{m}-{i}.safetensors"), framework="pt") as f:
                    for nm in f.keys():  # noqa: SIM118 (a safetensors file handle, not a dict)
                        t = f.get_tensor(nm)
                        combined[nm] = combined[nm].add_(t, alpha=w) if nm in combined else t.mul_(w)
            del combined
        else:
            flat.mul_(weight)  # the gradients are views of one flat buffer: it is the round's message
            ex.all_reduce(flat, 600.0)
            parts = unflatten(flat, like)
            _barrier(r, f"{tag}:vote:{i}", n)  # the commit vote's round trip
            del parts, grads, flat
        out["rounds"].append(time.monotonic() - t0)
        _barrier(r, f"{tag}:done:{i}", n)
        if transport == "files" and rank == 0:
            for m in range(n):
                (tmp / f"{m}-{i}.safetensors").unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(member(a[0], int(a[1]), int(a[2]), a[3], int(a[4]), a[5], Path(a[6]), a[7])))
