"""The demo's console stays the user's: tailspec's records and other libraries' warnings only (their INFO goes to
the run's log file with everything else), and the live display's last line ends before the next one starts."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest

from tailspec import logs


@contextlib.contextmanager
def bare_root():
    """The root logger with no handlers (so `logs.configure` configures it as in a fresh `tailspec` process;
    pytest's own capture included, which it adds for each test's call), restored afterwards."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    for h in saved:
        root.removeHandler(h)
    try:
        yield root
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)


def test_the_console_shows_tailspec_and_warnings_the_run_log_every_record(tmp_path, capsys):
    with bare_root() as root:
        logs.configure(verbose=False)
        with logs.RunLog() as run_log:
            logging.getLogger("matplotlib.font_manager").info("generated new fontManager")  # held: no file yet
            run_log.open(tmp_path / "demo.log")
            logging.getLogger("tailspec.demo").info("bootstrap drafter: 64 samples")
            logging.getLogger("urllib3.connectionpool").warning("retrying")
            logging.getLogger("httpx").info("HTTP Request: GET /api/state")
            logging.getLogger("tailspec_other").info("not ours: a name that only starts like it")
        assert run_log not in root.handlers
    console = capsys.readouterr().err.splitlines()
    assert console == ["INFO tailspec.demo: bootstrap drafter: 64 samples", "WARNING urllib3.connectionpool: retrying"]
    written = [line.split(" ", 2)[2] for line in (tmp_path / "demo.log").read_text().splitlines()]  # less the time
    assert written == ["INFO matplotlib.font_manager: generated new fontManager",
                       "INFO tailspec.demo: bootstrap drafter: 64 samples",
                       "WARNING urllib3.connectionpool: retrying",
                       "INFO httpx: HTTP Request: GET /api/state",
                       "INFO tailspec_other: not ours: a name that only starts like it"]


@pytest.mark.parametrize("terminal", [False, True])
def test_the_live_display_ends_its_last_line_and_shows_no_library_info(terminal, caplog):
    from rich.console import Console
    from rich.text import Text

    from tailspec.commands.demo import live_display

    caplog.set_level(logging.INFO)
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=terminal, color_system=None, legacy_windows=False)
    status = {"text": "starting…"}
    with live_display(console, lambda: Text(status["text"])) as live:
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("tailspec.demo").info("bootstrap drafter: 64 samples")
        status["text"] = "step 9 done"
        live.refresh()
    console.print("idle GPU-seconds 12.0")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n")  # cursor moves, erasures
    assert "step 9 done\nidle GPU-seconds 12.0\n" in text, repr(text)
    assert "INFO tailspec.demo: bootstrap drafter: 64 samples" in text, repr(text)
    assert "fontManager" not in text, repr(text)
