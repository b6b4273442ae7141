"""torchft's Manager with ProcessGroupGloo in a round's shape, run by hand (needs the `torchft-check` extra):

    python -m tailspec.benchmarks.torchft_check [--floats N] [--join-after-s S]

A lighthouse on 127.0.0.1 and three replica processes (one rank each), every step: a quorum (`start_quorum`), an
all-reduce of N fp32 values (`Manager.allreduce`), `should_commit`. Replica r2 is SIGKILLed inside its all-reduce of
step 4; replica r3 joins after S seconds and is healed by the Manager (its checkpoint transport). Each replica prints
one JSON line per step (participants, committed, quorum / all-reduce / commit seconds, the error it saw); this
process prints them with the time since the start. docs/architecture.md (the lineage, synchronous rounds) says what
was found and why the rounds use torch.distributed directly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta


def replica(lighthouse: str, rid: str, floats: int, steps: int, timeout_s: float) -> None:
    """One replica group of one rank: `steps` steps of quorum, all-reduce and commit."""
    # deferred: an optional dependency (the torchft-check extra), loaded only in a replica process
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    w = torch.zeros(floats)
    mgr = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)), min_replica_size=1,
                  load_state_dict=lambda sd: w.copy_(sd["w"]), state_dict=lambda: {"w": w},
                  replica_id=rid, lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port,
                  rank=0, world_size=1, timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=30),
                  use_async_quorum=False)
    for _ in range(steps):
        t0 = time.monotonic()
        mgr.start_quorum()
        t1 = time.monotonic()
        g = torch.ones(floats)
        print(json.dumps({"r": rid, "ev": "allreduce", "step": mgr.current_step()}), flush=True)
        mgr.allreduce(g).wait()
        t2 = time.monotonic()
        ok = mgr.should_commit()
        t3 = time.monotonic()
        if ok:
            w.add_(g)
        err = mgr.errored()
        print(json.dumps({"r": rid, "step": mgr.current_step(), "n": mgr.num_participants(), "ok": ok,
                          "quorum_s": round(t1 - t0, 4), "allreduce_s": round(t2 - t1, 4), "commit_s": round(t3 - t2, 4),
                          "w0": float(w[0]), "err": str(err)[:120] if err else None}), flush=True)
        time.sleep(0.05)
    mgr.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--floats", type=int, default=25_000_000, help="values all-reduced per step (fp32)")
    p.add_argument("--join-after-s", type=float, default=8.0, help="when replica r3 joins")
    p.add_argument("--replica", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.replica:
        lighthouse, rid, floats, steps, timeout_s = args.replica
        replica(lighthouse, rid, int(floats), int(steps), float(timeout_s))
        return
    # deferred: an optional dependency (the torchft-check extra)
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=2000)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t00 = time.monotonic()

    def start(rid: str, steps: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tailspec.benchmarks.torchft_check", "--replica", lh.address(),
                                 rid, str(args.floats), str(steps), "10"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)

    def pump(rid: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            print(f"{time.monotonic() - t00:7.2f} {line.strip()}", flush=True)
            d = json.loads(line)
            if rid == "r2" and d.get("ev") == "allreduce" and d["step"] == 4:
                time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                print(f"{time.monotonic() - t00:7.2f} SIGKILL r2 inside its all-reduce of step 4", flush=True)

    procs = {rid: start(rid, 14) for rid in ("r0", "r1", "r2")}
    threads = [threading.Thread(target=pump, args=item) for item in procs.items()]
    for t in threads:
        t.start()
    time.sleep(args.join_after_s)
    procs["r3"] = start("r3", 6)
    print(f"{time.monotonic() - t00:7.2f} r3 joins", flush=True)
    threads.append(threading.Thread(target=pump, args=("r3", procs["r3"])))
    threads[-1].start()
    for t in threads:
        t.join(timeout=300)
    for rid, proc in procs.items():
        print(f"{rid} exit {proc.wait(timeout=60)}", flush=True)
    lh.shutdown()


if __name__ == "__main__":
    main()
