"""Test layout: `unit/` (pure code, fakes, no NIXL agent), `nixl/` (real NIXL between processes), `e2e/` (real vLLM
servers), `gpu/` (CUDA, on the device machine). Shared code lives in the `support` package beside this file, which
pytest puts on `sys.path` (its prepend import mode inserts this folder when it loads this conftest).

Property tests (Hypothesis) run under one of two profiles, chosen by KVBRIDGE_HYPOTHESIS_PROFILE:
- `dev` (the default): 300 examples a test, random each run, failures remembered in .hypothesis/;
- `ci` (`make test`, `.ci/run`): 60 examples a test, derandomized (the same examples on every run: a failure
  reproduces), no example database.
Tests whose examples are costly (real sockets, NIXL agents) cap their own count lower with `@settings`.

The run's summary lists when each vLLM server became ready and how long it took to stop (the launcher's INFO lines,
with the test that was running), so that a CI log shows what each module's servers cost. A failed test's report
carries the kvbridge warnings and the errors of every vLLM server running at the time (servers shared by a module
outlive its failing tests, so no log tail is printed when they stop).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvbridge.serving import launcher
from support.fork_server import transfers_forked  # noqa: F401 (a fixture, taken by name)

PROFILE_ENV = "KVBRIDGE_HYPOTHESIS_PROFILE"

settings.register_profile("dev", max_examples=300, deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get(PROFILE_ENV, "dev"))


class _ServerTimes(logging.Handler):
    """The launcher's ready and stop lines, each with the test (and phase) that was running, and the log file of
    each server between the two."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.live: dict[str, Path] = {}  # server name -> its log

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.getMessage()}  [{os.environ.get('PYTEST_CURRENT_TEST', '-')}]")
        if isinstance(record.args, tuple) and record.args and isinstance(record.msg, str):
            name = str(record.args[0])
            if " ready after " in record.msg and len(record.args) == 3 and record.args[2] is not None:
                self.live[name] = Path(record.args[2])
            elif " stopped in " in record.msg:
                self.live.pop(name, None)


SERVER_TIMES = _ServerTimes()
launcher.log.addHandler(SERVER_TIMES)
launcher.log.setLevel(logging.INFO)

_RECORD = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|^\[[A-Z]\d{4}")


def _server_news(path: Path, lines: int = 30, tail_bytes: int = 2 << 20, width: int = 500) -> str:
    """The last `lines` kvbridge warnings and errors and the last `lines` vLLM errors of a server's log (its last
    `tail_bytes`), each record with its traceback lines, each line cut at `width` characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError as error:
        return f"(unreadable: {error})"
    ours: list[str] = []
    theirs: list[str] = []
    keep: list[str] | None = None  # where the record being read goes (None: not kept)
    for line in text.splitlines():
        if line.startswith("Traceback") and keep is None:  # a bare one, not after a kept record: vLLM's
            keep = theirs
        elif _RECORD.match(line):
            if "[kvbridge]" in line:
                keep = None if line.startswith("INFO") else ours
            else:
                keep = theirs if " ERROR " in line or line.startswith("ERROR") else None
        if keep is not None:
            keep.append(line[:width])
    parts = [("kvbridge warnings and errors", ours), ("vLLM errors", theirs)]
    return "\n".join(f"--- {title} ---\n" + ("\n".join(kept[-lines:]) or "(none)") for title, kept in parts)


def pytest_terminal_summary(terminalreporter) -> None:
    if SERVER_TIMES.lines:
        terminalreporter.section("vLLM servers: ready and stop times")
        for line in SERVER_TIMES.lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:  # in the test or in a fixture (one that checks the servers after it, say)
        for name, path in list(SERVER_TIMES.live.items()):
            report.sections.append((f"{name}: warnings and errors ({path})", _server_news(path)))
