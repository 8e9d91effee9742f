"""Whether a side-channel peer's process is still there, as ZMQ's socket monitor sees its connection.

ZMQ hides TCP from its sockets: a DEALER connected to a port nobody listens on queues the message and reconnects
forever, so a client without this waits out its whole deadline for a peer whose kernel refused it in microseconds.
A `PeerWatch` reads the monitor events of one client socket:

    connect refused (CLOSED or CONNECT_RETRIED, no CONNECTED since `clear`)  -> "refused": nobody listens there
    DISCONNECTED                                                             -> "reset": the connection was cut

A refusal is final (the caller fails at once). A reset is also what a live server does to a connection it cuts
(a flood bound, an oversized frame), so the caller retries once on a fresh socket, and that connect is refused
at once if the process is gone. A silent peer (stopped, or its link down) shows neither: only the caller's answer
deadline ends the wait.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED

REFUSED = "refused"
RESET = "reset"


class PeerWatch:
    """The monitor of one client socket (same thread as the socket; closed with it, before it)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self._connected = False

    def clear(self) -> None:
        """Forget events so far (before a new message on a kept socket: an old reset was already reconnected)."""
        self._events()
        self._connected = False

    def verdict(self) -> str | None:
        """REFUSED, RESET, or None (nothing says the peer is gone) from the events since `clear`."""
        gone = None
        for event in self._events():
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                gone = RESET
                self._connected = False
            elif not self._connected and gone is None:  # a connect that failed
                gone = REFUSED
        return gone

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)

    def _events(self) -> list[int]:
        events = []
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            except zmq.ZMQError:  # the monitor was closed
                return events
            events.append(parse_monitor_message(frames)["event"])
