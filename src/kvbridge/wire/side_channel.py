"""The side channel: every prefill worker answers handshakes (and later messages) on its own TCP port.

Three layers, I/O only in the last:
- addresses: `side_channel_port` gives every (dp, pp, tp) prefill worker its own port; the prefill worker
  binds it and the decode side connects to it by the same computation (vLLM's seed bug: ports that ignored
  the pp rank collided across stages, and the two sides computed them differently);
- protocol: `respond(data, handler)` maps one received message to the bytes of its answer, and
  `handshake_handler(reply)` is the handler of a prefill worker; both are pure and tested without sockets;
- ZMQ shell: `SideChannelServer` (a ROUTER socket served by a daemon thread); the client side, `exchange` /
  `fetch_handshake` (a DEALER socket per attempt, bounded retries and timeouts) and `SideChannelClient`
  (one thread's DEALER sockets kept per address, several peers asked at once: claims and notifications), is in
  `side_channel_client`.

Every wait is a poll with a timeout: nothing spins, and a stopped server's thread ends within one poll.

With a deployment key (`wire.auth.Sealer`) every frame is sealed (encrypted and authenticated): a server drops,
without an answer, anything not sealed with its key for its own identity (`SideChannelServer.identity`) or seen
before, and an answer is accepted only for the request it answers. Sizes are bounded on both ends (a frame a
server takes, an answer a client takes, messages queued per peer).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbridge.core.errors import (
    IncompatiblePeerError,
    KVBridgeError,
    LayoutError,
    ProtocolError,
)
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread, zmq_context
from kvbridge.wire.auth import Sealer, destination
from kvbridge.wire.later import Later

logger = logging.getLogger(__name__)

MAX_PORT = 65535
DEFAULT_HOST = "127.0.0.1"
# The defaults of the bounds below are BridgeConfig's (side_channel_max_frame_bytes and its neighbours), which
# the workers pass in; tests/nixl/test_config_bounds.py checks that both agree.
MAX_REQUEST_BYTES = 256 * 1024
"""Largest frame a side-channel server takes: a handshake request describes one decode worker's memory (a few
hundred bytes a layer); claims and notifications are far smaller."""
MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""Largest answer a client takes (a handshake reply: memory map, NIXL metadata, CUDA IPC handles)."""
QUEUED_PER_PEER = 16
"""Messages ZMQ queues per connection (its default, 1000, times the frame size is what a flood could pin)."""
MAX_CONNECTIONS = 512
"""Connections a side-channel server keeps open at once. Each may pin up to QUEUED_PER_PEER frames of
MAX_REQUEST_BYTES, so this bounds what a connection flood can pin. A decode worker keeps one connection per
control thread (8) to each prefill worker it reads from: 512 serves 64 decode ranks."""
DROP_WARNING_S = 60.0
"""Dropped (unauthenticated, misaddressed, replayed...) frames are logged at most once in this many seconds."""
MAX_CONNECTIONS_PER_ADDRESS = 128
"""Connections one source address keeps open at once (a decode host of 8 GPUs x 8 control threads needs 64)."""

Identity = tuple[str, int, int, int]
"""A prefill worker's identity a sealed request is bound to: (engine id, dp rank, pp rank, tp rank)."""
NO_IDENTITY: Identity = ("", 0, 0, 0)


Handler = Callable[[wire.Message], "wire.Message | Later"]
"""Answers one decoded message, now or `Later`; called on the server's thread. May raise: the peer then gets an
error."""


# --- addresses --------------------------------------------------------------------------------------------


