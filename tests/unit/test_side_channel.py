"""Side channel: port computation, the pure responder, and real ZMQ servers and clients on 127.0.0.1."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.errors import (
    IncompatiblePeerError,
    LayoutError,
    PeerGone,
    ProtocolError,
    RequestParamsError,
    TransferTimeout,
)
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire
from kvbridge.wire import side_channel as sc
from kvbridge.wire import side_channel_client as scc
from kvbridge.wire import side_channel_server as scs
from kvbridge.wire.local_address import _interface_addresses, on_this_host
from kvbridge.wire.side_channel_connections import ConnectionBound

HOST = "127.0.0.1"
GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=4, head_size=16, dtype="bfloat16", block_size=16)
PREFILL = ParallelLayout(pp=2, tp=2, dp=2)
DECODE = ParallelLayout(pp=2, tp=1)
FIRST = WorkerRank(0, 0)
DEADLINE_S = 2.0  # a live server must answer a valid request within this


def prefill_reply(dp_rank: int, rank: WorkerRank, layout: ParallelLayout = PREFILL) -> wire.HandshakeReply:
    memory = synthesize_memory(
        "LBHNC",
        GEOMETRY,
        list(layout.stage_layers(GEOMETRY.num_layers, rank.pp)),
        len(layout.kv_heads(GEOMETRY.num_kv_heads, rank.tp)),
        16,
        (1 + dp_rank * 16 + rank.pp * 4 + rank.tp) << 32,
    )
    return wire.HandshakeReply.build(
        f"prefill-{dp_rank}", layout, dp_rank, rank, GEOMETRY, "LBHNC", f"agent-{rank}", b"meta", memory
    )


def decode_request(
    rank: WorkerRank = FIRST,
    target: tuple[int, WorkerRank] | None = None,
    geometry: KVGeometry = GEOMETRY,
) -> wire.HandshakeRequest:
    layers = list(DECODE.stage_layers(geometry.num_layers, rank.pp))
    memory = synthesize_memory("LBNHC", geometry, layers, geometry.num_kv_heads, 8, 1 << 20)
    return wire.HandshakeRequest.build("decode-0", DECODE, 0, rank, geometry, "LBNHC", memory, target=target)


# --- addresses ----------------------------------------------------------------------------------------------


def test_port_formula_examples() -> None:
    layout = ParallelLayout(pp=2, tp=2, dp=2)
    ports = sc.side_channel_ports(5000, layout)
    assert ports[(0, WorkerRank(0, 0))] == 5000
    assert ports[(0, WorkerRank(0, 1))] == 5001
    assert ports[(0, WorkerRank(1, 0))] == 5002  # the seed bug gave pp1/tp0 the port of pp0/tp0
    assert ports[(1, WorkerRank(1, 1))] == 5007
    assert sc.side_channel_port(5000, ParallelLayout(), 0, WorkerRank(0, 0)) == 5000


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(1, 65535),
)
def test_ports_are_unique_contiguous_and_in_range(pp: int, tp: int, dp: int, base: int) -> None:
    layout = ParallelLayout(pp=pp, tp=tp, dp=dp)
    workers = pp * tp * dp
    if base + workers - 1 > sc.MAX_PORT:
        with pytest.raises(LayoutError, match="exceed 65535"):
            sc.side_channel_port(base, layout, dp - 1, WorkerRank(pp - 1, tp - 1))
        with pytest.raises(LayoutError, match="exceed 65535"):
            sc.side_channel_port(base, layout, 0, WorkerRank(0, 0))  # every worker fails alike
        return
    ports = sc.side_channel_ports(base, layout)
    assert len(ports) == workers
    assert sorted(ports.values()) == list(range(base, base + workers))


@pytest.mark.parametrize(
    ("base", "dp_rank", "rank", "match"),
    [
        (0, 0, WorkerRank(0, 0), "base_port"),
        (65536, 0, WorkerRank(0, 0), "base_port"),
        (True, 0, WorkerRank(0, 0), "base_port"),
        (5000, 2, WorkerRank(0, 0), "dp rank 2"),
        (5000, -1, WorkerRank(0, 0), "dp rank -1"),
        (5000, 0, WorkerRank(2, 0), "outside layout"),
        (5000, 0, WorkerRank(0, 2), "outside layout"),
        (65530, 0, WorkerRank(0, 0), "at most 65528"),
    ],
)
def test_bad_port_arguments(base: int, dp_rank: int, rank: WorkerRank, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        sc.side_channel_port(base, PREFILL, dp_rank, rank)


def test_endpoints_put_ipv6_hosts_in_brackets() -> None:
    assert sc.endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert sc.endpoint("::1", 5) == "tcp://[::1]:5"


# --- the pure responder -------------------------------------------------------------------------------------


def _answer(data: bytes, handler: sc.Handler) -> wire.Message:
    return wire.decode(sc.respond(data, handler))


def test_respond_answers_handshakes_and_refusals() -> None:
    reply = prefill_reply(1, WorkerRank(1, 0))
    handler = sc.handshake_handler(reply)
    assert _answer(wire.encode(decode_request(target=(1, WorkerRank(1, 0)))), handler) == reply
    refused = _answer(wire.encode(decode_request(geometry=KVGeometry(4, 4, 32))), handler)
    assert refused == wire.HandshakeRefused(field="head_size", ours=16, theirs=32)
    wrong = _answer(wire.encode(decode_request(target=(1, WorkerRank(0, 0)))), handler)
    assert wrong == wire.HandshakeRefused(field="worker", ours="dp1/pp1/tp0", theirs="dp1/pp0/tp0")


def test_respond_refuses_a_message_of_another_protocol_version() -> None:
    future = msgspec.to_builtins(decode_request(), builtin_types=(bytes,))
    future.update(protocol_version=9, geometry=["changed", "shape"])
    answer = _answer(msgspec.msgpack.encode(future), sc.handshake_handler(prefill_reply(0, WorkerRank(0, 0))))
    assert answer == wire.HandshakeRefused(field="protocol_version", ours=wire.PROTOCOL_VERSION, theirs=9)


def test_respond_turns_garbage_and_handler_failures_into_error_replies() -> None:
    calls: list[wire.Message] = []

    def on_message(message: wire.Message) -> wire.Message:
        calls.append(message)
        match message:
            case wire.Notify(request_id="refuse"):
                raise IncompatiblePeerError("request_id", "a", "refuse")
            case wire.Notify(request_id="bad"):
                raise RequestParamsError("unknown request bad")
            case wire.Notify(request_id="crash"):
                raise RuntimeError("boom")
            case wire.Notify(request_id="unencodable"):
                return "not a message"  # type: ignore[return-value]
        return wire.Ack(request_id=getattr(message, "request_id", ""))

    handler = sc.handshake_handler(prefill_reply(0, WorkerRank(0, 0)), on_message)
    worker = wire.Worker()

    def notify(request_id: str) -> wire.Message:
        return _answer(wire.encode(wire.Notify(request_id=request_id, engine_id="d", worker=worker)), handler)

    assert notify("r1") == wire.Ack(request_id="r1")
    assert notify("refuse") == wire.HandshakeRefused(field="request_id", ours="a", theirs="refuse")
    assert notify("bad") == wire.ErrorReply(message="unknown request bad")
    crash = notify("crash")
    assert isinstance(crash, wire.ErrorReply) and "RuntimeError('boom')" in crash.message
    assert isinstance(notify("unencodable"), wire.ErrorReply)
    garbage = _answer(b"\xc1\x00", handler)
    assert isinstance(garbage, wire.ErrorReply) and "malformed" in garbage.message
    assert len(calls) == 5
    no_hook = _answer(wire.encode(wire.Ack()), sc.handshake_handler(prefill_reply(0, WorkerRank(0, 0))))
    assert no_hook == wire.ErrorReply(message="this side channel does not handle Ack", reason=wire.Refusal.UNEXPECTED)


@pytest.mark.parametrize(
    ("frames", "envelope"),
    [
        ([b"id", wire.encode(wire.Ack())], [b"id"]),  # DEALER
        ([b"id", b"", wire.encode(wire.Ack())], [b"id", b""]),  # REQ
        ([b"id", b"a", b"b"], [b"id"]),
        ([b"id"], [b"id"]),
        ([b"id", b"", b"", b"x"], [b"id", b""]),
    ],
)
def test_answer_frames_keeps_the_envelope(frames: list[bytes], envelope: list[bytes]) -> None:
    answer = scs._answer_frames(frames, lambda m: wire.Ack(request_id="seen"))
    assert answer[:-1] == envelope
    body = frames[len(envelope) :]
    expected = (
        wire.Ack(request_id="seen")
        if len(body) == 1
        else wire.ErrorReply(message=f"expected one message frame, got {len(body)}")
    )
    assert wire.decode(answer[-1]) == expected


# --- live servers -------------------------------------------------------------------------------------------


def start_servers(
    make: Callable[[int], dict[object, scs.SideChannelServer]], attempts: int = 20
) -> dict[object, scs.SideChannelServer]:
    """Start the servers `make(base_port)` returns, retrying other random bases if a port is taken."""
    rng = random.Random()
    for _ in range(attempts):
        servers = make(rng.randrange(20000, 60000))
        started: list[scs.SideChannelServer] = []
        try:
            for server in servers.values():
                server.start()
                started.append(server)
        except OSError:
            for server in started:
                server.close()
            continue
        return servers
    raise RuntimeError("no free range of ports found")


@pytest.fixture(scope="module")
def live() -> Iterator[scs.SideChannelServer]:
    """One prefill worker's server on a free port (module-wide, so fuzzing hits one long-lived server)."""
    reply = prefill_reply(0, WorkerRank(0, 0))
    server = scs.SideChannelServer(0, sc.handshake_handler(reply, lambda m: wire.Ack()), HOST)
    server.start()
    try:
        yield server
    finally:
        server.close()
    assert not server.running


