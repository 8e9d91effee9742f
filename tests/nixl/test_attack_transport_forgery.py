"""Attacks on the transport of the side channel, against a real PrefillWorker's side channel (real NIXL agent,
real ZMQ, loopback), each bounded in count and time:
- an on-path observer of one legit handshake must not read the NIXL agent metadata or a claim's token;
- a sealed request captured on its way to one worker must not be answered by another host's worker on the same
  port;
- old-format (version-2, `KVB1`) sealed frames are dropped and counted, not answered.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time

import pytest
import zmq

from kvbridge.core.leases import blocks_digest
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer, destination
from support.prefill_workers import prefill_worker

pytestmark = pytest.mark.nixl

KEY = b"r" * 32
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
TOKEN = "f" * 32


def make_worker(key: bytes | None, engine_id: str = "p", host: str = "127.0.0.1", port: int = 0) -> PrefillWorker:
    return prefill_worker(GEOMETRY, key, engine_id=engine_id, port=port, side_channel_host=host)


def handshake() -> wire.HandshakeRequest:
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    return wire.HandshakeRequest.build(
        "d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY, "LBHNC", memory, target=(0, WorkerRank(0, 0))
    )


def claim() -> wire.Claim:
    return wire.Claim(
        request_id="victim-7",
        block_ids=(2, 3),
        engine_id="d",
        worker=wire.Worker(),
        token=TOKEN,
        prompt_hash="h",
        blocks_digest=blocks_digest((2, 3)),
    )


def send_raw(host: str, port: int, frame: bytes, timeout_s: float = 2.0) -> bytes | None:
    """One frame on a fresh DEALER (what an attacker with captured bytes can do); the raw answer or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    try:
        sock.send(frame)
        return sock.recv() if sock.poll(round(timeout_s * 1000)) else None
    finally:
        sock.close(linger=0)


class Relay:
    """A TCP relay in front of a worker that copies every byte both ways: an on-path observer without the key."""

    def __init__(self, port: int) -> None:
        self.captured: list[bytes] = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._target = port
        self._socks: list[socket.socket] = [self._listen]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.captured.append(data)
                dst.sendall(data)
        except OSError:
            pass

    def seen(self) -> bytes:
        return b"".join(self.captured)

    def close(self) -> None:
        for s in self._socks:
            s.close()


def observe(worker: PrefillWorker, key: bytes | None) -> tuple[bytes, wire.HandshakeReply, wire.Message]:
    """A legit peer's handshake and claim to `worker`, through a watched link: (the bytes seen, reply, answer)."""
    relay = Relay(worker.port)
    sealer = Sealer(key) if key else None
    me = destination(worker.port, "p")

    def ask(message: wire.Message) -> wire.Message:
        frame, nonce = sealer.seal_request(wire.encode(message), me) if sealer else (wire.encode(message), b"")
        answer = send_raw("127.0.0.1", relay.port, frame, timeout_s=5.0)
        assert answer is not None
        return wire.decode(sealer.open_answer(answer, nonce) if sealer else answer)

    try:
        reply = ask(handshake())
        worker.hold("victim-7", ((2, 3),), token=TOKEN, prompt_hash="h")
        answer = ask(claim())
        time.sleep(0.1)  # the relay's last bytes
        return relay.seen(), reply, answer
    finally:
        relay.close()


def test_an_observer_of_a_legit_handshake_and_claim_learns_no_metadata_and_no_token():
    """Sealed bodies are encrypted, not plaintext behind a MAC (which lets an observer take the NIXL agent metadata,
    then READ/WRITE all KV, and the claim's token): neither the metadata, nor the agent's name,
    nor the token appears in anything the observer saw, while the legit peer's handshake and claim succeed."""
    worker = make_worker(KEY)
    try:
        seen, reply, answer = observe(worker, KEY)
    finally:
        worker.close()
    assert isinstance(reply, wire.HandshakeReply) and isinstance(answer, wire.Ack)
    assert len(reply.agent_metadata) > 100 and len(seen) > len(reply.agent_metadata)
    assert reply.agent_metadata not in seen
    assert reply.agent_metadata[:32] not in seen and reply.agent_name.encode() not in seen
    assert TOKEN.encode() not in seen


def test_the_observer_oracle_sees_what_travels_in_clear():
    """Negative control of the test above: without a key the same exchange travels in clear, and the oracle finds
    the metadata, the agent's name and the token in what the relay saw."""
    worker = make_worker(None)
    try:
        seen, reply, answer = observe(worker, None)
    finally:
        worker.close()
    assert isinstance(reply, wire.HandshakeReply) and isinstance(answer, wire.Ack)
    assert reply.agent_metadata in seen and reply.agent_name.encode() in seen and TOKEN.encode() in seen


@pytest.fixture
def two_hosts():
    """Two keyed workers of two engines on the same port of two addresses (two hosts with one base port)."""
    port = free_base_port(1)
    a = make_worker(KEY, "engine-a", "127.0.0.1", port)
    try:
        b = make_worker(KEY, "engine-b", "127.0.0.2", port)
    except BaseException:
        a.close()
        raise
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_request_captured_on_its_way_to_one_worker_is_not_answered_by_another(two_hosts):
    """Bound to the destination port only, a frame captured on its way to 127.0.0.1:P would be answered by another
    host's worker on 127.0.0.2:P (with its NIXL metadata). A sealed request is bound to the worker's identity
    (engine id, dp/pp/tp, port): the other worker drops it, counted as misaddressed; the
    control: a request sealed for the other worker is answered by it, and the captured one by its own."""
    a, b = two_hosts
    legit = Sealer(KEY)
    frame, nonce = legit.seal_request(wire.encode(handshake()), destination(a.port, "engine-a"))
    assert send_raw("127.0.0.2", b.port, frame) is None  # the replay to the other host: no answer
    assert b._server.sealer.dropped["misaddressed"] == 1
    answer = send_raw("127.0.0.1", a.port, frame)  # the original destination answers it (once)
    reply = wire.decode(legit.open_answer(answer, nonce))
    assert isinstance(reply, wire.HandshakeReply) and reply.engine_id == "engine-a"
    assert send_raw("127.0.0.1", a.port, frame, timeout_s=0.5) is None  # and a replay to it is dropped
    frame, nonce = legit.seal_request(wire.encode(handshake()), destination(b.port, "engine-b"))
    reply = wire.decode(legit.open_answer(send_raw("127.0.0.2", b.port, frame), nonce))
    assert isinstance(reply, wire.HandshakeReply) and reply.engine_id == "engine-b"


