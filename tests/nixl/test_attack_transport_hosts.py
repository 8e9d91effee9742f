"""An outsider without the key against a prefill worker, across test hosts (network namespaces), by every route.

The victim is a keyed prefill worker on one host, in the default configuration; the attacker runs on another host with
no key and more than a port scan gives it: the victim's NIXL agent metadata and KV address, leaked, and the id and
blocks of a request it holds, as leaked params would name them (the processes: `support.transport_attack`).

The transport: against the default (UCX on loopback, KV leaving the host over kvbridge's authenticated channel) the
forged-metadata READ and WRITE get nothing and the zero-knowledge crash (a memory section widened to [0x1000, 2^47),
one READ at 0x10000) crashes nothing. The control of each: the operator's opt-in `ucx_tcp_exposes_process_memory`
(UCX tcp on the host's device), where the same READ returns the user's secret, the WRITE lands in the victim's KV, and
the READ kills the victim with SIGSEGV: the tests can fail.

The side channel and the KV channel: handshakes, a claim of the held request with a guessed token, a forged read of
it, wrong keys, garbage, oversized and truncated frames get no answer on the side channel and nothing but the
channel's own handshake on the KV channel; the victim lives and a key holder on another host then loads the request
byte for byte. The control: the same clients holding the key are answered.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
from pathlib import Path

import pytest

from support.hosts import network_hosts
from support.transport_attack import HELD_BLOCKS, PAYLOAD, SECRET, held_bytes, run_on, victim_kv, victim_on, wait_for

pytestmark = pytest.mark.nixl


def run_attacks(tmp_path: Path, ucx_tcp: bool) -> dict:
    """Victim on one host, the attacker's three tries from another: what each got, and the victim's state."""
    with network_hosts("victim", "outsider") as hosts:
        vh, ah = hosts["victim"], hosts["outsider"]
        work = tmp_path / ("opt-in" if ucx_tcp else "default")
        work.mkdir()
        with victim_on(vh, work, ucx_tcp) as (victim, leak):

            def attack(mode: str) -> dict:
                return run_on(ah, work, "attacker", ah.device, mode, report=f"attack-{mode}", nixl_tcp=True)

            got = {"ucx": leak["ucx"], "read-write": attack("read-write")}
            (work / "snap").touch()
            wait_for(work / "snapshot.bin", victim)
            got["victim_kv"] = (work / "snapshot.bin").read_bytes()
            got["crash"] = attack("crash")
            with contextlib.suppress(subprocess.TimeoutExpired):  # a crash is not instant: the READ is served by
                victim.wait(timeout=2)  # the victim's progress; one that lives is watched the whole 2 s
            got["victim_rc"] = victim.poll()
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


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    """The other routes to a default victim: the outsider's side-channel and KV-channel tries, the same clients
    with the key, then a key holder's load of the held request from another host; the victim's state after each."""
    with network_hosts("victim", "outsider") as hosts:
        vh, ah = hosts["victim"], hosts["outsider"]
        work = tmp_path_factory.mktemp("routes")
        with victim_on(vh, work) as (victim, leak):
            got: dict = {"leak": leak}
            for mode in ("side-channel", "kv-channel"):
                got[mode] = run_on(ah, work, "attacker", ah.device, mode, report=f"attack-{mode}")
            got["victim_rc_after_attacks"] = victim.poll()
            for mode in ("side-channel", "kv-channel"):
                report = f"attack-{mode}-keyed"
                got[f"{mode} with the key"] = run_on(ah, work, "attacker", ah.device, mode, "--with-key", report=report)
            got["holder"] = run_on(ah, work, "holder", ah.ip, report="holder")
            got["victim_rc"] = victim.poll()
        got["victim_log"] = (work / "victim.log").read_text(errors="replace")[-3000:]
        yield got


@functools.cache
def _kv_pieces() -> list[bytes]:
    kv = victim_kv()
    return [SECRET[:16]] + [held_bytes(kv, (b,))[i : i + 16] for b in HELD_BLOCKS for i in (0, 256, 512)]


def _kv_in(data_hex: str) -> bool:
    """Whether bytes the outsider got contain the user's secret or any piece of a held block."""
    return any(piece in bytes.fromhex(data_hex) for piece in _kv_pieces())


def test_the_side_channel_answers_an_outsider_nothing(routes):
    """Handshakes and a claim naming the held request (its id and blocks, a guessed token), unsealed and sealed with
    a wrong key, garbage, 2 MiB, empty and truncated frames: not one answer."""
    got = routes["side-channel"]
    assert len(got) == 9, got
    for name, outcome in got.items():
        assert not outcome["answered"], (name, outcome)
        assert outcome.get("error", "TransferTimeout") == "TransferTimeout", (name, outcome)
    assert routes["victim_rc_after_attacks"] is None, routes["victim_log"]


def test_the_kv_channel_sends_an_outsider_nothing_but_its_handshake(routes):
    """A hello without the key and a forged read of the held request, the channel's handshake with a wrong key,
    garbage, a truncated hello: at most the server's half of the handshake comes back, never a KV byte."""
    got = routes["kv-channel"]
    assert routes["leak"]["stream_port"] > 0, "the victim serves no KV channel"
    for name in ("hello without the key, a forged read", "garbage", "a truncated hello"):
        assert got[name]["bytes"] <= got["answer_size"], (name, got[name])
        assert not _kv_in(got[name].get("all", got[name]["head"])), (name, got[name])
    wrong = got["read with a wrong key"]
    assert wrong["frames"] == 0 and wrong["data"] == "" and wrong["error"] == "StreamAuthError", wrong
    assert routes["victim_rc_after_attacks"] is None, routes["victim_log"]


def test_after_the_attacks_the_victim_lives_and_a_key_holder_loads_the_request_exact(routes):
    holder = routes["holder"]
    assert holder["loaded"] is True and holder["exact"] is True, holder
    assert holder["over_the_kv_channel_bytes"] >= len(held_bytes(victim_kv(), HELD_BLOCKS)), holder
    assert routes["victim_rc"] is None, routes["victim_log"]


def test_negative_control_the_same_clients_with_the_key_are_answered(routes):
    """The routes were reachable and the oracles see an answer: sealed with the key, the handshake gets the
    victim's reply and the claim with a guessed token its refusal; over the KV channel the handshake passes and the
    forged read (no granted claim) gets the server's refusal. The oracle of KV bytes is not constant false: it
    fires on the held bytes and the secret themselves."""
    side = routes["side-channel with the key"]
    assert side["handshake, sealed with the key"] == {"answered": True, "answer": "HandshakeReply"}, side
    assert side["claim, sealed with the key"] == {"answered": True, "answer": "ErrorReply"}, side
    assert side["a sealed frame, raw"]["answered"] and side["a sealed frame, raw"]["answer_bytes"] > 0, side
    kv = routes["kv-channel with the key"]["read with the key"]
    assert kv["error"] == "NoneType" and kv["frames"] == 1 and "not_claimed" in kv["messages"][0], kv
    assert _kv_in(held_bytes(victim_kv(), HELD_BLOCKS).hex()) and _kv_in(SECRET.hex())
