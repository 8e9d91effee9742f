"""A prefill worker's exposure to the network and to key holders without a request's token: which addresses its UCX
listens on, an oversized answer to a decode-side client, the claim oracle (held ids told from unknown ones), a
handshake answered by another engine, and idle connections locking other peers out (docs/security.md, rows 3, 6,
9, 14 and 15). Real NIXL agents and ZMQ sockets on loopback; bounded in count and time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import zmq

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ProtocolError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import blocks_digest
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.side_channel import MAX_ANSWER_BYTES
from kvbridge.wire.side_channel_client import exchange
from support.prefill_workers import prefill_worker

pytestmark = pytest.mark.nixl

KEY = b"p" * 32
P = ("p", 0, 0, 0)  # the keyed prefill worker's identity, which sealed requests are bound to
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)

# Runs in a process of its own (UCX reads its environment once per process): a keyed PrefillWorker with the
# given extra config, then prints the addresses its process listens on (TCP sockets among its own fds).
LISTENER = r"""
import json, os, socket, sys
import torch
from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found

g = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
kv = torch.zeros(1 << 16, dtype=torch.uint8)
memory = synthesize_memory("LBHNC", g, [0, 1], 2, 16, kv.data_ptr())
config = BridgeConfig(side_channel_port=free_base_port(1), **json.loads(sys.argv[1]))
worker = PrefillWorker(WorkerIdentity("v", ParallelLayout(), 0, WorkerRank(0, 0), g), memory, config, key=b"k" * 32)
worker.start()
try:
    print("LISTENING " + json.dumps(listening()), flush=True)
finally:
    worker.close()
"""


def listening_addresses(extra: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # kvbridge's defaults, not the CI's
    out = subprocess.run(
        [sys.executable, "-c", LISTENER, json.dumps(extra)], capture_output=True, text=True, timeout=120, env=env
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("LISTENING ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def has_external_ipv4() -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source address
            return not s.getsockname()[0].startswith("127.")
    except OSError:
        return False


def test_a_default_prefill_worker_listens_on_loopback_only():
    """Left to its own defaults UCX listens on the machine's external address too (192.0.2.2:41145).
    Every listener of a default worker (side channel and UCX) is on loopback. The negative control: with
    `ucx_net_devices: all` (and the opt-in it needs, `ucx_tcp_exposes_process_memory`) the same check sees a
    listener on another address (where the machine has one)."""
    default = listening_addresses({})
    assert default and all(a.startswith("127.") or a == "::1" for a in default), default
    if not has_external_ipv4():
        pytest.skip("no non-loopback interface here for the negative control")
    wide = listening_addresses({"ucx_net_devices": "all", "ucx_tcp_exposes_process_memory": True})
    assert any(not (a.startswith("127.") or a == "::1") for a in wide), wide


class Answerer:
    """A ROUTER that answers each request with `size` bytes: a hostile prefill facing a decode-side client."""

    def __init__(self, size: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.blob = b"\xff" * size
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.sock.poll(10_000):
            frames = self.sock.recv_multipart()
            self.sock.send_multipart([frames[0], self.blob])

    def close(self) -> None:
        self.thread.join(5)
        self.sock.close(linger=0)


@pytest.mark.parametrize(("size", "error"), [(MAX_ANSWER_BYTES + 1024, TransferError), (1 << 20, ProtocolError)])
def test_an_answer_over_the_bound_never_reaches_the_decode_side(size, error):
    """Unbounded, a 300 MB answer cost the decode process +571 MB. An answer over MAX_ANSWER_BYTES is now cut by
    ZMQ before it is buffered (no answer: the connection is reset); the control, 1 MiB of the same garbage, does
    arrive (and is refused as undecodable), so the test can tell the two apart."""
    answerer = Answerer(size)
    try:
        with pytest.raises(error):
            exchange("127.0.0.1", answerer.port, wire.Ack(request_id="x"), timeout_s=2.0, retries=0)
    finally:
        answerer.close()


@pytest.fixture
def keyed_worker():
    worker = prefill_worker(GEOMETRY, KEY)
    try:
        yield worker
    finally:
        worker.close()


def test_a_claim_without_the_token_does_not_tell_held_ids_from_unknown_ones(keyed_worker):
    """Unchecked, claims answer 'is not held by ...' for unknown ids and 'blocks [..] are not request X's' for
    held ones, so two claims reveal which ids are held and which blocks they have. Without the request's
    token, a held id, an unknown id and a held id with other blocks get the same answer; the control: the token
    holder's claim is acknowledged."""
    keyed_worker.hold("held", ((1, 2, 3),), token="t" * 32, prompt_hash="h")
    sealer = Sealer(KEY)

    def claim(request_id: str, blocks: tuple[int, ...], token: str) -> wire.Message:
        message = wire.Claim(
            request_id=request_id,
            block_ids=blocks,
            engine_id="d",
            worker=wire.Worker(),
            token=token,
            prompt_hash="h",
            blocks_digest=blocks_digest((1, 2, 3)),
        )
        return exchange("127.0.0.1", keyed_worker.port, message, timeout_s=5.0, retries=0, sealer=sealer, identity=P)

    answers = {claim("held", (1,), "x" * 32), claim("unknown", (1,), "x" * 32), claim("held", (7, 8), "x" * 32)}
    assert len(answers) == 1, answers
    assert isinstance(claim("held", (1, 2), "t" * 32), wire.Ack)


