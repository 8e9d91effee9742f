"""Freshness without synchronized clocks: a host whose clock is off by more than the window works after one extra
round trip (the server's "stale" answer carries its clock), and a request still refused raises an error naming
the measured difference; never a silent timeout."""

from __future__ import annotations

import itertools
import logging
import time

import pytest

from kvbridge.wire import messages as wire
from kvbridge.wire import side_channel_server
from kvbridge.wire.auth import ClockSkew, Sealer, destination
from kvbridge.wire.side_channel_client import SideChannelClient, exchange
from kvbridge.wire.side_channel_server import SideChannelServer

KEY = b"clock-test-deployment-key-0123456789"
DEST = destination(5600, "p")
ACK = wire.Ack(request_id="ok")


def test_a_stale_answer_names_the_servers_clock_and_the_next_request_is_timed_by_it():
    client, server = Sealer(KEY, clock=lambda: 1000.0), Sealer(KEY, clock=lambda: 1120.0, window_s=30)
    frame, ticket = client.seal_request(b"x", DEST)
    body, ticket_seen = server.open_request(frame, DEST)
    assert body is None and ticket_seen == ticket
    with pytest.raises(ClockSkew, match=r"\+120\.0 s") as err:
        client.open_answer(server.seal_stale(ticket), ticket, DEST)
    assert err.value.skew_s == pytest.approx(120.0)
    frame, _ = client.seal_request(b"x", DEST)  # timed by the server's clock now
    assert server.open_request(frame, DEST)[0] == b"x"
    other = destination(5601, "q")  # another destination keeps its own (no) offset
    assert server.open_request(client.seal_request(b"y", other)[0], other)[0] is None


def test_a_stale_answer_cannot_be_forged_or_taken_for_another_request():
    client, server = Sealer(KEY, clock=lambda: 1000.0), Sealer(KEY, clock=lambda: 1120.0)
    _, ticket = client.seal_request(b"x", DEST)
    _, other_ticket = client.seal_request(b"y", DEST)
    stale = server.seal_stale(other_ticket)
    assert client.open_answer(stale, ticket, DEST) is None  # another request's
    forged = Sealer(b"another-deployment-key-0123456789abcd", clock=lambda: 5000.0)
    assert client.open_answer(forged.seal_stale(forged.seal_request(b"", DEST)[1]), ticket, DEST) is None
    assert DEST not in client.offsets and not client.offsets


@pytest.fixture
def skewed_server():
    """A keyed server whose clock is 120 s ahead of this host's (window 30 s)."""
    server = SideChannelServer(0, lambda m: ACK, sealer=Sealer(KEY, clock=lambda: time.time() + 120.0))
    server.start()
    yield server
    server.close()


def test_a_host_with_a_skewed_clock_works_and_is_told_so(skewed_server, caplog):
    """Real sockets: `exchange` and a kept client both get their answer from a server 120 s ahead, and the log
    names the difference."""
    with caplog.at_level(logging.WARNING, logger="kvbridge.wire.side_channel"):
        port = skewed_server.port
        assert exchange("127.0.0.1", port, wire.Ack(), timeout_s=2, retries=0, sealer=Sealer(KEY)) == ACK
        kept = SideChannelClient(timeout_s=2, retries=0, sealer=Sealer(KEY))
        try:
            assert kept.exchange_all([("127.0.0.1", skewed_server.port)], wire.Ack()) == [ACK]
            assert kept.exchange_all([("127.0.0.1", skewed_server.port)], wire.Ack()) == [ACK]  # no stale round
        finally:
            kept.close()
    assert skewed_server.sealer.dropped["stale"] == 2
    assert any("clock differs from this host's by +120" in r.getMessage() for r in caplog.records)


def test_negative_control_without_the_stale_answer_a_skewed_host_times_out_silently(skewed_server, monkeypatch):
    """What the stale answer prevents: a server that drops a stale request unanswered (the former behaviour)
    leaves its peer with nothing but a timeout that says nothing of clocks."""
    monkeypatch.setattr(Sealer, "seal_stale", lambda self, ticket: None)
    real = side_channel_server._answer_frames

    def drop_stale(frames, handler, sealer=None, dest=0):
        answer = real(frames, handler, sealer, dest)
        return None if answer is not None and answer[-1] is None else answer

    monkeypatch.setattr(side_channel_server, "_answer_frames", drop_stale)
    with pytest.raises(Exception, match="no answer") as err:
        exchange("127.0.0.1", skewed_server.port, wire.Ack(), timeout_s=0.5, retries=0, sealer=Sealer(KEY))
    assert "clock" not in str(err.value)


def test_a_request_still_stale_by_the_peers_clock_raises_an_error_naming_the_skew():
    """A server whose clock jumps 1000 s ahead at every reading: the corrected attempt is stale again, and the
    client raises ClockSkew naming the difference (not a timeout)."""
    jumps = itertools.count(1)
    server = SideChannelServer(0, lambda m: ACK, sealer=Sealer(KEY, clock=lambda: time.time() + 1000.0 * next(jumps)))
    server.start()
    try:
        with pytest.raises(ClockSkew, match="clock differs from this host's by"):
            exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2, retries=2, sealer=Sealer(KEY))
        kept = SideChannelClient(timeout_s=2, retries=0, sealer=Sealer(KEY))
        try:
            (answer,) = kept.exchange_all([("127.0.0.1", server.port)], wire.Ack())
        finally:
            kept.close()
        assert isinstance(answer, ClockSkew)
    finally:
        server.close()
