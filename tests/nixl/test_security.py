"""Attacks on a real PrefillWorker's side channel (real NIXL agent, real ZMQ, loopback), each bounded in count and
time: floods and oversized frames are dropped without memory growth while keyed peers keep being answered.
The same attacks against real vLLM servers are in test_e2e_trust.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import zmq

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError
from kvbridge.core.leases import MAX_EARLY
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer, destination
from kvbridge.wire.side_channel_client import exchange
from support import fork_server
from support.prefill_workers import prefill_worker

pytestmark = pytest.mark.nixl

KEY = b"s" * 32
P = ("p", 0, 0, 0)  # the keyed prefill worker's identity, which sealed requests are bound to
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_worker(key: bytes | None, host: str = "127.0.0.1", **extra) -> PrefillWorker:
    return prefill_worker(GEOMETRY, key, side_channel_host=host, start=False, **extra)


@pytest.fixture
def keyed():
    worker = make_worker(KEY).start()
    try:
        yield worker
    finally:
        worker.close()


def handshake() -> wire.HandshakeRequest:
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    return wire.HandshakeRequest.build(
        "d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY, "LBHNC", memory, target=(0, WorkerRank(0, 0))
    )


def test_without_a_key_only_loopback_may_listen():
    config = BridgeConfig(side_channel_host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"side_channel_host '0\.0\.0\.0' is not a loopback address"):
        config.check_exposure(has_key=False)
    assert config.check_exposure(has_key=True)
    assert BridgeConfig().check_exposure(has_key=False) is False  # loopback without a key: allowed, warned
    # UCX over tcp beyond loopback (opted into): a wildcard also needs ucx_net_devices named
    with pytest.raises(ConfigError, match="side_channel_host"):
        make_worker(KEY, host="0.0.0.0", ucx_tcp_exposes_process_memory=True)
    # by default UCX stays on loopback whatever side_channel_host is (the KV leaves the host over kvbridge's channel)
    assert make_worker(KEY, host="0.0.0.0").transport.config.ucx_net_devices == "lo"


def _flood(port: int) -> None:
    """The attacker, in a process of its own (its send queues must not count as the server's memory)."""
    context = zmq.Context()
    socks = [context.socket(zmq.DEALER) for _ in range(8)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 100)
        s.connect(f"tcp://127.0.0.1:{port}")
    blob, huge = os.urandom(200_000), os.urandom(2 << 20)
    for i in range(400):
        with contextlib.suppress(zmq.Again):
            socks[i % 8].send(huge if i % 20 == 0 else blob)
    time.sleep(1.0)
    for s in socks:
        s.close(linger=0)
    context.term()


def test_a_flood_of_unauthenticated_and_oversized_frames_is_dropped_without_memory_growth(keyed):
    """Bounded: 400 frames of 200 KB and 20 of 2 MiB from 8 connections of another process, while a keyed
    peer's handshakes are answered throughout."""
    exchange("127.0.0.1", keyed.port, handshake(), timeout_s=5, sealer=Sealer(KEY), identity=P)  # warm
    before = rss_mb()
    stop = threading.Event()
    answered: list[float] = []

    def legit() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            reply = exchange("127.0.0.1", keyed.port, handshake(), timeout_s=5, sealer=Sealer(KEY), identity=P)
            assert isinstance(reply, wire.HandshakeReply)
            answered.append(time.monotonic() - t0)
            time.sleep(0.05)

    thread = threading.Thread(target=legit, daemon=True)
    thread.start()
    attacker = fork_server.start(_flood, keyed.port)
    attacker.join(timeout=60)
    stop.set()
    thread.join(timeout=10)
    growth = rss_mb() - before
    dropped = keyed.lease_counts()["unauthenticated"]
    print(f"flood: {dropped} frames dropped, server RSS +{growth:.0f} MB, legit handshakes {len(answered)}")
    assert attacker.exitcode == 0
    assert dropped >= 100 and growth < 32
    assert answered and max(answered) < 2.0


def test_a_flood_of_notifications_for_unknown_requests_stays_bounded(keyed):
    """150 Notify messages for never-held ids must not cost memory (unbounded: +222 MB): an unknown id costs a
    bounded entry."""
    before = rss_mb()
    sealer = Sealer(KEY)
    from kvbridge.wire.side_channel_client import SideChannelClient

    client = SideChannelClient(timeout_s=5, retries=0, sealer=sealer)
    try:
        for i in range(MAX_EARLY + 500):
            note = wire.Notify(request_id=f"never-{i}", engine_id="x", worker=wire.Worker(), expected=1, token="t")
            client.exchange_all([("127.0.0.1", keyed.port)], note, [P])
    finally:
        client.close()
    with keyed._lock:
        early = len(keyed._leases._early)
    growth = rss_mb() - before
    print(f"{MAX_EARLY + 500} notifications for unknown ids: {early} kept, RSS +{growth:.0f} MB")
    assert early <= MAX_EARLY and growth < 32


def test_a_replayed_claim_is_not_answered(keyed):
    keyed.hold("r", ((1,),), token="tok", prompt_hash="h")
    sealer = Sealer(KEY)
    claim = wire.Claim(
        request_id="r", block_ids=(1,), engine_id="d", worker=wire.Worker(), token="tok", prompt_hash="h"
    )
    frame, _ = sealer.seal_request(wire.encode(claim), destination(keyed.port, *P))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{keyed.port}")
    try:
        sock.send(frame)
        assert sock.poll(5000), "the first copy is answered"
        sock.recv()
        sock.send(frame)  # the same bytes again: a replay
        assert not sock.poll(500), "a replayed frame must get no answer"
    finally:
        sock.close(linger=0)
