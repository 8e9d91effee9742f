"""A claim that waits for its hold leaves its answer time to come back: a prefill worker on a loaded machine
answers a lapsed wait late, and an answer past the attempt's deadline counts as none, so two such in a row would
make a live engine dead (`runtime.claims.CLAIM_WAIT_SHARE`).

A decode worker and a prefill worker in this process (two NIXL agents over UCX on loopback), with an answer
deadline of DEADLINE_S; every answer the prefill worker gives later (a waiting claim's) is held back LATE_S, as a
starved thread would; the request's hold comes HOLD_AFTER_S after the load is queued, past two attempts'
deadlines. The load must land (each answer then comes 0.5 s before its deadline), and the control, a claim that
asks to wait 0.8 of the deadline (the share kvbridge asked before), fails it as an engine that does not answer.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.runtime import claims
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire.later import Later
from support.prefill_process import GEOMETRY, memory_of, params_of

pytestmark = pytest.mark.nixl

DEADLINE_S = 2.0  # handshake_timeout_s: one attempt's answer deadline (one retry, the default)
LATE_S = 0.5  # how late the prefill worker's thread gives a waiting claim's answer
HOLD_AFTER_S = 5.0  # the hold comes after two attempts' deadlines


@pytest.fixture
def late_answers(monkeypatch):
    give = Later.give

    def late_give(self, message) -> None:
        time.sleep(LATE_S)
        give(self, message)

    monkeypatch.setattr(Later, "give", late_give)


def load_with_a_late_hold() -> tuple[bool, bool]:
    """(whether the load landed, whether the decode took the prefill engine for dead)."""
    port = free_base_port(1)
    config = BridgeConfig(side_channel_port=port, handshake_timeout_s=DEADLINE_S)
    layout = ParallelLayout()
    prefill_kv, decode_kv = torch.randn(1 << 14), torch.zeros(1 << 14)
    prefill = PrefillWorker(
        WorkerIdentity("prefill", layout, 0, WorkerRank(0, 0), GEOMETRY), memory_of(prefill_kv), config
    ).start()
    decode = None
    hold = None
    try:
        decode = DecodeWorker(
            WorkerIdentity("decode", layout, 0, WorkerRank(0, 0), GEOMETRY), memory_of(decode_kv), config
        ).start()
        source = params_of(port, "r", [1, 2], engine="prefill")
        hold = threading.Timer(HOLD_AFTER_S, prefill.hold, ("r", ((1, 2),), "token-r", "h"))
        hold.start()
        decode.load(LoadJob("decode-r", source, ((3, 4),), ((1, 2),)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, failed, _ = decode.results(wait_s=0.05)
            if done or failed:
                return bool(done), decode.peers.is_dead(source)
        raise AssertionError("the load was never reported")
    finally:
        if hold is not None:
            hold.cancel()
        if decode is not None:
            decode.close()
        prefill.close()


def test_a_late_hold_answered_late_still_loads(late_answers):
    loaded, dead = load_with_a_late_hold()
    assert loaded and not dead, f"loaded: {loaded}, engine taken for dead: {dead}"


def test_negative_control_a_claim_waiting_most_of_the_deadline_fails_the_load(late_answers, monkeypatch, caplog):
    monkeypatch.setattr(claims, "CLAIM_WAIT_SHARE", 0.8)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        loaded, dead = load_with_a_late_hold()
    assert not loaded and dead, "with 0.4 s of slack the late answers count as none: the live engine is dropped"
    assert "no answer from the side channel" in caplog.text and "to Claim: 2 attempts" in caplog.text, caplog.text
