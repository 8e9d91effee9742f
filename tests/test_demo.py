"""`kvbridge demo` run as a user runs it: a subprocess, real vLLM servers, a table, every process stopped."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.vllm


def test_demo_runs_and_cleans_up(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbridge.serving.cli",
            "demo",
            "--requests",
            "3",
            "--max-tokens",
            "6",
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "all outputs equal the aggregated run" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and line.rstrip().endswith("yes")]
    assert len(rows) == 3, out[-3000:]
    for row in rows:
        kv_mib = float(row.split()[4])
        assert kv_mib > 0, f"no KV moved through kvbridge in: {row}"
    assert processes_mentioning(str(tmp_path)) == [], "the demo left vLLM servers running"


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (the demo's servers get --model <workdir>/model)."""
    time.sleep(1)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry))
    return found
