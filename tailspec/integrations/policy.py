"""Publishing the RL policy for drafter-training sessions: one whole directory per policy version.

A session lent a GPU loads its teacher from `PhaseInfo.policy_path` while the RL trainer may be writing the
next version, possibly on another node. So every version is written to a temporary sibling, fsynced and
renamed into place (the drafter checkpoints' writer, `write_dir_atomic`): a reader sees a whole directory or
none. The root must be an absolute path on a filesystem every node running sessions can read; a relative
path would resolve against each process's own working directory and silently name a different place per node.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from tailspec.core.atomic import write_dir_atomic

_VERSION_DIR = re.compile(r"^policy-v(\d{8})$")


class PolicyPublisher:
    """Writes `<root>/policy-v<version>` directories atomically and keeps the newest `keep` of them (a session
    may still be loading the previous one when the next is published)."""

    def __init__(self, root: str | Path, keep: int = 3):
        root = Path(root)
        if not root.is_absolute():
            raise ValueError(f"policy directory {str(root)!r} must be an absolute path on a filesystem shared with "
                             "the nodes that run sessions (a relative one differs per process's working directory)")
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (a session may be loading the previous version), got {keep}")
        self.root, self.keep = root, keep
        self.published: dict[int, Path] = {}
        self._lock = threading.Lock()  # a publish may run on a background thread while `latest()` is read

    def path_for(self, version: int) -> Path:
        return self.root / f"policy-v{version:08d}"

    def publish(self, version: int, write: Callable[[Path], None]) -> Path:
        """`write(tmp_dir)` saves the policy (e.g. `model.save_pretrained(tmp)`, `tokenizer.save_pretrained(tmp)`)
        into a temporary directory that is then fsynced and renamed to `path_for(version)`."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        path = write_dir_atomic(self.path_for(version), write)
        with self._lock:
            self.published[version] = path
        self._prune()
        return path

    def latest(self) -> tuple[int, Path] | None:
        """The newest version written whole, and its directory; None before the first."""
        with self._lock:
            if not self.published:
                return None
            v = max(self.published)
            return v, self.published[v]

    def _prune(self) -> None:
        versions = sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_DIR.match(p.name)))
        for v in versions[: -self.keep]:
            with self._lock:
                self.published.pop(v, None)
            shutil.rmtree(self.path_for(v), ignore_errors=True)
