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
        if isinstance(record.args, tuple) and record.args:
            name = str(record.args[0])
            if " ready after " in record.msg and len(record.args) == 3 and record.args[2] is not None:
                self.live[name] = Path(record.args[2])
            elif " stopped in " in record.msg:
                self.live.pop(name, None)


def _worth_reading(line: str) -> bool:
    """A server log line that can say why a test failed: kvbridge's warnings and errors, vLLM's errors."""
    if "[kvbridge]" in line:
        return not line.startswith("INFO")
    return " ERROR " in line or line.startswith(("Traceback", "ERROR"))


def _server_news(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        return f"(unreadable: {error})"
    kept = [line for line in text.splitlines() if _worth_reading(line)]
    return "\n".join(kept[-lines:]) or "(no kvbridge warning, no error)"


SERVER_TIMES = _ServerTimes()
launcher.log.addHandler(SERVER_TIMES)
launcher.log.setLevel(logging.INFO)


def pytest_terminal_summary(terminalreporter) -> None:
    if SERVER_TIMES.lines:
        terminalreporter.section("vLLM servers: ready and stop times")
        for line in SERVER_TIMES.lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call":
        for name, path in SERVER_TIMES.live.items():
            report.sections.append((f"{name}: kvbridge warnings and errors ({path})", _server_news(path)))