def test_a_handshake_answered_by_another_engine_is_refused(keyed_worker):
    """An engine cache keyed by engine id alone, with the reply's engine id never compared, would let a fake
    side channel stand in for a real engine. A reply must come from the engine the
    params name, and engines are cached by (engine id, host, port, DP rank). Params naming engine 'victim' at
    the address of engine 'p' are refused before any answer: the sealed request is bound to
    engine 'victim', so 'p' drops it as misaddressed (a key-holding impostor that ignored the binding would still
    fail the engine-id check); the control: the same address under its own id connects."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.core.errors import TransferTimeout
    from kvbridge.runtime.peers import PeerBook
    from kvbridge.wire.params import PrefillDone

    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    identity = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    loaded: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        book = PeerBook(
            identity,
            memory,
            BridgeConfig(handshake_timeout_s=1.0, handshake_retries=0),
            pool,
            lambda meta, name: loaded.append(name) or name,
            Sealer(KEY),
        )

        def source(engine_id: str) -> PrefillDone:
            return PrefillDone(
                remote_engine_id=engine_id,
                remote_request_id="r",
                remote_block_ids=[1],
                remote_host="127.0.0.1",
                remote_port=keyed_worker.port,
                remote_layout="pp=1,tp=1",
            )

        misaddressed = keyed_worker._server.sealer.dropped["misaddressed"]
        with pytest.raises(TransferTimeout):
            book.connect(source("victim")).result(timeout=20)
        assert loaded == [], "no NIXL metadata may be loaded from an impostor"
        assert keyed_worker._server.sealer.dropped["misaddressed"] == misaddressed + 1
        engine = book.connect(source("p")).result(timeout=20)
        assert engine.key == ("p", "127.0.0.1", keyed_worker.port, 0) and loaded == ["kvbridge-p-dp0-pp0-tp0"]


@pytest.mark.parametrize("idle", [3, 5, 12])
def test_idle_connections_from_one_address_do_not_lock_other_peers_out(idle):
    """The connection bound against many silent peers: `idle` silent TCP connections from 127.0.0.2 (no key, no
    frame), then a sealed handshake from 127.0.0.1, on a server whose bound is 4. With 3 the bound is not reached.
    With 5 and 12 it is full: a bound that cut the newest connection whoever it came from (b2beea8) let one
    outsider lock every peer out (at the default 512: 520 idle connections, three legit handshakes in a row timed
    out at 5 s); the bound now cuts from the address holding the most, so the handshake is answered."""
    from kvbridge.wire.side_channel_server import SideChannelServer

    sealer = Sealer(KEY)
    server = SideChannelServer(
        0, lambda message: wire.Ack(request_id="ok"), "127.0.0.1", max_connections=4, sealer=sealer
    )
    server.start()
    flood: list[socket.socket] = []
    try:
        for _ in range(idle):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", server.port))
            flood.append(sock)
        answer = exchange("127.0.0.1", server.port, wire.Ack(request_id="x"), timeout_s=2.0, retries=0, sealer=sealer)
        assert answer == wire.Ack(request_id="ok")
    finally:
        for sock in flood:
            sock.close()
        server.close()
