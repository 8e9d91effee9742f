"""The client side of the side channel: `exchange` / `fetch_handshake` (a DEALER socket per attempt, bounded
retries and timeouts), `SideChannelClient` (one thread's DEALER sockets kept per address, several peers asked at
once: claims and notifications) and `ThreadClients` (one client per calling thread).

The server, the ports and the protocol are in `side_channel`. With a deployment key every request is sealed for
the worker it is meant for, and an answer is accepted only if it is the authentic answer to that request. An
answer over `max_answer_bytes` is cut by ZMQ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq

from kvbridge.core.errors import (
    HostUnreachable,
    IncompatiblePeerError,
    KVBridgeError,
    PeerGone,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import zmq_context
from kvbridge.wire.auth import ClockSkew, Sealer, destination
from kvbridge.wire.local_address import on_this_host
from kvbridge.wire.peer_watch import REFUSED, RESET, UNREACHABLE, PeerWatch
from kvbridge.wire.side_channel import MAX_ANSWER_BYTES, NO_IDENTITY, Identity, endpoint

logger = logging.getLogger(__name__)


def exchange(
    host: str,
    port: int,
    message: wire.Message,
    *,
    timeout_s: float = 2.0,
    retries: int = 2,
    sealer: Sealer | None = None,
    identity: Identity = NO_IDENTITY,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
    link_timeout_s: float = 0.0,
) -> wire.Message:
    """Send `message` to the side channel at (host, port) and return its answer.

    Each of the `1 + retries` attempts uses a fresh DEALER socket and waits at most `timeout_s`, so this
    returns or raises within about `(1 + retries) * timeout_s`. Raises TransferTimeout if no attempt is
    answered, ProtocolError for an answer that is not a message (IncompatiblePeerError if it carries another
    protocol version), PeerGone at once when the port refuses the connection (nobody listens: the process is
    gone), or resets it and a fresh attempt is refused. Messages may be delivered more than once: handlers must be
    idempotent. With `sealer` each attempt is sealed afresh for the worker `identity` names, and an answer that is
    not the authentic answer to it is not taken. An answer over `max_answer_bytes` is cut by ZMQ (a reset: retried,
    then it times out). `link_timeout_s` (0: the kernel's defaults; not applied to an address of this host): a
    connect not answered for this long ends its attempt, and HostUnreachable is raised when the last attempt ended
    so (one lost SYN is not a verdict: the kernel sends it again only after 1 s); a connection whose bytes go
    unacknowledged for this long is aborted (a reset).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
    payload = wire.encode(message)
    address = endpoint(host, port)
    dest = destination(port, *identity)
    timeout_ms = max(1, round(timeout_s * 1000))
    started = time.monotonic()
    gone = None
    attempts, attempt = 1 + retries, 0
    while attempt < attempts:
        attempt += 1
        try:
            sock, watch = _dealer(address, timeout_ms, max_answer_bytes, link_timeout_s=link_timeout_s)
        except zmq.ZMQError as exc:
            raise TransferError(f"cannot connect to the side channel {address}: {exc}") from exc
        try:
            frame, ticket = sealer.seal_request(payload, dest) if sealer else (payload, b"")
            try:
                sock.send(frame)
            except zmq.Again:
                continue
            gone = _await(sock, watch, timeout_s)
            if gone is None:
                try:
                    return _decode_answer(sock.recv_multipart(), address, sealer, ticket, dest)
                except ClockSkew as exc:
                    if attempts > 1 + retries:  # timed by its clock already: still stale
                        raise
                    _note_skew(address, exc)
                    attempts += 1  # once: the next attempt is timed by the peer's clock
                    continue
            if gone == REFUSED:
                break
            logger.debug("side channel %s: attempt %d: %s", address, attempt, gone)
        finally:
            watch.close()
            sock.close(linger=0)
    if gone == REFUSED:
        raise _gone(address, message, started)
    if gone == UNREACHABLE:
        raise _unreachable(address, message, started, link_timeout_s)
    if gone == RESET:
        raise TransferError(f"the side channel {address} reset the connection on each of {1 + retries} attempts")
    raise TransferTimeout(
        f"no answer from the side channel {address} to {type(message).__name__}: "
        f"{1 + retries} attempts of {timeout_s:g} s ({time.monotonic() - started:.2f} s)" + _KEY_HINT
    )


def _await(sock: zmq.Socket, watch: PeerWatch, timeout_s: float) -> str | None:
    """Wait until `sock` has an answer (None), its peer is gone (REFUSED, RESET) or `timeout_s` passed ("")."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, round(left * 1000))))
        if sock in ready:
            return None
        if watch.monitor in ready and (gone := watch.verdict()):
            return gone
    return ""


def _unreachable(address: str, message: wire.Message, started: float, link_timeout_s: float) -> HostUnreachable:
    return HostUnreachable(
        f"the side channel {address} did not accept a connection within {link_timeout_s:g} s (link_timeout_s; "
        f"{type(message).__name__}, after {time.monotonic() - started:.3f} s): its host or the link to it is down"
    )


def _gone(address: str, message: wire.Message, started: float) -> PeerGone:
    return PeerGone(
        f"the side channel {address} refused the connection ({type(message).__name__}, after "
        f"{time.monotonic() - started:.3f} s): its process is gone"
    )


class SideChannelClient:
    """One thread's side-channel connections, kept open per address, for the messages sent per request.

    A fresh socket per message (`exchange`) costs a TCP connect and ZMQ's handshake: about 400 us on loopback
    against 170 us on an open socket, paid per prefill worker, per request, twice (claim and notification).
    `exchange_all` asks several peers at once, so a request read from N workers waits one round trip, not N.
    A socket whose answer did not come in time is closed and replaced (a late answer must never be taken for the
    next message's), so retries and timeouts behave as `exchange`'s. Not thread-safe: one per thread.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        retries: int = 2,
        max_sockets: int = 256,
        sealer: Sealer | None = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        link_timeout_s: float = 0.0,
    ) -> None:
        """`link_timeout_s`: as `exchange`'s (an unreachable host's message fails with HostUnreachable; none to an
        address of this host)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.link_timeout_s = link_timeout_s
        self.retries = retries
        self.sealer = sealer
        self.max_answer_bytes = max_answer_bytes
        # A long-lived decode server meets prefill instances that come and go: beyond this many addresses the
        # least recently used socket is closed (a file descriptor each), and reopened if that peer comes back.
        self.max_sockets = max_sockets
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._watches: dict[str, PeerWatch] = {}  # each kept socket's monitor: is its peer still there

    def exchange_all(
        self,
        targets: list[tuple[str, int]],
        message: wire.Message,
        identities: list[Identity] | None = None,
        while_waiting: Callable[[], None] | None = None,
        gone_checks: Sequence[Callable[[], bool] | None] = (),
    ) -> list[wire.Message | Exception]:
        """Send `message` to every (host, port) and return, in order, each one's answer, or the error that
        stands for it (TransferTimeout after `1 + retries` attempts of `timeout_s`, ProtocolError...).
        `identities[i]`: the worker target i is (sealed requests are bound to it); default NO_IDENTITY.
        `while_waiting`: work to do once the first attempt is sent, before its answers are awaited (it must not
        raise). `gone_checks[i]`: whether target i's process is gone, checked every GONE_CHECK_S while its answer is
        awaited: a killed process's sockets may stay open, silent, until the kernel has torn down its memory, and
        True ends the wait as a refused connection does (PeerGone)."""
        payload = wire.encode(message)
        addresses = [endpoint(host, port) for host, port in targets]
        dests = {
            endpoint(host, port): destination(port, *(identities[i] if identities else NO_IDENTITY))
            for i, (host, port) in enumerate(targets)
        }
        answers: dict[str, wire.Message | Exception] = {}
        unreachable: set[str] = set()  # the connect of its last attempt was not answered within link_timeout_s
        checks = {addresses[i]: check for i, check in enumerate(gone_checks) if check is not None}
        skewed: set[str] = set()  # answered "stale" once: asked again, timed by the peer's clock
        timeout_ms = max(1, round(self.timeout_s * 1000))
        started = time.monotonic()
        attempts, attempt = 1 + self.retries, 0
        while attempt < attempts:
            attempt += 1
            pending = [a for a in dict.fromkeys(addresses) if a not in answers]
            if not pending:
                break
            unreachable.difference_update(pending)
            polling: dict[zmq.Socket, str] = {}
            watching: dict[zmq.Socket, str] = {}
            nonces: dict[str, bytes] = {}
            for address in pending:
                try:
                    sock = self._socket(address, timeout_ms, polling.values(), checks.get(address))
                    sealed = self.sealer.seal_request(payload, dests[address]) if self.sealer else (payload, b"")
                    frame, nonces[address] = sealed
                    self._watches[address].clear()  # a reset before this message was reconnected since
                    sock.send(frame)
                    polling[sock] = address
                    watching[self._watches[address].monitor] = address
                except zmq.Again:  # its queue is full: a new socket next attempt
                    self._drop(address)
                except zmq.ZMQError as exc:
                    self._drop(address)
                    answers[address] = TransferError(f"cannot reach the side channel {address}: {exc}")
            if while_waiting is not None:
                while_waiting()
                while_waiting = None
            poller = zmq.Poller()
            for sock in (*polling, *watching):
                poller.register(sock, zmq.POLLIN)
            polled = time.monotonic()  # this attempt's wait for its answers began
            deadline = polled + self.timeout_s
            while polling and (left := deadline - time.monotonic()) > 0:
                wait = min(left, GONE_CHECK_S) if checks else left
                for sock, _ in poller.poll(max(1, round(wait * 1000))):
                    if sock in watching:  # the peer's connection: refused (gone) or reset (a fresh socket)
                        address = watching[sock]
                        gone = self._watches[address].verdict() if address in self._watches else None
                        if gone is None:
                            continue
                        poller.unregister(sock)
                        del watching[sock]
                        polling.pop(self._sockets[address])
                        poller.unregister(self._sockets[address])
                        self._drop(address)
                        if gone == REFUSED:
                            answers[address] = _gone(address, message, started)
                        elif gone == UNREACHABLE:  # this attempt ends; the next one connects afresh
                            unreachable.add(address)
                        continue
                    if sock not in polling:  # a monitor of an answered peer, in the same batch
                        continue
                    address = polling.pop(sock)
                    poller.unregister(sock)
                    monitor = self._watches[address].monitor
                    if watching.pop(monitor, None) is not None:
                        poller.unregister(monitor)
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                        answers[address] = _decode_answer(frames, address, self.sealer, nonces[address], dests[address])
                    except ClockSkew as exc:
                        if address in skewed:  # timed by its clock already: still stale
                            answers[address] = exc
                        else:
                            skewed.add(address)
                            _note_skew(address, exc)
                            attempts = max(attempts, attempt + 1)
                    except (KVBridgeError, zmq.ZMQError) as exc:
                        self._drop(address)
                        answers[address] = exc
                # a claim answered within GONE_CHECK_S (the healthy case, under a millisecond) costs no check
                waited = bool(checks) and time.monotonic() - polled >= GONE_CHECK_S
                for sock, address in [(s, a) for s, a in polling.items() if waited and self._dead_peer(a, checks)]:
                    del polling[sock]
                    poller.unregister(sock)
                    if watching.pop(self._watches[address].monitor, None) is not None:
                        poller.unregister(self._watches[address].monitor)
                    self._drop(address)
                    answers[address] = PeerGone(
                        f"the process of the side channel {address} is gone ({type(message).__name__}, after "
                        f"{time.monotonic() - started:.3f} s; its sockets may still be open)"
                    )
            for address in polling.values():  # unanswered: a late answer must not meet the next message
                self._drop(address)
                logger.debug("side channel %s: attempt %d timed out", address, attempt)
        for address in unreachable:
            answers.setdefault(address, _unreachable(address, message, started, self.link_timeout_s))
        for address in addresses:
            answers.setdefault(
                address,
                TransferTimeout(
                    f"no answer from the side channel {address} to {type(message).__name__}: "
                    f"{1 + self.retries} attempts of {self.timeout_s:g} s ({time.monotonic() - started:.2f} s)"
                    + _KEY_HINT
                ),
            )
        return [answers[a] for a in addresses]

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)

    def _dead_peer(self, address: str, checks: dict[str, Callable[[], bool]]) -> bool:
        """Whether `address`'s process is gone and its socket may still be talking to it (not to a new process
        on the address: `PeerWatch.maybe_dead_peer`)."""
        check = checks.get(address)
        return check is not None and self._watches[address].maybe_dead_peer(GREET_S) and check()

    def _socket(
        self, address: str, timeout_ms: int, busy: Collection[str], gone: Callable[[], bool] | None = None
    ) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is not None:
            self._sockets.move_to_end(address)
        else:
            alive = gone is None or not gone()
            sock, self._watches[address] = _dealer(
                address, timeout_ms, self.max_answer_bytes, alive, self.link_timeout_s
            )
            self._sockets[address] = sock
        # Over the bound: close the least recently used, never this one or one this call still waits on (`busy`),
        # so a call to more peers than the bound exceeds it until the next call.
        excess = len(self._sockets) - self.max_sockets
        if excess > 0:
            for old in [a for a in self._sockets if a != address and a not in busy][:excess]:
                self._drop(old)
        return sock

    def _drop(self, address: str) -> None:
        sock = self._sockets.pop(address, None)
        watch = self._watches.pop(address, None)
        if watch is not None:
            watch.close()
        if sock is not None:
            sock.close(linger=0)


def fetch_handshake(
    host: str,
    port: int,
    request: wire.HandshakeRequest,
    *,
    timeout_s: float = 2.0,
    retries: int = 2,
    sealer: Sealer | None = None,
    identity: Identity = NO_IDENTITY,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
    link_timeout_s: float = 0.0,
) -> wire.HandshakeReply:
    """The decode side of a handshake: the prefill worker's reply, checked against `request`.

    Raises IncompatiblePeerError (refused here or there), TransferTimeout (see `exchange`) or ProtocolError.
    """
    answer = exchange(
        host,
        port,
        request,
        timeout_s=timeout_s,
        retries=retries,
        sealer=sealer,
        identity=identity,
        max_answer_bytes=max_answer_bytes,
        link_timeout_s=link_timeout_s,
    )
    address = endpoint(host, port)
    try:
        match answer:
            case wire.HandshakeReply():
                wire.check_compatible(request, answer)
                if request.target is not None and answer.worker != request.target:
                    raise IncompatiblePeerError("worker", str(request.target), str(answer.worker))
                return answer
            case wire.HandshakeRefused():
                raise answer.to_error()
            case wire.ErrorReply(message=text):
                raise ProtocolError(f"the side channel {address} refused the handshake with an error: {text}")
            case _:
                raise ProtocolError(f"the side channel {address} answered the handshake with {answer!r}")
    except IncompatiblePeerError as exc:
        exc.add_note(f"peer: the side channel {address}")
        raise


def _dealer(
    address: str,
    timeout_ms: int,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
    peer_alive: bool = True,
    link_timeout_s: float = 0.0,
) -> tuple[zmq.Socket, PeerWatch]:
    """A DEALER socket connected to `address` (an `endpoint`), and its watch: no linger, sends time out after
    `timeout_ms`, answers over `max_answer_bytes` cut, connects and unacknowledged bytes bounded by
    `link_timeout_s` (0: the kernel's defaults; none to an address of this host, `local_address.on_this_host`,
    whose own kernel answers: a connect late there only because this process was starved is no host down). The watch is
    made before the connect: a connection made first would show no events (its monitor misses them). Closed
    again if the connect fails (zmq.ZMQError)."""
    sock = zmq_context().socket(zmq.DEALER)
    watch = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, max_answer_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)  # a kept socket whose peer went learns it is gone sooner
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)  # an idle one to a dead peer backs off
        if link_timeout_s > 0 and on_this_host(address.removeprefix("tcp://").rsplit(":", 1)[0]):
            link_timeout_s = 0.0  # this host's own kernel answers: a late connect is a starved thread, no link down
        if link_timeout_s > 0:
            link_ms = max(1, round(link_timeout_s * 1000))
            sock.setsockopt(zmq.CONNECT_TIMEOUT, link_ms)
            sock.setsockopt(zmq.TCP_MAXRT, link_ms)
        if address.startswith("tcp://["):  # an IPv6 literal
            sock.setsockopt(zmq.IPV6, 1)
        watch = PeerWatch(sock, peer_alive, link_timeout_s)
        sock.connect(address)
    except zmq.ZMQError:
        if watch is not None:
            watch.close()
        sock.close(linger=0)
        raise
    return sock, watch


GONE_CHECK_S = 0.02
"""How often `SideChannelClient.exchange_all` asks whether a peer's process is gone while it awaits its answer."""
GREET_S = 0.2
"""A connection that has not completed ZMQ's handshake this long after it was made reaches no live process."""