def old_frame(key: bytes, body: bytes, port: int) -> bytes:
    """A sealed request of the version-2 format (`KVB1`, plaintext body, bound to the port), built by hand."""
    ts, nonce = int(time.time() * 1000).to_bytes(8, "big"), secrets.token_bytes(16)
    mac = hmac.new(key, b"kvbridge-side-channel-v1|" + b"Q%d|" % port + ts + nonce + body, hashlib.sha256).digest()
    return b"KVB1" + ts + nonce + mac + body


def test_an_old_format_sealed_frame_is_dropped_and_counted():
    """Protocol 3 changed the sealed frame: a version-2 peer's frame (valid under the old scheme with the right
    key) gets no answer and is counted as old_format; the control: the current format is answered."""
    worker = make_worker(KEY)
    try:
        assert send_raw("127.0.0.1", worker.port, old_frame(KEY, wire.encode(handshake()), worker.port), 1.0) is None
        assert worker._server.sealer.dropped["old_format"] == 1
        frame, nonce = Sealer(KEY).seal_request(wire.encode(handshake()), destination(worker.port, "p"))
        answer = Sealer(KEY).open_answer(send_raw("127.0.0.1", worker.port, frame), nonce)
        assert isinstance(wire.decode(answer), wire.HandshakeReply)
    finally:
        worker.close()


@pytest.mark.parametrize("trust", [True, False])
def test_idle_connections_from_a_key_holders_own_address_do_not_cut_it(trust, monkeypatch):
    """128 idle unauthenticated connections from the legit peer's own address must not lock it out (a bound per
    address that cuts every new connection cuts the peer's too): the oldest connection that never sent an
    authenticated frame is cut: with a bound of 8 per address, a key holder's open connection survives 12 idle ones
    from its address, a fresh keyed exchange is answered, and the oldest idle ones are the ones cut (5 cuts: 13
    connections, 8 kept). Negative control (trust=False: authenticated frames are not noted): the key holder's
    connection, the oldest, is cut (fds are reused, so the oracle is the count: its reconnection costs a 6th cut)."""
    from kvbridge.wire.side_channel_client import SideChannelClient, exchange
    from kvbridge.wire.side_channel_server import SideChannelServer

    if not trust:
        monkeypatch.setattr(
            "kvbridge.wire.side_channel_connections.ConnectionBound.authenticated", lambda self, fd: None
        )
    server = SideChannelServer(
        0, lambda m: wire.Ack(request_id="ok"), "127.0.0.1", max_connections_per_address=8, sealer=Sealer(KEY)
    )
    server.start()
    client = SideChannelClient(timeout_s=2.0, retries=0, sealer=Sealer(KEY))
    idle: list[socket.socket] = []
    try:
        assert client.exchange_all([("127.0.0.1", server.port)], wire.Ack()) == [wire.Ack(request_id="ok")]
        (legit_fd,) = server.connections._address
        for _ in range(12):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            time.sleep(0.03)
        time.sleep(0.3)
        if not trust:  # the key holder's connection was cut, and its DEALER reconnected: a 6th cut at least
            deadline = time.monotonic() + 3.0
            while server.connections.cut < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.connections.cut >= 6
            return
        assert server.connections.cut == 5
        assert legit_fd in server.connections._address
        assert client.exchange_all([("127.0.0.1", server.port)], wire.Ack()) == [wire.Ack(request_id="ok")]
        fresh = exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2.0, retries=0, sealer=Sealer(KEY))
        assert fresh == wire.Ack(request_id="ok")
        assert legit_fd in server.connections._address
    finally:
        client.close()
        for sock in idle:
            sock.close()
        server.close()


def test_dropped_frames_are_reported_at_a_bounded_rate(caplog):
    """Dropped frames are counted, and the server logs them with totals by reason, once at
    the first and then at most once every `drop_warning_s`: 50 forged frames give one line; the control: after
    the interval the next drop is reported again."""
    import logging

    from kvbridge.wire.side_channel_server import SideChannelServer

    server = SideChannelServer(0, lambda m: wire.Ack(), "127.0.0.1", sealer=Sealer(KEY))
    server.drop_warning_s = 1.0
    server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge.wire.side_channel_server"):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            for _ in range(50):
                sock.send(b"forged")
            deadline = time.monotonic() + 5
            while sum(server.sealer.dropped.values()) < 50 and time.monotonic() < deadline:
                time.sleep(0.02)
            lines = [r.getMessage() for r in caplog.records if "dropped frames" in r.getMessage()]
            assert len(lines) == 1 and "unauthenticated" in lines[0]
            time.sleep(1.1)
            sock.send(b"forged")
            deadline = time.monotonic() + 5
            while len([r for r in caplog.records if "dropped frames" in r.getMessage()]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sock.close(linger=0)
    finally:
        server.close()