def side_channel_port(base_port: int, layout: ParallelLayout, dp_rank: int, rank: WorkerRank) -> int:
    """The side-channel port of prefill worker `rank` of engine `dp_rank`.

    It is base_port + (dp_rank * pp + rank.pp) * tp + rank.tp, for the prefill engine's layout.
    Every worker of the layout gets its own port, in [base_port, base_port + dp*pp*tp). Raises LayoutError
    for a rank outside the layout, or if the layout's range of ports does not fit below 65536 (checked for
    the whole range, so every worker fails alike).
    """
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not 1 <= base_port <= MAX_PORT:
        raise LayoutError(f"base_port must be in [1, {MAX_PORT}], got {base_port!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < layout.dp:
        raise LayoutError(f"dp rank {dp_rank!r} is outside dp={layout.dp}")
    layout.check_rank(rank)
    workers = layout.dp * layout.workers_per_engine
    if base_port + workers - 1 > MAX_PORT:
        raise LayoutError(
            f"side-channel ports {base_port}..{base_port + workers - 1} of layout {layout} "
            f"({workers} workers) exceed {MAX_PORT}: use a base_port of at most {MAX_PORT - workers + 1}"
        )
    return base_port + (dp_rank * layout.pp + rank.pp) * layout.tp + rank.tp


def side_channel_ports(base_port: int, layout: ParallelLayout) -> dict[tuple[int, WorkerRank], int]:
    """The port of every (dp rank, worker) of `layout`."""
    return {
        (dp, rank): side_channel_port(base_port, layout, dp, rank)
        for dp in range(layout.dp)
        for rank in layout.workers()
    }


def endpoint(host: str, port: int) -> str:
    """The ZMQ TCP endpoint of (host, port); IPv6 literals are bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# --- protocol (pure) --------------------------------------------------------------------------------------


def handshake_handler(reply: wire.HandshakeReply, on_message: Handler | None = None) -> Handler:
    """A prefill worker's handler: handshakes are answered from `reply`, other messages go to `on_message`."""

    def handle(message: wire.Message) -> wire.Message:
        match message:
            case wire.HandshakeRequest():
                return wire.answer_handshake(reply, message)
            case _ if on_message is not None:
                return on_message(message)
            case _:
                return wire.ErrorReply(
                    message=f"this side channel does not handle {type(message).__name__}",
                    reason=wire.Refusal.UNEXPECTED,
                )

    return handle


def respond(data: bytes, handler: Handler) -> bytes | Later:
    """The encoded answer to one received message (or the handler's `Later`); never raises.

    Undecodable bytes get an ErrorReply, or a HandshakeRefused on protocol_version when they carry another
    version. A handler that raises IncompatiblePeerError refuses; any other exception becomes an ErrorReply.
    """
    try:
        message = wire.decode(data)
    except ProtocolError as exc:
        version = wire.peer_version(data)
        if version is not None and version != wire.PROTOCOL_VERSION:
            refusal = IncompatiblePeerError("protocol_version", wire.PROTOCOL_VERSION, version)
            return wire.encode(wire.HandshakeRefused.from_error(refusal))
        return wire.encode(wire.ErrorReply(message=str(exc)))
    try:
        answer = handler(message)
        return answer if isinstance(answer, Later) else wire.encode(answer)
    except IncompatiblePeerError as exc:
        return wire.encode(wire.HandshakeRefused.from_error(exc))
    except KVBridgeError as exc:
        return wire.encode(wire.ErrorReply(message=str(exc)))
    except Exception as exc:
        logger.exception("side-channel handler failed on %s", type(message).__name__)
        return wire.encode(wire.ErrorReply(message=f"internal error on {type(message).__name__}: {exc!r}"))


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


# --- ZMQ shell --------------------------------------------------------------------------------------------


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
                for victim in self.connections.accepted(fd, _peer_address(fd, self.port)):
                    _cut(victim, self.port)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections.closed(fd)


def _source_fd(frame: zmq.Frame) -> int:
    """The fd of the connection `frame` came on (libzmq's SRCFD), or -1."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError):
        return -1


class ConnectionBound:
    """A server's open connections by fd and source address; `accepted` says which to cut (pure bookkeeping).

    Beyond `per_address` from one address, beyond `limit` in all from the address holding the most, one
    connection of that address is cut: the oldest that never sent an authenticated frame (`authenticated`), or,
    if all did, the new one. So idle connections that never send a frame lock out neither other addresses nor
    the key holders of their own (a decode on the host of a flooding process). A cut connection stops
    counting at once (its close is reported later)."""

    def __init__(self, limit: int, per_address: int) -> None:
        self.limit = limit
        self.per_address = per_address
        self.cut = 0
        self._address: dict[int, str] = {}  # fd -> source address
        self._fds: dict[str, list[int]] = {}  # source address -> its fds, oldest first
        self._cutting: set[int] = set()  # cut, close not yet reported
        self._trusted: set[int] = set()  # open fds that sent an authenticated frame

    @property
    def open(self) -> int:
        return len(self._address)

    def accepted(self, fd: int, address: str) -> list[int]:
        self._cutting.discard(fd)
        self._address[fd] = address
        self._fds.setdefault(address, []).append(fd)
        self._trusted.discard(fd)  # a new connection on a reused fd
        if len(self._fds[address]) > self.per_address:
            return self._cut(
                self._victim(address),
                f"{len(self._fds[address])} from {address}, the bound per address is {self.per_address}",
            )
        if len(self._address) > self.limit:
            heaviest = max(self._fds, key=lambda a: len(self._fds[a]))
            return self._cut(self._victim(heaviest), f"{len(self._address)} open, the bound is {self.limit}")
        return []

    def authenticated(self, fd: int) -> None:
        """The connection on `fd` sent an authenticated frame."""
        if fd in self._address:
            self._trusted.add(fd)

    def _victim(self, address: str) -> int:
        fds = self._fds[address]
        return next((f for f in fds if f not in self._trusted), fds[-1])

    def closed(self, fd: int) -> None:
        self._trusted.discard(fd)
        if fd in self._cutting:
            self._cutting.discard(fd)
        elif (address := self._address.pop(fd, None)) is not None:
            self._forget(fd, address)

    def _cut(self, fd: int, why: str) -> list[int]:
        self._trusted.discard(fd)
        self._forget(fd, self._address.pop(fd))
        self._cutting.add(fd)
        self.cut += 1
        if self.cut == 1 or self.cut % 1000 == 0:
            logger.warning("side channel: cutting a connection (%d so far): %s", self.cut, why)
        return [fd]

    def _forget(self, fd: int, address: str) -> None:
        fds = self._fds[address]
        fds.remove(fd)
        if not fds:
            del self._fds[address]


def _accepted_socket(fd: int, port: int) -> socket.socket | None:
    """A duplicate of `fd` if it is a TCP connection accepted on `port` (libzmq's fd may already be closed and
    reused by the time its event is read: only this server's connections are ever touched)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port:
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _peer_address(fd: int, port: int) -> str:
    sock = _accepted_socket(fd, port)
    if sock is None:
        return "?"
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
    finally:
        sock.close()


def _cut(fd: int, port: int) -> None:
    """Shut down the accepted TCP connection on `fd`: libzmq then closes it itself and reports it closed."""
    sock = _accepted_socket(fd, port)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
