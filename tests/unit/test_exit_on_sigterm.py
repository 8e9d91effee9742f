"""SIGTERM to a script that started servers stops them (`launcher.exit_on_sigterm`), also while they start.

A script starts a "server" that never becomes ready (a sleeping process in place of vLLM) inside `running()` and is
sent SIGTERM while it waits for it. With `exit_on_sigterm` the script ends with 143 and the server is gone at once;
the negative control, without it: the script dies at once and leaves the server running (the test then ends it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
SCRIPT = textwrap.dedent(
    """
    import sys
    from kvbridge.serving.launcher import VllmServer, exit_on_sigterm, running

    class NeverReady(VllmServer):
        def command(self):
            return [sys.executable, "-c", "import time; time.sleep(120)"]

    if sys.argv[1] == "on":
        exit_on_sigterm()
    server = NeverReady("/nonexistent", name="never-ready", log_path=sys.argv[2])
    with running([server], timeout=120):
        pass
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _server_pid(log: Path, script: subprocess.Popen) -> int:
    """The never-ready server's pid, once the script has started it (its log names the command first)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if script.poll() is not None:
            raise AssertionError(f"the script ended ({script.returncode}) before it started its server")
        out = subprocess.run(["pgrep", "-P", str(script.pid)], capture_output=True, text=True).stdout.split()
        if out and log.exists():
            return int(out[0])
        time.sleep(0.05)
    raise AssertionError("the script did not start its server")


@pytest.mark.parametrize("handler", ["on", "off"])
def test_sigterm_while_servers_start_stops_them(tmp_path, handler):
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = subprocess.Popen([sys.executable, "-c", SCRIPT, handler, str(log)], env=env)
    server = None
    try:
        server = _server_pid(log, script)
        time.sleep(0.5)  # inside running(), waiting for the server to be ready
        script.send_signal(signal.SIGTERM)
        try:
            code = script.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError("the script still runs 15 s after SIGTERM (waiting for its server?)") from None
        if handler == "on":
            assert code == 128 + signal.SIGTERM
            deadline = time.monotonic() + 10
            while _alive(server) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(server), "the server outlived the script"
        else:  # the negative control: SIGTERM's default ends the script and orphans its server
            assert code == -signal.SIGTERM
            time.sleep(0.5)
            assert _alive(server)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)
