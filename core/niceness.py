"""Host work at a low priority: `at_niceness` runs a function on a thread of its own at a given niceness.

Linux keeps a niceness per thread, and an unprivileged thread cannot lower its niceness again once raised, so
work that must yield to the simulated GPUs' processes (a session's merge after its release, a warm process's
read-ahead) runs on a thread of its own and the caller keeps its priority. Elsewhere the call would renice the
whole process, so there the function runs at the caller's priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def at_niceness(fn: Callable[[], Any], nice: int, name: str = "tailspec-host-work") -> Any:
    """fn() on a thread of its own at niceness `nice` (that thread's alone, on Linux; elsewhere at the caller's
    priority); its result, or its exception raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        if sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError as e:  # the work still runs, at the caller's priority
                log.debug("host work at niceness %d: %s", nice, e)
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("result")
