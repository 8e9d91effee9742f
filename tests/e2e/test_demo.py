"""`kvbridge demo` run as a user runs it: a subprocess, real vLLM servers, a warm-up, a table, a summary line,
every process stopped."""

import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.vllm

SUMMARY = re.compile(
    r"^summary: (\d+) requests, (\d+) of (\d+) equal the aggregated run, median TTFT ([\d.]+) ms, "
    r"([\d.]+) MiB of KV moved, median claim wait ([\d.]+) ms, median KV hop ([\d.]+) ms, "
    r"wire rate ([\d.]+) GB/s \(wire time only\)$",
    re.MULTILINE,
)


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
    assert "warming up" in out and "warmed up in" in out, out[-3000:]
    assert out.index("warmed up in") < out.index("TTFT ms"), "the warm-up must come before the timed requests"
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and line.rstrip().endswith("yes")]
    assert len(rows) == 3, out[-3000:]
    for row in rows:
        kv_mib = float(row.split()[4])
        assert kv_mib > 0, f"no KV moved through kvbridge in: {row}"
    match = SUMMARY.search(out)
    assert match, out[-3000:]
    assert out.rstrip().endswith(match.group(0)), "the summary must be the last line"
    requests, equal, of, ttft_ms, mib, claim_ms, hop_ms, gbps = match.groups()
    assert int(requests) == int(equal) == int(of) == 3
    assert float(ttft_ms) == pytest.approx(statistics.median(float(r.split()[2]) for r in rows), abs=0.11)
    assert float(mib) == pytest.approx(sum(float(r.split()[4]) for r in rows), abs=0.02) and float(gbps) > 0
    assert float(claim_ms) == pytest.approx(statistics.median(float(r.split()[5]) for r in rows), abs=0.011)
    assert float(hop_ms) == pytest.approx(statistics.median(float(r.split()[6]) for r in rows), abs=0.011)
    for row in rows:  # the hop holds the claim and the wire time
        claim, hop, wire = (float(v) for v in row.split()[5:8])
        assert 0 < wire <= hop + 0.011 and claim <= hop + 0.011, row
    assert processes_mentioning(str(tmp_path)) == [], "the demo left vLLM servers running"


def processes_mentioning(text: str, timeout: float = 10.0) -> list[int]:
    """Live processes whose command line mentions `text` (the demo's servers get --model <workdir>/model),
    once none are left or after `timeout` seconds (a stopped process may take a moment to go)."""
    deadline = time.monotonic() + timeout
    while True:
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
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_summary_says_how_many_outputs_differ():
    from kvbridge.serving.demo import Row, summary

    rows = [
        Row(0.1, 2**20, 1e-4, 2e-3, 1e-3, True),
        Row(0.3, 2**20, 3e-4, 4e-3, 1e-3, False),
        Row(0.2, 0.0, 2e-4, 3e-3, 0.0, True),
    ]
    assert summary(rows) == (
        "summary: 3 requests, 2 of 3 equal the aggregated run, median TTFT 200.0 ms, 2.00 MiB of KV moved, median "
        "claim wait 0.20 ms, median KV hop 3.00 ms, wire rate 1.05 GB/s (wire time only); SOME OUTPUTS DIFFER"
    )
    assert SUMMARY.fullmatch(summary(rows[:1]))
