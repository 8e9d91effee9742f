"""The decode side of kvbridge's KV channel (`runtime.stream_reads`) against a real `KvStreamServer` on loopback, no
NIXL: loads arrive exact over several connections and reuse them, a refused read fails its load naming why, a
server that stops mid-part fails the load only once none of its connections can still scatter, and one that goes
silent mid-load fails it after `kv_stream_stall_s` while a slow but live one still loads."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvbridge.runtime import stream_reads
from kvbridge.runtime.peers import Engine
from kvbridge.runtime.stream_server import KvStreamServer
from kvbridge.transport.kv_stream import stream_key
from support.stream_reader import BLOCKS, KEY, Reader, Side, SilentAfter


@pytest.fixture
def served():
    src = Side(5)
    server = KvStreamServer(src.memory, stream_key(KEY), lambda r: 1e18).start()
    try:
        yield server, src
    finally:
        server.close()


@pytest.mark.parametrize("connections", [1, 3])
def test_loads_arrive_exact_and_reuse_their_connections(served, connections):
    server, src = served
    reader = Reader(server.port, src, kv_stream_connections=connections)
    rng = np.random.default_rng(1)
    try:
        for i in range(4):
            src, dst = rng.permutation(BLOCKS)[:40].tolist(), rng.permutation(BLOCKS)[:40].tolist()
            assert reader.load(f"r{i}", src, dst) == ""
            for s, d in zip(src, dst, strict=True):
                assert np.array_equal(reader.dst.block(d), reader.src.block(s))
        assert server.counts["connections"] == connections, "connections are pooled between loads"
        assert server.counts["parts"] == 4 * connections
    finally:
        reader.reads.close()


def test_a_refused_read_fails_its_load_naming_why():
    src = Side(5)
    server = KvStreamServer(src.memory, stream_key(KEY), lambda r: None).start()
    reader = Reader(server.port, src)
    try:
        error = reader.load("r", [1, 2, 3], [4, 5, 6])
        assert "not_claimed" in error
        assert not reader.dst.buf.any(), "a refused read wrote nothing"
    finally:
        reader.reads.close()
        server.close()


def test_a_server_that_stops_mid_part_fails_the_load_after_its_last_scatter():
    """The server answers the first chunks, then hangs (its claim check blocks) and is closed: the load fails, and
    nothing is scattered after the report (the reader's connections are shut when the first one fails)."""
    src = Side(5)
    gate = threading.Event()
    calls = []

    def grant(request):
        calls.append(request)
        if len(calls) > 3:
            gate.wait(10)
        return 1e18

    server = KvStreamServer(src.memory, stream_key(KEY), grant).start()
    reader = Reader(server.port, src, kv_stream_connections=2)
    try:
        result = {}
        t = threading.Thread(
            target=lambda: result.setdefault("e", reader.load("r", list(range(100)), list(range(100)), 20))
        )
        t.start()
        deadline = time.monotonic() + 10
        while len(calls) <= 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        threading.Timer(0.3, gate.set).start()  # the hung claim check returns into a shut connection
        server.close()  # shuts every connection
        t.join(20)
        assert result["e"].startswith("kv stream from prefill worker"), result
        time.sleep(0.3)
        after = reader.dst.buf.copy()
        time.sleep(0.5)
        assert np.array_equal(reader.dst.buf, after), "a block was written after the load was reported failed"
    finally:
        gate.set()
        reader.reads.close()
        server.close()


@pytest.mark.parametrize("stall_s", [0.5, 30.0])
def test_a_server_silent_mid_load_fails_it_after_kv_stream_stall_s(stall_s):
    """A server that stops sending after two chunks: with kv_stream_stall_s 0.5 the load fails within the stall
    bound plus a margin, far from its 20 s deadline, naming the stall; the blocks written so far are not reported
    loaded and nothing is written after the report. The control (30 s): the same load is still waiting after twice
    0.5 s, and once the server answers again it loads exact."""
    silent = SilentAfter(after=3)
    reader = Reader(silent.server.port, silent.src, kv_stream_connections=2, kv_stream_stall_s=stall_s)
    blocks = list(range(100))
    try:
        reader.launch("r", blocks, blocks, deadline_s=20.0)
        assert _wait(lambda: silent.silent_at, 10), "the server went silent"
        if stall_s > 1:  # the control: no stall bound to speak of
            assert not reader.event.wait(2 * 0.5), "still waiting"
            assert reader.dst.buf.any(), "mid-load: some chunks arrived"
            silent.gate.set()
            assert reader.event.wait(10)
            assert reader.done["r"] == ""
            assert all(np.array_equal(reader.dst.block(b), silent.src.block(b)) for b in blocks)
            return
        assert reader.event.wait(10)
        took = reader.reported_at - silent.silent_at
        assert took < stall_s + 1.0, f"failed {took:.2f} s after the server went silent"
        error = reader.done["r"]
        assert f"no byte from 127.0.0.1:{silent.server.port} for 0.5 s (kv_stream_stall_s)" in error, error
        assert reader.reads.parts == 0, "not reported loaded"
        assert reader.dst.buf.any(), "mid-load: some chunks had arrived"
        assert not all(np.array_equal(reader.dst.block(b), silent.src.block(b)) for b in blocks)
        assert silent.resume_leaves(reader), "a block was written after the load was reported failed"
    finally:
        silent.close()
        reader.reads.close()


def test_a_silent_server_still_fails_at_the_loads_deadline_when_that_comes_first():
    """kv_stream_stall_s 30 and a deadline 1 s away: the load's deadline ends it, and the error says so."""
    silent = SilentAfter(after=3)
    reader = Reader(silent.server.port, silent.src, kv_stream_connections=1, kv_stream_stall_s=30.0)
    try:
        reader.launch("r", list(range(100)), list(range(100)), deadline_s=1.0)
        assert reader.event.wait(10)
        error = reader.done["r"]
        assert "the load's deadline passed" in error and "kv_stream_stall_s" not in error, error
        assert reader.reads.parts == 0
    finally:
        silent.close()
        reader.reads.close()


def test_a_slow_live_server_loads_exact_past_kv_stream_stall_s():
    """kv_stream_stall_s bounds the wait for the next byte, not the load: a server that answers each chunk after
    0.3 s (stall 1.0 s) takes longer than the stall bound in all and still loads exact."""
    src = Side(5)

    def still(request) -> bool:
        time.sleep(0.3)
        return True

    server = KvStreamServer(src.memory, stream_key(KEY), lambda r: 1e18, still=still).start()
    reader = Reader(server.port, src, kv_stream_connections=1, kv_stream_stall_s=1.0)
    blocks = list(range(100))
    try:
        began = time.monotonic()
        assert reader.load("r", blocks, blocks[::-1], timeout_s=20) == ""
        assert reader.reported_at - began > 1.0, "the load outlasted the stall bound"
        for s, d in zip(blocks, blocks[::-1], strict=True):
            assert np.array_equal(reader.dst.block(d), src.block(s))
    finally:
        reader.reads.close()
        server.close()


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("limit", ["max_connections", "max_per_address"])
def test_a_full_server_evicts_its_least_recently_used_idle_connection(limit):
    """Limit 2, two idle pooled connections of one reader: a second reader's load still succeeds, cutting the
    least recently used idle connection (and a connection that never proved the key goes before either)."""
    src = Side(5)
    both_open = threading.Event()  # the server answers no read before the reader has opened both connections
    server = KvStreamServer(src.memory, stream_key(KEY), lambda r: both_open.wait(10) and 1e18, **{limit: 2})
    server.start()
    first = Reader(server.port, src, kv_stream_connections=2)
    second = Reader(server.port, src, kv_stream_connections=1)
    loaded = []
    reading = threading.Thread(target=lambda: loaded.append(first.load("a", list(range(40)), list(range(40, 80)))))
    try:
        reading.start()  # its chunks over both connections: neither is answered (and pooled) before both are open
        assert _wait(lambda: server.open_connections == 2)
        both_open.set()
        reading.join(10)
        assert loaded == [""]
        assert _wait(lambda: not any(c.busy for c in server._conns)), "both answered their StreamEnd"
        stranger = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # never proves the key
        assert _wait(lambda: server.counts["connections"] == 3)
        assert second.load("b", [7, 8], [9, 10]) == "", server.counts
        assert np.array_equal(second.dst.block(9), src.block(7))
        assert server.counts["evicted"] == 1 and server.counts["cut"] == 0
        assert stranger.recv(1) == b"", "the unauthenticated connection went first"
        stranger.close()
    finally:
        both_open.set()
        reading.join(10)
        first.reads.close()
        second.reads.close()
        server.close()


def test_a_full_server_of_busy_connections_cuts_the_new_one():
    """The control: when no connection is idle, nothing is evicted and the new connection is cut."""
    src = Side(5)
    gate = threading.Event()
    server = KvStreamServer(src.memory, stream_key(KEY), lambda r: gate.wait(10) and 1e18, max_connections=1)
    server.start()
    first = Reader(server.port, src, kv_stream_connections=1)
    second = Reader(server.port, src, kv_stream_connections=1)
    try:
        t = threading.Thread(target=first.load, args=("a", [1], [2]))
        t.start()
        assert _wait(lambda: any(c.busy for c in server._conns)), "its request is read: busy"
        assert second.load("b", [3], [4]) != ""
        assert server.counts["cut"] == 1 and server.counts["evicted"] == 0
        gate.set()
        t.join(10)
        assert first.done["a"] == ""
    finally:
        gate.set()
        first.reads.close()
        second.reads.close()
        server.close()


def test_idle_connections_are_closed_by_the_reader_after_its_idle_limit(served, monkeypatch):
    server, src = served
    monkeypatch.setattr(stream_reads, "IDLE_CLOSE_S", 0.2)
    reader = Reader(server.port, src, kv_stream_connections=1)
    try:
        assert reader.load("a", [1], [2]) == ""
        assert reader.load("b", [1], [2]) == ""
        assert server.counts["connections"] == 1, "the control: reused within the limit"
        time.sleep(0.3)
        assert reader.load("c", [1], [2]) == ""
        assert server.counts["connections"] == 2, "the idle one was closed, a fresh one opened"
        assert _wait(lambda: server.open_connections == 1)
    finally:
        reader.reads.close()


def test_the_blocks_are_checked_once_per_part_and_the_claim_before_every_chunk():
    """`authorize` (which compares the blocks) runs once per part, `still` (constant cost) before every chunk; a
    claim gone mid-part stops it (the control: a claim that stays lets every chunk through)."""
    src = Side(5)
    asked: list[str] = []
    stop_after = {"n": 10**9}

    def still(request):
        asked.append("still")
        return asked.count("still") <= stop_after["n"]

    def grant(request):
        asked.append("grant")
        return 1e18

    server = KvStreamServer(src.memory, stream_key(KEY), grant, still=still).start()
    reader = Reader(server.port, src, kv_stream_connections=1)
    try:
        assert reader.load("a", list(range(100)), list(range(100))) == ""
        assert asked.count("grant") == 1 and asked.count("still") > 3
        asked.clear()
        stop_after["n"] = 2
        error = reader.load("b", list(range(100)), list(range(100)))
        assert "not_claimed" in error and asked.count("still") == 3
    finally:
        reader.reads.close()
        server.close()


def test_a_chunk_below_64_kib_is_refused_at_decode():
    from kvbridge.core.errors import ProtocolError
    from kvbridge.wire import messages as wire
    from kvbridge.wire import stream_messages as sm

    fields = {"request_id": "r", "engine_id": "e", "worker": wire.Worker()}
    assert sm.decode(sm.encode(sm.StreamRead(**fields, chunk_bytes=1 << 16))).chunk_bytes == 1 << 16  # control
    with pytest.raises(ProtocolError):
        sm.decode(sm.encode(sm.StreamRead(**fields, chunk_bytes=1)))


def test_a_load_launched_after_close_is_reported_failed_not_raised(served):
    server, src = served
    reader = Reader(server.port, src, kv_stream_connections=3)
    assert reader.load("a", list(range(40)), list(range(40))) == ""  # the control: open, it loads
    assert reader.reads.bytes == 40 * src.block(0).nbytes, "every scattered byte counted once"
    reader.reads.close()
    error = reader.load("b", list(range(40)), list(range(40)))
    assert "shutdown" in error or "kv stream reads" in error, error


@pytest.mark.parametrize("whose", ["its engine", "another engine"])
def test_cutting_an_engine_fails_its_loads_in_flight_at_once(whose):
    """A load in flight from a server gone silent (stall bound 30 s): `cut` of its engine (known dead, or its host
    unreachable) fails it within a fraction of a second, naming why, and nothing lands after the report. The
    control: cutting another engine leaves it waiting, and once the server sends again it loads exact."""
    silent = SilentAfter(after=3)
    reader = Reader(silent.server.port, silent.src, kv_stream_connections=2, kv_stream_stall_s=30.0)
    blocks = list(range(100))
    try:
        reader.launch("r", blocks, blocks, deadline_s=20.0)
        assert _wait(lambda: silent.silent_at, 10), "the server went silent"
        other = Engine(("q", "127.0.0.1", 2, 0), reader.engine.layout, reader.engine.peers, reader.engine.plan)
        cut_at = time.monotonic()
        reader.reads.cut((reader.engine if whose == "its engine" else other).key, "its host is unreachable")
        if whose == "another engine":
            assert not reader.event.wait(1.0), "a load of another engine was cut"
            silent.gate.set()
            assert reader.event.wait(10)
            assert reader.done["r"] == ""
            assert all(np.array_equal(reader.dst.block(b), silent.src.block(b)) for b in blocks)
            return
        assert reader.event.wait(5)
        assert reader.reported_at - cut_at < 0.5, f"failed {reader.reported_at - cut_at:.2f} s after the cut"
        assert "prefill engine p is down: its host is unreachable" in reader.done["r"], reader.done["r"]
        assert reader.reads.parts == 0, "not reported loaded"
        assert silent.resume_leaves(reader), "a block was written after the load was reported failed"
    finally:
        silent.close()
        reader.reads.close()


@pytest.mark.parametrize("this_host", [True, False])
def test_the_link_timeout_is_set_only_on_connections_to_another_host(served, monkeypatch, this_host):
    """A connection to an address of this host gets no TCP_USER_TIMEOUT (its kernel answers; a late ack means a
    starved process, not a lost link); the control: the same address taken for another host's gets link_timeout_s."""
    server, src = served
    monkeypatch.setattr(stream_reads, "on_this_host", lambda host: this_host)
    reader = Reader(server.port, src, link_timeout_s=0.5)
    try:
        assert reader.load("r", [1, 2], [3, 4]) == ""
        [(conn, _)] = [pair for idle in reader.reads._idle.values() for pair in idle]
        user_timeout = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert user_timeout == (0 if this_host else 500)
    finally:
        reader.reads.close()
