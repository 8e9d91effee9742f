"""kvbridge's KV channel at the byte level: a TCP connection authenticated with the deployment key, every frame
protected by a standard AEAD (AES-256-GCM from `cryptography`). No construction of its own beyond composing them.

Keys (HKDF-SHA256):
- `stream_key(master)`: the channel's own key, derived from the deployment key under its own purpose label
  (`PURPOSE`); neither the deployment key nor the side channel's keys ever key a frame here.
- per connection: both sides send 32 random bytes (client first); HKDF(stream_key, salt = client random || server
  random, info = `SESSION` || mode) gives a key for each direction and a confirmation key. Every connection has
  fresh keys, so a frame recorded on one connection never opens on another (nor in the other direction).

Key confirmation (HMAC-SHA256 with the confirmation key over the role and the transcript): the server sends its
confirmation with its random bytes, the client checks it and sends its own; the server reads nothing further and
sends nothing else before that check passes. An outsider learns 32 random bytes and a MAC of them, and is cut.

Frames: a 12-byte header (payload length, a frame index, a kind) and the payload. Nonces are a per-direction
counter (96 bits, never reused under one key); the receiver expects the next one, so a dropped, repeated or
reordered frame fails to open and the connection is closed.
- mode "encrypt": header in clear and authenticated (associated data), payload encrypted: header, ciphertext, tag.
- mode "integrity": payload in clear and authenticated (associated data), header encrypted (its plaintext): header,
  payload, encrypted header, tag. The receiver checks that the opened header equals the clear one. An observer of
  the link reads the KV; nobody without the key can change or inject a byte.

Zero-copy where it pays: `encrypt_into` / `decrypt_into` into buffers owned by the connection or the caller, and
`sendmsg` of the header and the sealed payload without joining them.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvbridge.core.errors import TransferError

Mode = Literal["encrypt", "integrity"]

PURPOSE = b"kvbridge/kv-stream/v1"
"""HKDF info of the channel's key: no other key of the deployment is derived under it. The same label is
`wire.keys.STREAM` (transport may not import wire, nor wire transport: tests/test_layers.py; a test keeps them
equal)."""

SESSION = b"kvbridge/kv-stream/session/v1/"
MAGIC = b"KVS1"
RANDOM_BYTES = 32
TAG = 16
HEADER = struct.Struct(">IIB3x")  # payload bytes, frame index, kind
_MODES: dict[str, int] = {"encrypt": 1, "integrity": 2}
KEY_ID_BYTES = 8
HELLO = struct.Struct(f">4sB{KEY_ID_BYTES}s{RANDOM_BYTES}s")  # magic, mode, key id, client random
ANSWER = struct.Struct(f">4sB{RANDOM_BYTES}s32s")  # magic, mode, server random, server confirmation
CONFIRM = 32

KIND_MESSAGE = 1
KIND_DATA = 2


class StreamAuthError(TransferError):
    """The peer did not prove the key, or a frame did not open: the connection is closed."""


def stream_key(master: bytes) -> bytes:
    """The KV channel's key, derived from the deployment key `master` under `PURPOSE` (HKDF-SHA256): what
    `wire.keys.DeploymentKey.stream` holds, for callers that have the master key's bytes alone."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=PURPOSE).derive(master)


@dataclass(frozen=True)
class _Keys:
    send: AESGCM
    recv: AESGCM
    confirm: bytes


def _session_keys(key: bytes, mode: Mode, client_random: bytes, server_random: bytes, client: bool) -> _Keys:
    material = HKDF(
        algorithm=hashes.SHA256(), length=96, salt=client_random + server_random, info=SESSION + mode.encode()
    ).derive(key)
    c2s, s2c, confirm = AESGCM(material[:32]), AESGCM(material[32:64]), material[64:]
    return _Keys(c2s, s2c, confirm) if client else _Keys(s2c, c2s, confirm)


