"""A side-channel server's bound on its open connections: `ConnectionBound` (which connection to cut, pure
bookkeeping by fd and source address) and the socket calls that look up and cut an accepted TCP connection by the
fd libzmq reports (`peer_address`, `cut_connection`). The server is `side_channel_server.SideChannelServer`.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


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


def peer_address(fd: int, port: int) -> str:
    sock = _accepted_socket(fd, port)
    if sock is None:
        return "?"
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
    finally:
        sock.close()


def cut_connection(fd: int, port: int) -> None:
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
