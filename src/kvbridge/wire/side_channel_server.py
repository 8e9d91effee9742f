"""The server end of the side channel: `SideChannelServer`, a prefill worker's ROUTER socket served by a daemon
thread, and `_answer_frames`, which unseals a received frame, answers it with `side_channel.respond` and frames
(and seals) the answer. Its connections are bounded by `side_channel_connections.ConnectionBound`; ports, bounds
and the protocol are in `side_channel`, the client end in `side_channel_client`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread, zmq_context
from kvbridge.wire.auth import Sealer, destination
from kvbridge.wire.later import Later
from kvbridge.wire.side_channel import (
    DEFAULT_HOST,
    DROP_WARNING_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    MAX_REQUEST_BYTES,
    NO_IDENTITY,
    QUEUED_PER_PEER,
    Handler,
    Identity,
    endpoint,
    respond,
)
from kvbridge.wire.side_channel_connections import ConnectionBound, cut_connection, peer_address

logger = logging.getLogger(__name__)


def _answer_frames(
    frames: list[bytes], handler: Handler, sealer: Sealer | None = None, dest: bytes | int = 0
) -> list[bytes] | tuple[Later, Callable[[bytes], list[bytes]]] | None:
    """The frames a ROUTER sends back for received `frames` (identity, [empty delimiter], body); None: send
    nothing (with a key: the frame is not authentic, or a replay; `sealer.dropped` counts why). A handler's `Later`
    comes back with what makes its frames from its encoded answer (the envelope, sealed for the same request)."""
    # A REQ peer (or a DEALER imitating one) puts an empty delimiter after its identity; a DEALER need not.
    split = 2 if len(frames) >= 3 and frames[1] == b"" else 1
    envelope, body = frames[:split], frames[split:]
    if sealer is not None:
        opened = sealer.open_request(body[0], dest) if len(body) == 1 else None
        if opened is None:
            if len(body) != 1:
                sealer.dropped["unauthenticated"] += 1
            return None
        data, ticket = opened
        if data is None:  # authentic but outside the window: tell its sender our clock, nothing else
            return [*envelope, sealer.seal_stale(ticket)]

        def framed(answer: bytes) -> list[bytes]:
            return [*envelope, sealer.seal_answer(answer, ticket)]

    else:
        if len(body) != 1:
            error = wire.ErrorReply(message=f"expected one message frame, got {len(body)}")
            return [*envelope, wire.encode(error)]
        data = body[0]

        def framed(answer: bytes) -> list[bytes]:
            return [*envelope, answer]

    answer = respond(data, handler)
    return (answer, framed) if isinstance(answer, Later) else framed(answer)


class SideChannelServer:
    """A prefill worker's side channel: a ROUTER socket on (host, port), served by a daemon thread.

    The constructor only stores values; `start()` binds (OSError if the address is taken) and starts the
    thread; `close()` stops it and closes the socket. Messages are answered one at a time by `handler`, on the
    server's thread. Port 0 binds a free port, readable from `port` after `start()`.
    """

    def __init__(
        self,
        port: int,
        handler: Handler,
        host: str = DEFAULT_HOST,
        *,
        poll_interval_s: float = 0.05,
        max_message_bytes: int = MAX_REQUEST_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
        queued_frames: int = QUEUED_PER_PEER,
        sealer: Sealer | None = None,
        identity: Identity = NO_IDENTITY,
    ) -> None:
        """`sealer`: authenticate and encrypt every frame with the deployment key (None: frames are bare msgpack);
        `identity`: the worker this server is, which every sealed request must be addressed to (with its port).
        The bounds: `max_message_bytes` per frame, `queued_frames` queued per connection each way, connections."""
        if max_connections < 1 or max_connections_per_address < 1:
            raise ValueError(
                f"connection bounds must be at least 1, got {max_connections}, {max_connections_per_address}"
            )
        self.host = host
        self.port = port
        self.handler = handler
        self.poll_interval_s = poll_interval_s
        self.max_message_bytes = max_message_bytes
        self.queued_frames = queued_frames
        self.connections = ConnectionBound(max_connections, max_connections_per_address)
        self.sealer = sealer
        self.identity = identity
        self._socket: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned_at: float | None = None  # when dropped frames were last logged
        self.drop_warning_s = DROP_WARNING_S
        self._later: collections.deque = collections.deque()  # (framing, message) of answers given later
        self._wake_fds: tuple[int, int] | None = None  # a pipe that wakes the thread to send them

    @property
    def endpoint(self) -> str:
        return endpoint(self.host, self.port)

    @property
    def destination(self) -> bytes:
        """What a sealed request to this server is bound to (`auth.destination`)."""
        return destination(self.port, *self.identity)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"side channel {self.endpoint} is already started")
        sock = zmq_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.queued_frames)
        sock.setsockopt(zmq.SNDHWM, self.queued_frames)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(exc.errno, f"cannot bind the side channel on {self.endpoint}: {exc}") from exc
        if self.port == 0:
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._socket = sock
        self._stop.clear()
        self._wake_fds = os.pipe()
        os.set_blocking(self._wake_fds[1], False)
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(
            target=self._serve, args=(sock, monitor), name=f"kvbridge-side-channel-{self.port}", daemon=True
        )
        self._thread.start()
        logger.debug("side channel serving on %s", self.endpoint)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the socket; a no-op if not started."""
        thread, sock = self._thread, self._socket
        self._thread = self._socket = None
        if thread is None or sock is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        if thread.is_alive():
            # A handler is stuck: leave the socket to its thread rather than close it under it.
            logger.warning("side channel %s did not stop within %.1f s", self.endpoint, timeout_s)
            return
        sock.close(linger=0)
        fds, self._wake_fds = self._wake_fds, None
        for fd in fds or ():
            os.close(fd)

    def _send_later(self, framed: Callable[[bytes], list[bytes]], message: wire.Message) -> None:
        """A `Later` was answered (any thread): queue it and wake the server's thread, which seals and sends it."""
        self._later.append((framed, message))
        fds = self._wake_fds
        if fds is not None:
            with contextlib.suppress(OSError):  # full (it is awake anyway) or closed (stopped)
                os.write(fds[1], b"\0")

    def __enter__(self) -> SideChannelServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _serve(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        unpin_this_thread()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if self._wake_fds is not None:
            poller.register(self._wake_fds[0], zmq.POLLIN)
        timeout_ms = max(1, round(self.poll_interval_s * 1000))
        try:
            self._serve_until_stopped(sock, monitor, poller, timeout_ms)
        finally:  # on this thread, which owns both: stop the monitor while its reader is open, then close that
            with contextlib.suppress(zmq.ZMQError):
                while monitor.poll(0):
                    monitor.recv_multipart(zmq.NOBLOCK)
                sock.disable_monitor()
            monitor.close(linger=0)

    def _serve_until_stopped(self, sock: zmq.Socket, monitor: zmq.Socket, poller: zmq.Poller, timeout_ms: int) -> None:
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(timeout_ms))
                if monitor in ready:
                    self._connection_events(monitor)
                if self._wake_fds is not None and self._wake_fds[0] in ready:
                    os.read(self._wake_fds[0], 4096)
                while self._later:
                    framed, message = self._later.popleft()
                    self._send(sock, framed(wire.encode(message)))
                if sock not in ready:
                    continue
                # Drain what is queued, bounded so that a flood cannot delay a stop for long.
                for _ in range(64):
                    try:
                        raw = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames = [f.bytes for f in raw]
                    answer = _answer_frames(frames, self.handler, self.sealer, self.destination)
                    if answer is None:
                        self._dropped()
                        continue
                    if self.sealer is not None:  # an authenticated peer: its connection is cut last
                        self.connections.authenticated(_source_fd(raw[-1]))
                    if isinstance(answer, tuple):  # answered later, from another thread
                        later, framed = answer
                        later.bind(lambda message, framed=framed: self._send_later(framed, message))
                        continue
                    self._send(sock, answer)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError:
                logger.exception("side channel %s: socket error", self.endpoint)
                self._stop.wait(self.poll_interval_s)

    def _send(self, sock: zmq.Socket, answer: list[bytes]) -> None:
        try:
            sock.send_multipart(answer, zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full or it left: drop the answer
            logger.debug("side channel %s dropped an answer", self.endpoint)

    def _dropped(self) -> None:
        """A frame was dropped unanswered: say so, at most once every `drop_warning_s`, with the totals by reason
        (an operator sees a misconfigured key or an attack; an attacker cannot fill the log)."""
        now = time.monotonic()
        if self.sealer is None or (self._warned_at is not None and now - self._warned_at < self.drop_warning_s):
            return
        self._warned_at = now
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self.sealer.dropped.items()))
        logger.warning(
            "side channel %s dropped frames not sealed for it with the deployment key (totals: %s); next report in "
            "%g s at the earliest",
            self.endpoint,
            counts,
            self.drop_warning_s,
        )

    def _connection_events(self, monitor: zmq.Socket) -> None:
        for _ in range(64):
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                for victim in self.connections.accepted(fd, peer_address(fd, self.port)):
                    cut_connection(victim, self.port)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections.closed(fd)


def _source_fd(frame: zmq.Frame) -> int:
    """The fd of the connection `frame` came on (libzmq's SRCFD), or -1."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError):
        return -1
