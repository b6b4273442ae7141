"""Crash-safe writes on a local or shared filesystem: a reader sees the old file or directory or the new one,
never a half-written one, and a crash leaves at most a hidden temporary sibling that the next write removes.

Every checkpoint, lineage head, drafter version, export, published policy and cached task policy is written
through these, so "whole or absent" holds for all of them in one place."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(p: Path) -> None:
    fd = os.open(str(p), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy(src: Path, dst: Path) -> None:
    """dst as a hard link to src (a file never changed once written can be shared), copied where links are
    refused (another filesystem, or none supported)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_dir_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Let `write` fill a temporary sibling directory, fsync its files, then swap it in by rename (the old
    directory, if any, is renamed aside first and removed after). Readers see the old directory or the new
    one; a crash leaves at most a hidden `.name.tmp.*` / `.name.old.*` sibling, which the next write on that
    host removes once its writer is gone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp.{_owner()}.", dir=path.parent))
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.{_owner()}.", dir=path.parent))
            os.rmdir(old)
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _owner() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


def _remove_stale(path: Path) -> None:
    """Remove what crashed writers left in `path`'s directory: any `.<name>.tmp.*` / `.<name>.old.*` of a process
    on this host that no longer runs, whatever name it was writing (a killed writer of `ckpt-00000023` is cleaned
    by the write of `ckpt-00000024`). A live writer's temporary and other hosts' are left alone."""
    pattern = re.compile(rf"^\..+\.(?:tmp|old)\.{re.escape(socket.gethostname())}\.(\d+)\.[^.]+$")
    for stale in path.parent.glob(".*"):
        m = pattern.match(stale.name)
        if m is None or not stale.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            continue


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a small file (a pointer, a counter, a JSON record) by writing a sibling and renaming it over. The
    sibling is named by process and thread: two writers in one process must not rename each other's."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (fcntl) across processes on one machine: the Redis-less
    compare-and-swaps of the lineage and the version store."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