def _confirmation(keys: _Keys, role: bytes, transcript: bytes) -> bytes:
    return hmac.digest(keys.confirm, role + transcript, "sha256")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError("kv stream: connection closed by the peer")
        got += n


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _send_all(sock: socket.socket, parts: list) -> None:
    """`sendmsg` of `parts` (buffers), resumed after partial sends without joining them."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def client_handshake(
    sock: socket.socket, key: bytes, mode: Mode = "encrypt", key_id: bytes = bytes(KEY_ID_BYTES)
) -> StreamConnection:
    """Open a connection as the reader; StreamAuthError if the server does not prove `key` (the stream key).
    `key_id`: the public id of the deployment key it derives from (`wire.keys`), so that a server that accepts
    several keys while one is rotated picks this one."""
    mine = os.urandom(RANDOM_BYTES)
    hello = HELLO.pack(MAGIC, _MODES[mode], key_id, mine)
    _send_all(sock, [hello])
    answer = _recv_bytes(sock, ANSWER.size)
    magic, their_mode, theirs, confirm = ANSWER.unpack(answer)
    if magic != MAGIC:
        raise StreamAuthError("kv stream: the peer does not speak this protocol")
    if their_mode != _MODES[mode]:
        names = {v: k for k, v in _MODES.items()}
        raise StreamAuthError(
            f"kv stream: kv_stream_encrypt differs: this reader asked for {mode!r}, the prefill worker "
            f"serves {names.get(their_mode, their_mode)!r}"
        )
    keys = _session_keys(key, mode, mine, theirs, client=True)
    transcript = hello + answer[: ANSWER.size - CONFIRM]
    if not hmac.compare_digest(confirm, _confirmation(keys, b"server", transcript)):
        raise StreamAuthError("kv stream: the prefill worker did not prove the deployment key")
    _send_all(sock, [_confirmation(keys, b"client", transcript)])
    return StreamConnection(sock, keys, mode)


def server_handshake(
    sock: socket.socket, key: bytes | Mapping[bytes, bytes], mode: Mode = "encrypt"
) -> StreamConnection:
    """Accept a connection as the server; StreamAuthError (nothing more sent) unless the client proves its key.
    `key`: the stream key, or the stream keys this server accepts by their deployment key's id (the client names
    one in its hello; an unknown id is answered with this side's random bytes and no confirmation, so the client
    reports the key unproven, and then cut)."""
    hello = _recv_bytes(sock, HELLO.size)
    magic, their_mode, key_id, theirs = HELLO.unpack(hello)
    if magic != MAGIC:
        raise StreamAuthError("kv stream: not a kv stream client")
    mine = os.urandom(RANDOM_BYTES)
    head = struct.pack(f">4sB{RANDOM_BYTES}s", MAGIC, _MODES[mode], mine)
    if not isinstance(key, bytes | bytearray):
        found = key.get(key_id)
        if found is None:  # answered without a confirmation: the client says the key was not proven
            _send_all(sock, [head + bytes(CONFIRM)])
            raise StreamAuthError(f"kv stream: a client named a key this worker does not accept ({key_id.hex()})")
        key = found
    if their_mode != _MODES[mode]:  # answered, so the client can name both modes; no key material in it
        _send_all(sock, [head + bytes(CONFIRM)])
        raise StreamAuthError(f"kv stream: a client asked for mode {their_mode}, this worker serves {mode!r}")
    keys = _session_keys(key, mode, theirs, mine, client=False)
    transcript = hello + head
    _send_all(sock, [head + _confirmation(keys, b"server", transcript)])
    theirs_confirm = _recv_bytes(sock, CONFIRM)
    if not hmac.compare_digest(theirs_confirm, _confirmation(keys, b"client", transcript)):
        raise StreamAuthError("kv stream: a client did not prove the deployment key")
    return StreamConnection(sock, keys, mode)


class StreamConnection:
    """One authenticated connection: sealed frames each way, in order. Not thread-safe (one user at a time)."""

    def __init__(self, sock: socket.socket, keys: _Keys, mode: Mode) -> None:
        self.sock = sock
        self.mode = mode
        self._keys = keys
        self._sent = 0  # frames sealed (the send nonce)
        self._received = 0  # frames opened (the receive nonce)
        self._out = bytearray(0)  # sealed payloads (encrypt mode), reused
        self._in = bytearray(0)  # received sealed payloads (encrypt mode), reused
        self._header = bytearray(HEADER.size)
        self.closed = False

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return counter.to_bytes(12, "big")

    def send(self, kind: int, index: int, payload) -> None:
        """Seal and send one frame. `payload`: any contiguous buffer (numpy array, bytes, memoryview)."""
        data = memoryview(payload).cast("B")
        header = HEADER.pack(len(data), index, kind)
        nonce = self._nonce(self._sent)
        self._sent += 1
        if self.mode == "encrypt":
            need = len(data) + TAG
            if len(self._out) < need:
                self._out = bytearray(need)
            out = memoryview(self._out)[:need]
            self._keys.send.encrypt_into(nonce, data, header, out)
            _send_all(self.sock, [header, out])
        else:
            sealed = self._keys.send.encrypt(nonce, header, data)
            _send_all(self.sock, [header, data, sealed])

    def recv_header(self, max_bytes: int) -> tuple[int, int, int]:
        """(kind, index, payload bytes) of the next frame; its payload must then be read (`recv_into`)."""
        _recv_exact(self.sock, memoryview(self._header))
        length, index, kind = HEADER.unpack(self._header)
        if length > max_bytes:
            raise StreamAuthError(f"kv stream: a frame of {length} bytes (at most {max_bytes} taken)")
        return kind, index, length

    def recv_into(self, out: memoryview) -> None:
        """Read and open the payload of the frame whose header was just read, into `out` (exactly its length)."""
        out = out.cast("B") if out.format != "B" else out
        header = bytes(self._header)
        nonce = self._nonce(self._received)
        self._received += 1
        try:
            if self.mode == "encrypt":
                need = len(out) + TAG
                if len(self._in) < need:
                    self._in = bytearray(need)
                sealed = memoryview(self._in)[:need]
                _recv_exact(self.sock, sealed)
                self._keys.recv.decrypt_into(nonce, sealed, header, out)
            else:
                _recv_exact(self.sock, out)
                sealed = _recv_bytes(self.sock, HEADER.size + TAG)
                if self._keys.recv.decrypt(nonce, sealed, out) != header:
                    raise StreamAuthError("kv stream: a frame's header does not match its sealed copy")
        except TransferError:
            raise
        except Exception as exc:  # cryptography's InvalidTag
            raise StreamAuthError(f"kv stream: a frame did not open ({type(exc).__name__})") from None

    def recv(self, max_bytes: int) -> tuple[int, int, bytearray]:
        """The next frame whole: (kind, index, payload)."""
        kind, index, length = self.recv_header(max_bytes)
        payload = bytearray(length)
        self.recv_into(memoryview(payload))
        return kind, index, payload

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


def shut(sock: socket.socket) -> None:
    """Shut both directions of `sock` (a thread blocked on it returns), ignoring a socket already gone."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


