"""An outsider without the key against a prefill worker's transport, across test hosts (network namespaces).

The victim is a keyed prefill worker on one host, in the default configuration; the attacker runs on another host with
no key and more than a port scan gives it: the victim's NIXL agent metadata and KV address, leaked (the process
`support.transport_attack` describes both sides). Against the default (UCX on loopback, KV leaving the host over
kvbridge's authenticated channel) the forged-metadata READ and WRITE get nothing and the zero-knowledge crash (a
memory section widened to [0x1000, 2^47), one READ at 0x10000) crashes nothing. The control of each: the operator's
opt-in `ucx_tcp_exposes_process_memory` (UCX tcp on the host's device), where the same READ returns the user's
secret, the WRITE lands in the victim's KV, and the READ kills the victim with SIGSEGV: the tests can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.hosts import network_hosts
from support.transport_attack import PAYLOAD, SECRET

pytestmark = pytest.mark.nixl

TESTS = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _wait(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} (victim rc {proc.poll()})")
        time.sleep(0.05)


def _attack(host, work: Path, mode: str) -> dict:
    cmd = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "support.transport_attack"]
    env = {**_env(), "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device}
    out = subprocess.run([*cmd, "attacker", str(work), host.device, mode], env=env, capture_output=True, timeout=120)
    path = work / f"attack-{mode}.json"
    assert path.exists(), out.stderr.decode()[-3000:]
    return json.loads(path.read_text())


def run_attacks(tmp_path: Path, ucx_tcp: bool) -> dict:
    """Victim on one host, the attacker's three tries from another: what each got, and the victim's state."""
    with network_hosts("victim", "outsider") as hosts:
        vh, ah = hosts["victim"], hosts["outsider"]
        work = tmp_path / ("opt-in" if ucx_tcp else "default")
        work.mkdir()
        cmd = ["ip", "netns", "exec", vh.netns, sys.executable, "-m", "support.transport_attack", "victim"]
        cmd += [str(work), vh.ip, vh.device, *(["--ucx-tcp"] if ucx_tcp else [])]
        log = open(work / "victim.log", "wb")  # noqa: SIM115 (closed below)
        victim = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(work / "leak.json", victim)
            leak = json.loads((work / "leak.json").read_text())
            got = {"ucx": leak["ucx"], "read-write": _attack(ah, work, "read-write")}
            (work / "snap").touch()
            _wait(work / "snapshot.bin", victim)
            got["victim_kv"] = (work / "snapshot.bin").read_bytes()
            got["crash"] = _attack(ah, work, "crash")
            time.sleep(2)  # a crash is not instant: the READ is served by the victim's progress
            got["victim_rc"] = victim.poll()
            (work / "stop").touch()
            if got["victim_rc"] is None:
                victim.wait(timeout=30)
        finally:
            if victim.poll() is None:
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
            log.close()
        got["victim_log"] = (work / "victim.log").read_text(errors="replace")[-3000:]
        return got


def test_an_outsider_gets_no_read_no_write_and_no_crash_from_a_default_prefill(tmp_path):
    got = run_attacks(tmp_path, ucx_tcp=False)
    assert got["ucx"].get("UCX_NET_DEVICES") == "lo", got["ucx"]
    rw = got["read-write"]
    assert rw.get("read") != "DONE" and SECRET[:20].decode() not in rw.get("read_bytes", ""), rw
    assert rw.get("write") != "DONE" and PAYLOAD.decode() not in rw.get("read_back_bytes", ""), rw
    assert got["victim_kv"].startswith(SECRET) and PAYLOAD not in got["victim_kv"], "the victim's KV was written"
    assert got["crash"].get("read_unmapped") != "DONE", got["crash"]
    assert got["victim_rc"] is None, f"the victim died (rc {got['victim_rc']}): {got['victim_log']}"


def test_negative_control_with_ucx_tcp_opted_in_the_same_attacks_succeed(tmp_path):
    """What `ucx_tcp_exposes_process_memory` exposes: the outsider READs the user's secret, WRITEs into the KV, and
    kills the prefill worker with one READ of an address nothing maps."""
    got = run_attacks(tmp_path, ucx_tcp=True)
    rw = got["read-write"]
    assert rw.get("read") == "DONE" and rw["read_bytes"].encode("latin-1").startswith(SECRET), rw
    assert rw.get("write") == "DONE" and rw["read_back_bytes"] == PAYLOAD.decode(), rw
    assert got["victim_kv"].startswith(PAYLOAD), "the WRITE did not land in the victim's KV"
    assert got["victim_rc"] == -signal.SIGSEGV, f"the victim survived (rc {got['victim_rc']}): {got['crash']}"