def assert_still_serving(server: scs.SideChannelServer) -> None:
    started = time.monotonic()
    reply = scc.fetch_handshake(HOST, server.port, decode_request(), timeout_s=DEADLINE_S, retries=0)
    assert reply.worker == wire.Worker()
    assert time.monotonic() - started < DEADLINE_S


def test_handshake_over_a_real_socket(live: scs.SideChannelServer) -> None:
    assert live.running and live.port > 0 and live.endpoint == f"tcp://{HOST}:{live.port}"
    reply = scc.fetch_handshake(HOST, live.port, decode_request(target=(0, WorkerRank(0, 0))))
    assert reply == prefill_reply(0, WorkerRank(0, 0))
    assert reply.memory.to_core().layer_ids() == (0, 1)
    ack = scc.exchange(HOST, live.port, wire.Notify(request_id="r", engine_id="d", worker=wire.Worker()))
    assert ack == wire.Ack()


def test_a_req_socket_is_answered_too(live: scs.SideChannelServer) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(live.endpoint)
        sock.send(wire.encode(decode_request()))
        assert sock.poll(int(DEADLINE_S * 1000))
        assert isinstance(wire.decode(sock.recv()), wire.HandshakeReply)
    finally:
        sock.close()


def test_every_worker_of_a_layout_serves_on_its_own_port() -> None:
    """dp=2, pp=2, tp=2 prefill workers all serve at once; each decode worker reaches its peers by the same
    port computation, and every answer comes from the worker it meant to reach."""

    def make(base: int) -> dict[object, scs.SideChannelServer]:
        return {
            (dp, rank): scs.SideChannelServer(
                sc.side_channel_port(base, PREFILL, dp, rank), sc.handshake_handler(prefill_reply(dp, rank))
            )
            for dp in range(PREFILL.dp)
            for rank in PREFILL.workers()
        }

    servers = start_servers(make)
    try:
        base = min(s.port for s in servers.values())
        assert len({s.port for s in servers.values()}) == 8
        plan = make_plan(PREFILL, DECODE, GEOMETRY)
        reached = set()
        for dp in range(PREFILL.dp):
            for decode_worker in DECODE.workers():
                for peer in plan.peers_of(decode_worker):
                    port = sc.side_channel_port(base, PREFILL, dp, peer)
                    request = decode_request(decode_worker, target=(dp, peer))
                    reply = scc.fetch_handshake(HOST, port, request, timeout_s=DEADLINE_S, retries=0)
                    assert (reply.worker.dp_rank, reply.worker.rank) == (dp, peer)
                    assert reply.engine_id == f"prefill-{dp}"
                    reached.add((dp, peer))
        assert reached == set(servers)  # with decode pp=2, tp=1 every prefill worker is read
    finally:
        for server in servers.values():
            server.close()