CONNECT_POLL_S = 0.02
"""How often a connect in progress checks whether its load failed meanwhile."""


def connect(address: tuple[str, int], timeout_s: float, stopped: Callable[[], bool], tries: int = 1) -> socket.socket:
    """A TCP connection to `address` (each of its addresses in turn, as `socket.create_connection`), blocking once
    made. Each connect waits at most `timeout_s`, and one that timed out is made again up to `tries` connects in
    all; TimeoutError when the last timed out. TransferError as soon as `stopped()` (checked every CONNECT_POLL_S):
    a connect to a host that went silent holds no thread past its load's failure."""
    for _ in range(tries - 1):
        with contextlib.suppress(TimeoutError):
            return _connect_once(address, timeout_s, stopped)
    return _connect_once(address, timeout_s, stopped)


def _connect_once(address: tuple[str, int], timeout_s: float, stopped: Callable[[], bool]) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    error: OSError = OSError(f"no address for {address[0]}")
    for family, kind, proto, _, addr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
                while not poller.poll(max(1, round(min(deadline - time.monotonic(), CONNECT_POLL_S) * 1000))):
                    if stopped():
                        raise TransferError("stopped: another part of the load failed")
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"no connection within {timeout_s:g} s")
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            sock.setblocking(True)
            return sock
        except (TimeoutError, TransferError):
            sock.close()
            raise
        except OSError as exc:  # refused or unreachable at this address: the next one
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error
