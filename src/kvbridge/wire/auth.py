"""Authentication with the deployment's shared key: side-channel frames and kv_transfer_params, HMAC-SHA256.

Why HMAC over each message rather than ZMQ CURVE: the secret a deployment already has to distribute is one key
(the prefill signs the kv_transfer_params that clients carry to a decode instance, and only a shared key lets the
decode verify them without another round trip), so the side channel uses the same key and nothing else: no
per-worker key pairs to provision, no ZAP handler thread, no libsodium requirement in pyzmq builds. What it does
not give is confidentiality of the side channel: handshakes carry addresses and NIXL metadata, not KV; the KV
itself moves over NIXL/UCX (use RDMA or a private network, or UCX's own transports' protection).

A sealed frame is

    b"KVB1" | timestamp (8 bytes, ms, big-endian) | nonce (16 bytes) | mac (32 bytes) | body

with mac = HMAC(key, domain | kind | destination | timestamp | nonce | body). A request (kind Q) carries a fresh
random nonce and names the port it is sent to (a frame captured on its way to one worker is not taken by another);
its answer (kind A) carries the request's nonce, so an answer can only be taken for the request it answers.
The server accepts a request once: its timestamp must be within `window_s` of the server's clock, and its nonce
unseen in that window (seen nonces are remembered for the window, a bounded number of them). Everything that
fails is dropped without an answer and counted by reason: an unauthenticated peer learns nothing, not even why.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from kvbridge.core.errors import ConfigError

MAGIC = b"KVB1"
_DOMAIN = b"kvbridge-side-channel-v1|"
_HEADER = len(MAGIC) + 8 + 16 + 32
MIN_KEY_BYTES = 16


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the auth key has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


def load_key(value: str | None, path: str | None) -> bytes | None:
    """The deployment key from a config value or a file (surrounding whitespace stripped); None if neither."""
    if value and path:
        raise ConfigError("give auth_key or auth_key_file, not both")
    if path:
        try:
            with open(os.path.expanduser(path), "rb") as f:
                return check_key(f.read().strip())
        except OSError as exc:
            raise ConfigError(f"auth_key_file {path!r} cannot be read: {exc.strerror}") from None
    if value:
        return check_key(value.encode())
    return None


class Sealer:
    """Seals and opens side-channel frames with one key. Thread-safe for sealing; `open_request` is meant for
    one server thread (it keeps the seen nonces)."""

    def __init__(
        self,
        key: bytes,
        *,
        window_s: float = 30.0,
        max_nonces: int = 1 << 18,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = check_key(key)
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten
        self.dropped: Counter[str] = Counter()

    def _mac(self, kind: bytes, ts: bytes, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, _DOMAIN + kind + ts + nonce + body, hashlib.sha256).digest()

    def _seal(self, kind: bytes, nonce: bytes, body: bytes) -> bytes:
        ts = int(self.clock() * 1000).to_bytes(8, "big")
        return MAGIC + ts + nonce + self._mac(kind, ts, nonce, body) + body

    def _open(self, kind: bytes, frame: bytes) -> tuple[bytes, bytes, float] | None:
        """(body, nonce, timestamp); `kind` includes the destination for requests."""
        """(body, nonce, timestamp) if the frame is sealed with our key, else None (counted)."""
        if len(frame) < _HEADER or not frame.startswith(MAGIC):
            self.dropped["unauthenticated"] += 1
            return None
        ts, nonce, mac = frame[4:12], frame[12:28], frame[28:60]
        body = frame[_HEADER:]
        if not hmac.compare_digest(mac, self._mac(kind, ts, nonce, body)):
            self.dropped["unauthenticated"] += 1
            return None
        return body, nonce, int.from_bytes(ts, "big") / 1000

    def seal_request(self, body: bytes, dest: int = 0) -> tuple[bytes, bytes]:
        """(frame, nonce) of a request to the side channel on port `dest`: keep the nonce to open the answer."""
        nonce = secrets.token_bytes(16)
        return self._seal(b"Q%d|" % dest, nonce, body), nonce

    def open_request(self, frame: bytes, dest: int = 0) -> tuple[bytes, bytes] | None:
        """(body, nonce) of an authentic, fresh, first-seen request to port `dest`; None otherwise (drop it)."""
        opened = self._open(b"Q%d|" % dest, frame)
        if opened is None:
            return None
        body, nonce, ts = opened
        now = self.clock()
        if abs(now - ts) > self.window_s:
            self.dropped["stale"] += 1
            return None
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            self.dropped["replayed"] += 1
            return None
        if len(self._seen) >= self.max_nonces:  # only key holders get here: refuse rather than forget
            self.dropped["overloaded"] += 1
            return None
        self._seen[nonce] = ts + self.window_s  # older frames are refused as stale from then on
        return body, nonce

    def seal_answer(self, body: bytes, nonce: bytes) -> bytes:
        return self._seal(b"A", nonce, body)

    def open_answer(self, frame: bytes, nonce: bytes) -> bytes | None:
        """The body of the authentic answer to the request sent with `nonce`, or None."""
        opened = self._open(b"A", frame)
        if opened is None:
            return None
        body, their_nonce, _ = opened
        if not hmac.compare_digest(their_nonce, nonce):
            self.dropped["unrelated"] += 1
            return None
        return body


def sign(key: bytes, domain: bytes, payload: bytes) -> str:
    """A hex HMAC of `payload` under `domain` (kv_transfer_params, release requests)."""
    return hmac.new(key, domain + b"|" + payload, hashlib.sha256).hexdigest()


def verify(key: bytes, domain: bytes, payload: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(key, domain, payload), signature or "")
