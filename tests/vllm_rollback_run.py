"""Run by tests/test_vllm_live.py in a process of its own: a LiveVllm whose engine core runs in a separate
process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, vLLM's default), where the k schedule cannot be changed at run
time, so a tripped guard rolls back to the last healthy drafter. Prints one JSON object of what happened."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # before in_process_engine()'s setdefault


def main(redis_url: str, out_dir: str) -> dict:
    import redis
    from tailspec.benchmarks.vllm_kit import zeroed_fc
    from tailspec.core import state
    from tailspec.core.state import DrafterVersion
    from tailspec.rollout.health_guard import GuardPolicy
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout, greedy
    from tailspec.rollout.vllm_live import LiveVllm
    from vllm_helpers import MAX_TOKENS, drafters, engine_kwargs, prompts, tiny, token_ids

    k, window = 3, 8
    r = redis.Redis.from_url(redis_url)

    def version(n: int, path) -> DrafterVersion:
        return DrafterVersion(version=n, path=str(path), policy_version=0, acceptance_length=2.5, validation_k=k,
                              promoted=True, created_at=time.time())

    good, bad = drafters()["trained"], zeroed_fc(drafters()["trained"], f"{out_dir}/zeroed-fc-norm")
    ro = VllmRollout(tiny(), DrafterSpec("eagle3", good, k=k, schedule=[(1, 8, k)]), **engine_kwargs())
    live = LiveVllm(ro, redis=r, cluster="rollback", guard=GuardPolicy(window_steps=window),
                    version=version(1, good), worker="vllm-mp")
    sp, out = greedy(MAX_TOKENS), {}
    try:
        a = live.generate(prompts(), sp)
        out["healthy_first"] = not live.verdicts[-1].tripped
        out["schedule_settable"] = ro.set_schedule([(1, 8, k)])
        state.put(r, state.key("rollback", "drafter_current"), version(2, bad))
        b = live.generate(prompts(), sp)
        v = live.verdicts[-1]
        out["tripped"] = {"tripped": v.tripped, "version": v.version, "event": v.event}
        out["drafter_after_trip"] = str(ro.drafter_path)
        c = live.generate(prompts(), sp)  # the rollback happens before this call
        out["rollback_loads"] = [x["event"] for x in live.loads]
        out["drafter_after_rollback"] = str(ro.drafter_path)
        out["acceptance"] = {"first": a.counters.acceptance_length, "tripped_call": b.counters.acceptance_length,
                             "after_rollback": c.counters.acceptance_length}
        out["tokens_equal"] = token_ids(a) == token_ids(b) == token_ids(c)
        out["last_verdict"] = {"tripped": live.verdicts[-1].tripped, "event": live.verdicts[-1].event}
        out["good"], out["bad"] = str(good), str(bad)
        raw = r.hget(state.key("rollback", "drafter_guard"), "vllm-mp")
        out["guard_status_tripped"] = state.decode(state.GuardStatus, raw).tripped if raw else None
    finally:
        ro.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
