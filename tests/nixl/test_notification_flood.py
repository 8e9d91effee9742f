"""NIXL notifications are not sealed: a peer that reaches a prefill worker's NIXL agent (its metadata leaked, or
forged from its own) can send 2,000 notifications for ids nobody holds. Unchecked, they fill the
early-notification table (1,024 entries), and a key holder's notification with the right token, arriving before
its request's hold, is then refused and the request left held until its lease runs out.

A notification for a request not yet held is kept only if its token is a MAC of the request's id under the
deployment key (`wire.keys.request_token`), and one without a token is ignored: the flood takes no room, and the key
holder's notification frees the request as soon as it is held. Real NIXL agents on loopback."""

from __future__ import annotations

import secrets
import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import MAX_EARLY
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker, transport_config
from kvbridge.serving.launcher import free_base_port
from kvbridge.transport.nixl import NixlTransport
from kvbridge.wire import messages as wire
from kvbridge.wire.keys import KeyRing, request_token

pytestmark = pytest.mark.nixl

KEY = b"notification-flood-key-0123456789ab"
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
FLOOD = 2000


def make_worker() -> PrefillWorker:
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1))
    worker = PrefillWorker(
        WorkerIdentity("p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config, key=KEY
    )
    worker._kv = kv
    return worker


def sender(worker: PrefillWorker, name: str) -> tuple[NixlTransport, str]:
    """A NIXL agent that loaded the worker's metadata (what a forged or leaked blob gives an outsider)."""
    agent = NixlTransport(name, transport_config(worker.config, "DRAM")).start()
    return agent, agent.add_peer(worker.transport.agent_metadata())


def until(condition, agents, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        for agent in agents:
            agent.notifications()  # the senders' UCX progress
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("checked", [True, False], ids=["token-checked", "negative-control-unchecked"])
def test_a_forged_notification_flood_never_refuses_a_key_holders_notification(checked):
    worker = make_worker()
    if not checked:  # the former behaviour: any token takes room in the early table
        worker._leases.token_check = None
    worker.start()
    forger, victim = sender(worker, "forged-peer")
    decode, peer = sender(worker, "kvbridge-d-dp0-pp0-tp0")
    try:
        book = worker._leases
        for i in range(FLOOD):
            note = wire.Notify(
                request_id=f"forged-{i}", engine_id="x", worker=wire.Worker(), token=secrets.token_hex(24)
            )
            forger._require().send_notif(victim, wire.encode(note))
        no_token = wire.Notify(request_id="forged-empty", engine_id="x", worker=wire.Worker())
        forger._require().send_notif(victim, wire.encode(no_token))
        assert until(lambda: book.refused_total + len(book._early) >= FLOOD, [forger])
        print(f"{FLOOD} forged notifications: {len(book._early)} kept, {book.refused_total} refused")

        token = request_token(KeyRing.of(KEY), "p", "victim-req", secrets.token_bytes(8))
        refused_before = book.refused_total
        legit = wire.Notify(request_id="victim-req", engine_id="d", worker=wire.Worker(), expected=1, token=token)
        decode._require().send_notif(peer, wire.encode(legit))
        assert until(lambda: "victim-req" in book._early or book.refused_total > refused_before, [decode])
        worker.hold("victim-req", ((1, 2),), token=token, prompt_hash="h")
        freed: set[str] = set()
        until(lambda: freed.update(worker.finished()[0]) or "victim-req" in freed, [decode], timeout_s=3.0)
        if checked:
            assert len(book._early) == 0 and book.refused_total == FLOOD  # the tokenless one is ignored, not counted
            assert "victim-req" in freed and book.held == 0
        else:
            assert len(book._early) == MAX_EARLY  # the flood filled the table...
            assert "victim-req" not in freed and book.held == 1  # ...and the key holder's note was refused
    finally:
        forger.close()
        decode.close()
        worker.close()
