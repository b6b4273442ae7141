"""Session entry for tests/test_lineage_sessions.py, a plain function (nothing to warm up or read ahead):
`tailspec.session_entry.run_session` with a fault hook and its result written to a file. With $LINEAGE_PAUSE_AT_MERGE=N the session pauses for good at the N-th merge's
commit point (directory written, compare-and-swap not yet done) after touching $LINEAGE_MARKER, so the test
can SIGKILL it there. With $LINEAGE_PAUSE_AT_ALLREDUCE=N it pauses for good when it enters its N-th all-reduce of a
synchronous round (the round's other participants inside it, waiting) after touching $LINEAGE_MARKER_ALLREDUCE."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tailspec.drafter_trainer import collective, lineage

from tailspec.session_entry import run_session


def run(ctx) -> dict:
    pause_at = int(os.environ.get("LINEAGE_PAUSE_AT_MERGE", "0"))
    published = [0]

    def hook(point: str, path: Path) -> None:
        # head-<number>-<session>-<seq>: a merge that lost a race retries under the same seq;
        # head-<number>-<session>-r<round>: a synchronous round's publish, counted here
        if pause_at and point == "written" and "-seed." not in path.name:
            tail = path.name.rsplit("-", 1)[1]
            if tail.startswith("r"):
                published[0] += 1
            if (published[0] if tail.startswith("r") else int(tail)) == pause_at:
                Path(os.environ["LINEAGE_MARKER"]).write_text(str(path))
                time.sleep(600)

    lineage.FAULT_HOOK = hook
    pause_reduce = int(os.environ.get("LINEAGE_PAUSE_AT_ALLREDUCE", "0"))
    reduces = [0]

    def reduce_hook(what: str) -> None:
        if what == "all-reduce":
            reduces[0] += 1
            if reduces[0] == pause_reduce:
                Path(os.environ["LINEAGE_MARKER_ALLREDUCE"]).write_text(ctx.session_id)
                time.sleep(600)

    collective.FAULT_HOOK = reduce_hook if pause_reduce else None
    out = run_session(ctx)
    out_dir = os.environ.get("LINEAGE_RESULTS")
    if out_dir:
        (Path(out_dir) / f"{ctx.session_id}.json").write_text(json.dumps(out))
    return out
