"""The crash-safe directory writer: whole-or-absent swaps, and what crashed writers leave is cleaned."""

import os
import socket
import subprocess
import sys

import pytest
from tailspec.core.atomic import write_dir_atomic


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_swap_replaces_whole_directory(tmp_path):
    write_dir_atomic(tmp_path / "v", lambda d: (d / "a").write_text("1"))
    write_dir_atomic(tmp_path / "v", lambda d: (d / "b").write_text("2"))
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["v"]


def test_failed_write_leaves_old_directory(tmp_path):
    write_dir_atomic(tmp_path / "v", lambda d: (d / "a").write_text("1"))

    def boom(d):
        (d / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_dir_atomic(tmp_path / "v", boom)
    assert (tmp_path / "v" / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["v"]


def test_crashed_writers_of_any_name_cleaned_live_and_foreign_kept(tmp_path):
    host = socket.gethostname()
    dead = _dead_pid()
    left = [
        tmp_path / f".ckpt-00000023.tmp.{host}.{dead}.abc123",  # a killed writer of another checkpoint
        tmp_path / f".export.old.{host}.{dead}.x_y",
    ]
    kept = [
        tmp_path / f".ckpt-00000030.tmp.{host}.{os.getpid()}.live01",  # a writer still running
        tmp_path / f".ckpt-00000031.tmp.other-host.{dead}.zz",  # another machine's, on a shared filesystem
    ]
    for d in left + kept:
        d.mkdir()
    write_dir_atomic(tmp_path / "ckpt-00000040", lambda d: (d / "w").write_text("1"))
    assert not any(d.exists() for d in left)
    assert all(d.exists() for d in kept)
