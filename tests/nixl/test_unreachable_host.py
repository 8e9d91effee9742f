"""A prefill host cut off (its link down) is known from TCP within `link_timeout_s`, not from answer deadlines.

A side-channel server runs on a test host (a network namespace, `support.hosts`); the client, in the root
namespace, first gets an answer over a kept socket, then the host's link goes down:

- with link_timeout_s 0.5, a message fails with HostUnreachable in about twice that: over the kept socket ZMQ's
  TCP_MAXRT aborts the connection whose bytes go unacknowledged, then the fresh connect is not answered; on a
  fresh socket, two connects are not answered. The control, link_timeout_s 0, waits out its two answer deadlines
  and fails with a plain TransferTimeout;
- a port nobody listens on, on a host that is up, is still a gone process (PeerGone at once), not an unreachable
  host: the connect failed long before link_timeout_s;
- a stopped server process (SIGSTOP) on a host that is up is not taken for an unreachable host: its kernel accepts
  and acknowledges, so only the answer deadline ends the wait (TransferTimeout, not HostUnreachable);
- on the KV channel (`runtime.stream_reads`), a load from a host cut off fails after two connects of link_timeout_s
  and reports the engine unreachable (the control, 0, waits out the connect's deadline and reports nothing), and
  a connect in progress ends as soon as its engine is cut.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvbridge.core.errors import HostUnreachable, PeerGone, TransferTimeout
from kvbridge.core.topology import WorkerRank
from kvbridge.wire import messages as wire
from kvbridge.wire import side_channel_client as scc
from support import stopping
from support.hosts import Host, network_hosts
from support.stream_reader import Reader, Side

pytestmark = pytest.mark.nixl

PORT = 5600
SERVER = """
import sys, threading
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel_server import SideChannelServer
server = SideChannelServer(int(sys.argv[2]), lambda m: wire.ErrorReply(message=m.request_id), sys.argv[1])
server.start()
print("serving", flush=True)
threading.Event().wait()
"""


@contextmanager
def served_on(host: Host) -> Iterator[subprocess.Popen]:
    """An answering side-channel server on `host` (its own process in the host's namespace)."""
    cmd = ["ip", "netns", "exec", host.netns, sys.executable, "-c", SERVER, host.ip, str(PORT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "serving"
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def claim(request_id: str) -> wire.Claim:
    return wire.Claim(request_id=request_id, block_ids=(1,), engine_id="d", worker=wire.Worker.from_core(0, RANK))


RANK = WorkerRank(0, 0)


def timed(call) -> tuple[object, float]:
    started = time.monotonic()
    try:
        result = call()
    except Exception as exc:
        result = exc
    return result, time.monotonic() - started


@pytest.mark.parametrize("link_timeout_s", [0.5, 0.0])
def test_a_host_whose_link_went_down_is_known_within_twice_link_timeout_s(link_timeout_s):
    with network_hosts("prefill") as hosts, served_on(hosts["prefill"]):
        host = hosts["prefill"]
        target = [(host.ip, PORT)]
        client = scc.SideChannelClient(timeout_s=1.0, retries=1, link_timeout_s=link_timeout_s)
        try:
            assert client.exchange_all(target, claim("before")) == [wire.ErrorReply(message="before")]
            subprocess.run(["ip", "link", "set", host.link, "down"], check=True)
            kept, kept_s = timed(lambda: client.exchange_all(target, claim("kept"))[0])
            fresh, fresh_s = timed(
                lambda: scc.exchange(
                    host.ip, PORT, claim("fresh"), timeout_s=1.0, retries=1, link_timeout_s=link_timeout_s
                )
            )
        finally:
            client.close()
        print(f"link_timeout_s {link_timeout_s}: kept socket {kept_s:.2f} s ({kept!r}), fresh {fresh_s:.2f} s")
        if link_timeout_s:
            assert isinstance(kept, HostUnreachable) and isinstance(fresh, HostUnreachable), (kept, fresh)
            assert "link_timeout_s" in str(kept) and "its host or the link to it is down" in str(kept)
            assert kept_s < 2 * link_timeout_s + 0.7, kept_s
            assert fresh_s < 2 * link_timeout_s + 0.4, fresh_s
        else:  # the control: the answer deadlines alone
            assert type(kept) is TransferTimeout and "2 attempts of 1 s" in str(kept), kept
            assert kept_s >= 1.9, kept_s


def test_a_refused_connect_stays_a_refusal_with_a_link_timeout():
    with network_hosts("prefill") as hosts:
        host = hosts["prefill"]
        client = scc.SideChannelClient(timeout_s=2.0, retries=1, link_timeout_s=0.5)
        try:
            kept, kept_s = timed(lambda: client.exchange_all([(host.ip, PORT)], wire.Ack())[0])
        finally:
            client.close()
        fresh, fresh_s = timed(
            lambda: scc.exchange(host.ip, PORT, wire.Ack(), timeout_s=2.0, retries=1, link_timeout_s=0.5)
        )
    for error, took in ((kept, kept_s), (fresh, fresh_s)):
        assert type(error) is PeerGone, error
        assert took < 0.2, took


def test_a_stopped_server_on_a_host_that_is_up_is_not_taken_for_an_unreachable_one():
    with network_hosts("prefill") as hosts, served_on(hosts["prefill"]) as server:
        host = hosts["prefill"]
        target = [(host.ip, PORT)]
        client = scc.SideChannelClient(timeout_s=1.0, retries=1, link_timeout_s=0.5)
        try:
            assert client.exchange_all(target, claim("before")) == [wire.ErrorReply(message="before")]
            stopping.stop(server.pid)
            kept, kept_s = timed(lambda: client.exchange_all(target, claim("stopped"))[0])
            fresh, fresh_s = timed(
                lambda: scc.exchange(host.ip, PORT, claim("fresh"), timeout_s=1.0, retries=1, link_timeout_s=0.5)
            )
        finally:
            server.send_signal(signal.SIGCONT)
            client.close()
        print(f"stopped server: kept socket {kept_s:.2f} s ({kept!r}), fresh {fresh_s:.2f} s ({fresh!r})")
        for error, took in ((kept, kept_s), (fresh, fresh_s)):
            assert type(error) is TransferTimeout and "2 attempts of 1 s" in str(error), error
            assert took >= 1.9, took


@pytest.mark.parametrize("link_timeout_s", [0.5, 0.0])
def test_a_prefill_host_cut_off_fails_the_load_after_two_connects_and_is_reported_unreachable(link_timeout_s):
    """The prefill's host is a test host whose link is down (`support.hosts`): the KV channel's connect gets no
    answer. With link_timeout_s 0.5 the load fails after two connects of that (one lost SYN is no verdict), naming
    it, and the engine is reported unreachable (the decode worker then knows it dead and cuts its other loads); the
    control, 0, waits out the connect's answer deadline (handshake_timeout_s, 1 s) and reports nothing
    unreachable."""
    with network_hosts("prefill") as hosts:
        host = hosts["prefill"]
        subprocess.run(["ip", "link", "set", host.link, "down"], check=True)
        reader = Reader(5700, Side(5), link_timeout_s=link_timeout_s)
        try:
            started = time.monotonic()
            reader.launch("r", [1, 2], [1, 2], host=host.ip)
            assert reader.event.wait(5)
            took, error = reader.reported_at - started, reader.done["r"]
        finally:
            reader.reads.close()
    if link_timeout_s:
        assert took < 2 * link_timeout_s + 0.3, took
        assert f"no connection to {host.ip}:5700 in 2 connects of 0.5 s (link_timeout_s)" in error, error
        assert [engine for engine, _ in reader.unreachable] == [reader.engine]
    else:
        assert took >= 0.9 and "link_timeout_s" not in error, (took, error)
        assert not reader.unreachable


def test_a_connect_in_progress_is_given_up_when_its_engine_is_cut():
    """A load whose KV channel connect waits on a cut-off host (connect deadline 3 s): `cut` of its engine ends it
    within a fraction of a second, not at the connect's deadline."""
    with network_hosts("prefill") as hosts:
        host = hosts["prefill"]
        subprocess.run(["ip", "link", "set", host.link, "down"], check=True)
        reader = Reader(5700, Side(5), link_timeout_s=0.0, handshake_timeout_s=3.0)
        try:
            reader.launch("r", [1, 2], [1, 2], host=host.ip)
            assert not reader.event.wait(0.3), "the connect waits"
            cut_at = time.monotonic()
            reader.reads.cut(reader.engine.key, "its host is unreachable")
            assert reader.event.wait(5)
        finally:
            reader.reads.close()
    assert reader.reported_at - cut_at < 0.2, reader.reported_at - cut_at
    assert "prefill engine p is down: its host is unreachable" in reader.done["r"], reader.done["r"]
