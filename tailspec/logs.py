"""Where the CLI's log records go: on the console, tailspec's own from INFO (DEBUG with -v) and every other
library's from WARNING only (matplotlib's font cache, urllib3's connections and the like are not the user's
business while a run goes on); in a run's log file (`RunLog`), every record of every library."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s " + FORMAT


def ours_or_warning(record: logging.LogRecord) -> bool:
    """The console's filter: a tailspec record, or any library's from WARNING up."""
    return record.levelno >= logging.WARNING or record.name == "tailspec" or record.name.startswith("tailspec.")


def configure(verbose: bool = False) -> None:
    """The CLI's logging: the root logger at INFO (DEBUG with -v), so that every record reaches a run's log file,
    and a console handler on stderr that `ours_or_warning` filters. Like `logging.basicConfig`, a no-op where
    the root logger has handlers already."""
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT)
    for h in root.handlers:
        if h not in before:
            h.addFilter(ours_or_warning)


class RunLog(logging.Handler):
    """A run's log file, of every record that reaches the root logger, while the `with` block lasts. Records
    are held until `open` names the file (a run directory is made only once the policy is ready), then written
    there ahead of the rest."""

    HOLD = 10_000  # records held before the file is known; past it the oldest go

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FILE_FORMAT))
        self.held: collections.deque[str] = collections.deque(maxlen=self.HOLD)
        self.file: logging.FileHandler | None = None
        self.path: Path | None = None

    def open(self, path: Path) -> None:
        self.acquire()
        try:
            self.path = Path(path)
            self.file = logging.FileHandler(self.path, encoding="utf-8")
            self.file.setFormatter(self.formatter)
            self.file.stream.write("".join(line + "\n" for line in self.held))
            self.file.flush()
            self.held.clear()
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.emit(record)
            return
        try:
            self.held.append(self.format(record))
        except Exception:  # noqa: BLE001 — logging's own contract: a record never breaks the run
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            if self.file is not None:
                self.file.close()
        finally:
            self.release()
        super().close()

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)
        self.close()