RECONNECT_MS = 20
"""A client socket's reconnect interval after its connection dropped (ZMQ's default: 100 ms): a message waits
for the next connect to be refused before it fails (`PeerWatch`)."""
RECONNECT_MAX_MS = 200
"""Reconnects of a socket whose peer stays away back off (doubling) up to this: a kept socket to a dead peer costs
five connects a second until it is used (then it fails at once) or closed, and a message waits at most this."""

_KEY_HINT = (
    " (a server with a deployment key drops what is not sealed with it: are the auth keys equal, or accepted there, "
    "and the frame formats (kvbridge versions) the same? its log counts the drops by reason)"
)


def _note_skew(address: str, skew: ClockSkew) -> None:
    logger.warning(
        "side channel %s: its clock differs from this host's by %+.1f s; its requests are now timed by its clock "
        "(fix the clocks: NTP)",
        address,
        skew.skew_s,
    )


def _decode_answer(
    frames: list[bytes], address: str, sealer: Sealer | None = None, ticket: bytes = b"", dest: bytes | None = None
) -> wire.Message:
    """The message in an answer; ClockSkew if the peer refused our request as stale (its offset is kept)."""
    if len(frames) != 1:
        raise ProtocolError(f"the side channel {address} answered with {len(frames)} frames, expected 1")
    if sealer is not None:
        body = sealer.open_answer(frames[0], ticket, dest)
        if body is None:
            raise ProtocolError(f"the side channel {address} answered with a frame not sealed with our key")
        frames = [body]
    try:
        return wire.decode(frames[0])
    except ProtocolError as exc:
        version = wire.peer_version(frames[0])
        if version is not None and version != wire.PROTOCOL_VERSION:
            raise IncompatiblePeerError("protocol_version", wire.PROTOCOL_VERSION, version) from exc
        raise ProtocolError(f"the side channel {address} answered: {exc}") from exc


class ThreadClients:
    """One `SideChannelClient` per calling thread (a client's kept sockets belong to one thread), made on first
    use with the same arguments, all closed together."""

    def __init__(self, **client_args: Any) -> None:
        self._args = client_args
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[SideChannelClient] = []

    def get(self) -> SideChannelClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = SideChannelClient(**self._args)
            with self._lock:
                self._all.append(client)
        return client

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()