def test_ports_computed_without_the_pp_rank_are_caught_by_the_target_check() -> None:
    """A decode side computing ports without the pp rank reaches pp0's worker when it means pp1's."""

    def make(base: int) -> dict[object, scs.SideChannelServer]:
        layout = ParallelLayout(pp=2, tp=1)
        return {
            rank: scs.SideChannelServer(
                sc.side_channel_port(base, layout, 0, rank),
                sc.handshake_handler(prefill_reply(0, rank, layout)),
            )
            for rank in layout.workers()
        }

    servers = start_servers(make)
    try:
        base = servers[WorkerRank(0, 0)].port
        seed_port = base + 0  # the seed computed base + tp_rank, so pp1/tp0 got pp0/tp0's port
        with pytest.raises(IncompatiblePeerError) as info:
            scc.fetch_handshake(HOST, seed_port, decode_request(target=(0, WorkerRank(1, 0))), timeout_s=1)
        assert info.value.field == "worker"
        assert "dp0/pp1/tp0" in str(info.value) and "dp0/pp0/tp0" in str(info.value)
    finally:
        for server in servers.values():
            server.close()


@pytest.mark.parametrize(
    ("geometry", "field"),
    [
        (KVGeometry(4, 4, 32), "head_size"),
        (KVGeometry(4, 4, 16, "float16"), "dtype"),
        (KVGeometry(4, 4, 16, block_size=128), "block_size"),
    ],
)
def test_an_incompatible_peer_is_refused_naming_the_field(
    live: scs.SideChannelServer, geometry: KVGeometry, field: str
) -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        scc.fetch_handshake(HOST, live.port, decode_request(geometry=geometry), timeout_s=DEADLINE_S)
    theirs = getattr(GEOMETRY, field)
    assert info.value.field == field
    assert (info.value.ours, info.value.theirs) == (getattr(geometry, field), theirs)
    assert field in str(info.value) and live.endpoint in "".join(info.value.__notes__)
    assert_still_serving(live)


