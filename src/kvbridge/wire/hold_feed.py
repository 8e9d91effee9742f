"""A prefill engine's holds, from its scheduler to its workers on this host, the moment a request finishes.

A finished request's hold reaches the workers with a later step's metadata. With vLLM's async scheduling the
engine has already scheduled the next step when the request finishes, so the hold rides with the step after that,
and the workers see it only when the next step's forward is done: on a busy prefill engine a whole prefill chunk
after its `kv_transfer_params` left, while the decode's claim waits for it. The feed sends each hold as the request
finishes, over a ZMQ PUB socket on a Unix socket in a fresh directory only this user can enter (mode 0700): the
processes that can connect are the ones that could already read the engine's memory. Workers learn the address
from the metadata and subscribe. The metadata still carries every hold: a hold the feed lost (a worker on another
host, or not subscribed yet) comes that way, and one that comes twice is held once (`PrefillWorker.hold`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable

import msgspec
import zmq

from kvbridge.wire.affinity import unpin_this_thread, zmq_context

logger = logging.getLogger(__name__)

SOCKET_NAME = "holds"


class HoldNote(msgspec.Struct, array_like=True, frozen=True):
    """A finished request's hold, as the metadata carries it (`KVBridgeMetadata.holds`)."""

    request_id: str
    groups: tuple[tuple[int, ...], ...]
    token: str
    prompt_hash: str
    finished_at: float
    """When the scheduler finished the request (time.monotonic: the host's clock, shared by its processes)."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(HoldNote).decode


class HoldFeed:
    """The scheduler's end: binds at construction; `send` never blocks (a note that cannot go is dropped: the
    metadata carries it too). A directory left by an engine killed with SIGKILL stays in the temp dir
    (`kvbridge-*`, empty but for the socket)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvbridge-")  # mode 0700, a fresh name
        self.address = f"ipc://{os.path.join(self.directory, SOCKET_NAME)}"
        try:
            self._socket = zmq_context().socket(zmq.PUB)
        except zmq.ZMQError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._cleanup = weakref.finalize(self, _remove, self._socket, self.directory)
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.SNDHWM, 4096)
            self._socket.bind(self.address)
        except zmq.ZMQError:
            self._cleanup()
            raise

    @classmethod
    def open(cls) -> HoldFeed | None:
        """A bound feed, or None when none can be made here (the metadata alone then brings the holds)."""
        try:
            return cls()
        except (OSError, zmq.ZMQError) as exc:
            logger.warning("kvbridge: no hold feed (%s): holds reach the workers with the step metadata only", exc)
            return None

    def send(self, note: HoldNote) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send(_encode(note), zmq.NOBLOCK)

    def close(self) -> None:
        self._cleanup()


def _remove(sock: zmq.Socket, directory: str) -> None:
    try:
        sock.close(linger=0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def private_socket(address: str) -> str | None:
    """The socket path of `address` if it is an ipc address in a directory of this user that no one else can
    enter, and exists on this host; else None (why is logged)."""
    path = address.removeprefix("ipc://")
    if path == address or os.path.basename(path) != SOCKET_NAME:
        logger.warning("kvbridge: hold feed %r is not a kvbridge feed address: not used", address)
        return None
    try:
        info = os.lstat(os.path.dirname(path))
        os.lstat(path)
    except OSError:
        return None  # another host's engine (a worker of a multi-host engine): the metadata brings the holds
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.warning("kvbridge: hold feed %r is in a directory others can enter or this user does not own", address)
        return None
    return path


class HoldFeedReader:
    """A worker's end: a daemon thread that passes every note to `on_note`."""

    def __init__(self, address: str, on_note: Callable[[HoldNote], None], name: str = "kvbridge-holds") -> None:
        self.address = address
        self.on_note = on_note
        self._stop = threading.Event()
        self._socket = zmq_context().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def open(cls, address: str, on_note: Callable[[HoldNote], None], name: str = "kvbridge-holds"):
        """A started reader of `address`, or None when it is not a private feed on this host (`private_socket`)."""
        if private_socket(address) is None:
            return None
        return cls(address, on_note, name).start()

    def start(self) -> HoldFeedReader:
        self._thread.start()
        return self

    def _run(self) -> None:
        unpin_this_thread()
        try:
            while not self._stop.is_set():
                if not self._socket.poll(100):
                    continue
                data = self._socket.recv()
                try:
                    note = _decode(data)
                except msgspec.DecodeError:
                    logger.warning("kvbridge: a malformed hold note (%d bytes) dropped", len(data))
                    continue
                try:
                    self.on_note(note)
                except Exception:  # the metadata brings the hold anyway
                    logger.exception("kvbridge: hold note of %s not taken", note.request_id)
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("kvbridge: the hold feed %s stopped", self.address)
        finally:
            self._socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