def test_another_protocol_version_is_refused(live: scs.SideChannelServer) -> None:
    request = msgspec.structs.replace(decode_request(), protocol_version=wire.PROTOCOL_VERSION + 1)
    with pytest.raises(IncompatiblePeerError) as info:
        scc.fetch_handshake(HOST, live.port, request, timeout_s=DEADLINE_S)
    assert info.value.field == "protocol_version"
    assert (info.value.ours, info.value.theirs) == (wire.PROTOCOL_VERSION + 1, wire.PROTOCOL_VERSION)


def _send_frames(server: scs.SideChannelServer, frames: list[bytes]) -> list[bytes] | None:
    """Send raw frames from a DEALER; the answer's frames, or None if none came within the deadline."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        sock.send_multipart(frames)
        if sock.poll(int(DEADLINE_S * 1000)):
            return sock.recv_multipart()
        return None
    finally:
        sock.close()


@settings(max_examples=40)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_fuzzed_frames_are_answered_and_never_stall_the_server(
    live: scs.SideChannelServer, frames: list[bytes]
) -> None:
    answer = _send_frames(live, frames)
    assert answer is not None, "the server did not answer"
    body = answer[-1]
    assert isinstance(wire.decode(body), wire.MESSAGE_TYPES)
    assert_still_serving(live)


_REQUEST_BYTES = wire.encode(decode_request())


@settings(max_examples=20)
@given(st.integers(0, len(_REQUEST_BYTES) - 1))
def test_truncated_requests_get_an_error_reply(live: scs.SideChannelServer, cut: int) -> None:
    answer = _send_frames(live, [_REQUEST_BYTES[:cut]])
    assert answer is not None and len(answer) == 1
    error = wire.decode(answer[0])
    assert isinstance(error, wire.ErrorReply) and "truncated" in error.message
    assert_still_serving(live)


def test_oversized_frames_are_dropped_without_harm() -> None:
    server = scs.SideChannelServer(0, sc.handshake_handler(prefill_reply(0, WorkerRank(0, 0))), max_message_bytes=1024)
    server.start()
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoint)
            sock.send(b"\x00" * 4096)  # over the limit: ZMQ disconnects this peer
            assert not sock.poll(200)
        finally:
            sock.close()
        assert_still_serving(server)
    finally:
        server.close()


def test_raw_tcp_garbage_and_silent_connections_do_not_stall_the_server(live: scs.SideChannelServer) -> None:
    silent = socket.create_connection((HOST, live.port), timeout=DEADLINE_S)
    try:
        rng = random.Random(7)
        for size in (1, 10, 64, 1000):
            with socket.create_connection((HOST, live.port), timeout=DEADLINE_S) as raw:
                raw.sendall(bytes(rng.randrange(256) for _ in range(size)))
        half = socket.create_connection((HOST, live.port), timeout=DEADLINE_S)
        half.sendall(b"\xff" + b"\x00" * 8 + b"\x7f")  # the start of a ZMTP greeting, then nothing
        try:
            assert_still_serving(live)
        finally:
            half.close()
    finally:
        silent.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def test_a_port_nobody_listens_on_fails_at_once_not_after_the_bound() -> None:
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(PeerGone, match=rf"{HOST}:{port} refused the connection"):
        scc.fetch_handshake(HOST, port, decode_request(), timeout_s=2.0, retries=2)
    assert time.monotonic() - started < 0.5


def test_a_listening_port_that_never_answers_times_out_within_the_bound() -> None:
    """The silent peer (a stopped process: its kernel still accepts): only the deadline ends the wait."""
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match=rf"{HOST}:{port}.*3 attempts of 0\.1 s"):
            scc.fetch_handshake(HOST, port, decode_request(), timeout_s=0.1, retries=2)
        elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 0.3 + 1.0


def test_a_slow_peer_times_out_and_the_server_recovers() -> None:
    release = threading.Event()

    def slow(message: wire.Message) -> wire.Message:
        release.wait(DEADLINE_S)
        return wire.Ack()

    server = scs.SideChannelServer(0, slow)
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"2 attempts of 0\.1 s"):
            scc.exchange(HOST, server.port, wire.Ack(), timeout_s=0.1, retries=1)
        assert time.monotonic() - started < 0.2 + 1.0
        release.set()
        assert scc.exchange(HOST, server.port, wire.Ack(), timeout_s=DEADLINE_S, retries=0) == wire.Ack()
    finally:
        release.set()
        server.close()


def _echo(message: wire.Message) -> wire.Message:
    """Answers a Claim with its request id (as an ErrorReply), after sleeping if the id says so."""
    assert isinstance(message, wire.Claim)
    if message.request_id.startswith("slow"):
        time.sleep(0.4)
    return wire.ErrorReply(message=message.request_id)


def _claim(request_id: str) -> wire.Claim:
    return wire.Claim(request_id=request_id, block_ids=(1, 2), engine_id="d", worker=wire.Worker.from_core(0, FIRST))


def test_a_kept_client_asks_several_peers_at_once_and_keeps_its_sockets() -> None:
    with scs.SideChannelServer(0, _echo) as a, scs.SideChannelServer(0, _echo) as b:
        client = scc.SideChannelClient(timeout_s=DEADLINE_S, retries=0)
        try:
            targets = [(HOST, a.port), (HOST, b.port), (HOST, a.port)]  # in order, duplicates answered once each
            assert client.exchange_all(targets, _claim("r1")) == [wire.ErrorReply(message="r1")] * 3
            sockets = dict(client._sockets)
            assert len(sockets) == 2
            assert client.exchange_all(targets[:2], _claim("r2")) == [wire.ErrorReply(message="r2")] * 2
            assert client._sockets == sockets  # the same open sockets
        finally:
            client.close()
        assert not client._sockets


def test_a_kept_client_closes_the_least_recently_used_socket_beyond_its_bound() -> None:
    with (
        scs.SideChannelServer(0, _echo) as a,
        scs.SideChannelServer(0, _echo) as b,
        scs.SideChannelServer(0, _echo) as c,
    ):
        client = scc.SideChannelClient(timeout_s=DEADLINE_S, retries=0, max_sockets=2)
        try:
            for server in (a, b, a, c):  # a is used again after b: b is the least recently used when c comes
                assert client.exchange_all([(HOST, server.port)], _claim("r")) == [wire.ErrorReply(message="r")]
            assert list(client._sockets) == [sc.endpoint(HOST, a.port), sc.endpoint(HOST, c.port)]
            assert client.exchange_all([(HOST, b.port)], _claim("r2")) == [wire.ErrorReply(message="r2")]  # reopened
            assert len(client._sockets) == 2
            # One call to more peers than the bound: every one is answered (no socket closed under the call)...
            targets = [(HOST, s.port) for s in (a, b, c)]
            assert client.exchange_all(targets, _claim("r3")) == [wire.ErrorReply(message="r3")] * 3
            # ...and the next call brings the count back to the bound.
            assert client.exchange_all([(HOST, a.port)], _claim("r4")) == [wire.ErrorReply(message="r4")]
            assert len(client._sockets) == 2
        finally:
            client.close()


def test_a_kept_client_never_takes_a_late_answer_for_the_next_message() -> None:
    dead = _free_port()
    with scs.SideChannelServer(0, _echo) as server:
        client = scc.SideChannelClient(timeout_s=0.1, retries=0)
        try:
            started = time.monotonic()
            late, unreachable = client.exchange_all([(HOST, server.port), (HOST, dead)], _claim("slow-1"))
            assert time.monotonic() - started < 0.1 + 1.0  # one timeout for both, not one each
            assert isinstance(late, TransferTimeout) and isinstance(unreachable, PeerGone)
            assert str(dead) in str(unreachable) and "refused" in str(unreachable)
            time.sleep(0.5)  # the late answer to slow-1 has arrived by now (on the dropped socket)
            client.timeout_s = DEADLINE_S
            assert client.exchange_all([(HOST, server.port)], _claim("r2")) == [wire.ErrorReply(message="r2")]
        finally:
            client.close()


def test_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        scc.exchange(HOST, 1, wire.Ack(), timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        scc.exchange(HOST, 1, wire.Ack(), retries=-1)


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (wire.Ack(), ProtocolError, "answered the handshake with Ack"),
        (wire.ErrorReply(message="nope"), ProtocolError, "error: nope"),
        # a server that skips the target check: the client checks too
        (prefill_reply(0, FIRST), IncompatiblePeerError, "worker is 'dp0/pp1/tp1' here but 'dp0/pp0/tp0'"),
    ],
)
def test_client_checks_the_answer(answer: wire.Message, error: type[Exception], match: str) -> None:
    request = decode_request(target=(0, WorkerRank(1, 1)))
    with scs.SideChannelServer(0, lambda m: answer) as server, pytest.raises(error, match=match):
        scc.fetch_handshake(HOST, server.port, request, timeout_s=DEADLINE_S)


def test_server_lifecycle() -> None:
    server = scs.SideChannelServer(0, lambda m: wire.Ack(), poll_interval_s=0.05)
    assert not server.running
    server.close()  # closing what never started is a no-op
    server.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
        taken = scs.SideChannelServer(server.port, lambda m: wire.Ack())
        with pytest.raises(OSError, match="cannot bind"):
            taken.start()
        assert not taken.running
    finally:
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 0.5
    assert not server.running
    server.close()


def test_test_ports_are_free_and_below_the_ephemeral_range():
    """Servers bind their side-channel ports tens of seconds after the pick: a range among the ephemeral ports
    could be taken meanwhile by any port-0 bind (vLLM's own ports), as happened once in CI."""
    from kvbridge.serving.launcher import _ephemeral_low, free_base_port

    for count in (1, 4, 16):
        base = free_base_port(count)
        assert base >= 20000 and base + count <= _ephemeral_low()
        for port in range(base, base + count):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def _held_open(sock: socket.socket, seconds: float) -> bool:
    """True if the server kept `sock` open for `seconds` (a cut connection reads EOF or is reset, after ZMQ's
    greeting, which a server sends as it accepts)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096) == b"":
                return False
        except TimeoutError:
            return True
        except ConnectionResetError:
            return False
    return True


@pytest.mark.parametrize("limit", [4, sc.MAX_CONNECTIONS])
def test_connections_beyond_the_bound_are_cut(limit: int) -> None:
    """A connection flood cannot pin more than `max_connections` x queued frames: connections beyond the bound
    are cut as they are accepted (the oldest that never sent an authenticated frame first, so the last 4 stay),
    and once the flood leaves, peers are served again. Negative control: under the default bound the same 10
    connections are all kept."""
    reply = prefill_reply(0, WorkerRank(0, 0))
    server = scs.SideChannelServer(0, sc.handshake_handler(reply, lambda m: wire.Ack()), HOST, max_connections=limit)
    server.start()
    flood: list[socket.socket] = []
    try:
        for _ in range(10):
            flood.append(socket.create_connection((HOST, server.port), timeout=DEADLINE_S))
            time.sleep(0.02)  # accepted in order: the last `limit` are the ones kept
        kept = [_held_open(sock, 0.3) for sock in flood]
        if limit == 4:
            assert kept == [False] * 6 + [True] * 4, kept
            assert server.connections.cut == 6
        else:
            assert all(kept) and server.connections.cut == 0
        for sock in flood:
            sock.close()
        deadline = time.monotonic() + DEADLINE_S
        while server.connections.open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections.open == 0
        assert_still_serving(server)
    finally:
        for sock in flood:
            sock.close()
        server.close()


def test_the_connection_bound_cuts_from_the_address_holding_the_most() -> None:
    bound = ConnectionBound(limit=4, per_address=3)
    assert [bound.accepted(fd, "a") for fd in (10, 11, 12)] == [[], [], []]
    assert bound.accepted(13, "a") == [10]  # a 4th from one address: over its bound, its oldest goes
    assert bound.accepted(14, "b") == []
    assert bound.accepted(15, "c") == [11]  # 5 open > 4: the oldest of the address holding the most
    bound.closed(11)  # the cut one's close, reported later: already not counted
    assert bound.open == 4 and bound.cut == 2
    bound.closed(12)
    assert bound.accepted(16, "d") == [] and bound.open == 5 - 1
    for fd in (10, 14, 15, 16, 13):
        bound.closed(fd)
    assert bound.open == 0


def test_the_connection_bound_cuts_authenticated_connections_last() -> None:
    """Idle unauthenticated connections from a key holder's own address. The oldest connection that
    never sent an authenticated frame is cut, never a key holder's while another is left; when all are
    authenticated the new one is cut. Negative control: without `authenticated` the key holder's oldest goes."""
    for trust in (True, False):
        bound = ConnectionBound(limit=100, per_address=3)
        assert bound.accepted(10, "a") == []  # the key holder
        if trust:
            bound.authenticated(10)
        assert [bound.accepted(fd, "a") for fd in (11, 12)] == [[], []]  # idle ones
        assert bound.accepted(13, "a") == ([11] if trust else [10])
        assert bound.accepted(14, "a") == ([12] if trust else [11])
    bound = ConnectionBound(limit=100, per_address=2)
    for fd in (1, 2):
        bound.accepted(fd, "a")
        bound.authenticated(fd)
    assert bound.accepted(3, "a") == [3]
    bound.authenticated(99)  # an fd that is not open is not remembered
    bound.accepted(99, "b")
    bound.accepted(100, "b")
    assert bound.accepted(101, "b") == [99]


def test_work_while_waiting_runs_once_after_the_send_and_overlaps_the_round_trip() -> None:
    """What the decode's claim does while the claim is on the wire (the CUDA IPC path checks its block ids): run
    once, after the request left (the server answers while it runs), before the answer is taken."""
    with scs.SideChannelServer(0, _echo) as server:
        client = scc.SideChannelClient(timeout_s=DEADLINE_S, retries=0)
        try:
            ran: list[float] = []

            def work() -> None:
                time.sleep(0.3)  # longer than the round trip: the answer is already waiting when it ends
                ran.append(time.monotonic())

            t0 = time.monotonic()
            answer = client.exchange_all([(HOST, server.port)], _claim("r"), while_waiting=work)
            took = time.monotonic() - t0
            assert answer == [wire.ErrorReply(message="r")] and len(ran) == 1
            assert took < 0.3 + 0.2  # the round trip ran beside the work, not after it
        finally:
            client.close()


def test_no_link_timeout_to_an_address_of_this_host() -> None:
    """A connect to this host is answered by its own kernel: a late one means this process was starved, not that a
    link went down, so link_timeout_s sets no CONNECT_TIMEOUT or TCP_MAXRT there (a starved ZMQ I/O thread would
    otherwise find its connect timer expired and make a live local prefill unreachable). Other hosts keep them, and
    a refusal there stays a refusal: tests/nixl/test_unreachable_host.py."""
    for host in ("127.0.0.1", "127.0.0.2", "[::1]", "::ffff:127.0.0.1", "localhost", "LOCALHOST", "localhost."):
        assert on_this_host(host), host
    for address in _interface_addresses():
        assert on_this_host(address) and on_this_host(f"[{address}]"), address
    for host in ("10.77.0.2", "192.0.2.77", "fd12:3456::9", "prefill.example"):  # none here; names unresolved
        assert not on_this_host(host), host
    assert "127.0.0.1" in _interface_addresses(), "the interfaces were read (lo at least)"
    sock, watch = scc._dealer(f"tcp://{HOST}:9", 1000, link_timeout_s=0.5)
    try:
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == 0 and sock.getsockopt(zmq.TCP_MAXRT) == 0
        assert watch.connect_timeout_s == 0
    finally:
        watch.close()
        sock.close(linger=0)


@pytest.mark.parametrize("this_host", [True, False])
def test_the_link_timeout_is_set_only_on_sockets_to_another_host(monkeypatch, this_host) -> None:
    """The same address taken for this host's gets no CONNECT_TIMEOUT or TCP_MAXRT; taken for another host's (the
    control) it gets link_timeout_s as both."""
    monkeypatch.setattr(scc, "on_this_host", lambda host: this_host)
    sock, watch = scc._dealer(f"tcp://{HOST}:9", 1000, link_timeout_s=0.5)
    try:
        want = 0 if this_host else 500
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == want and sock.getsockopt(zmq.TCP_MAXRT) == want
        assert watch.connect_timeout_s == want / 1000
    finally:
        watch.close()
        sock.close(linger=0)
