"""Authentication and encryption with the deployment's shared key: side-channel frames and kv_transfer_params.

Why a sealed frame rather than ZMQ CURVE: the secret a deployment already has to distribute is one key (the
prefill signs the kv_transfer_params that clients carry to a decode instance, and only a shared key lets the
decode verify them without another round trip), so the side channel uses the same key and nothing else: no
per-worker key pairs to provision and pin, no ZAP handler thread, no libsodium requirement in pyzmq builds. CURVE
would authenticate a *key pair*, not the deployment: keying it by the deployment key means deriving every
worker's pair from it, which is this scheme with more moving parts. The KV itself moves over NIXL/UCX, which
this does not protect (use RDMA or a private network); what it protects is what lets anyone read that KV: the
handshake's NIXL agent metadata and memory map, and the per-request tokens.

A sealed frame (version 2: `KVB2`; a `KVB1` frame of version 1 is dropped and counted as "old_format") is

    b"KVB2" | kind (1: Q or A) | timestamp (8, ms) | nonce (16) | binding (16) | ciphertext | mac (32)

Encrypt-then-MAC with two keys derived from the deployment key (HKDF-style, one HMAC each):
  enc_key = HMAC(key, "kvbridge-enc-v1"), mac_key = HMAC(key, "kvbridge-mac-v1");
  ciphertext = body XOR SHAKE-256(enc_key | kind | nonce) (a keyed XOF as a stream cipher, the construction
  under NIST's KMAC; every frame has a fresh random nonce, so no keystream is used twice);
  mac = HMAC-SHA256(mac_key, everything before it). The MAC is checked before anything is decrypted.
The binding of a request (kind Q) is the digest of its destination: the prefill engine id, its dp/pp/tp worker
and port (`destination`), so a request captured on its way to one worker is dropped ("misaddressed") by any
other, on any host. The binding of an answer (kind A) is its request's nonce, so an answer can only be taken for
the request it answers. A server accepts a request once: its timestamp must be within `window_s` of the
server's clock, and its nonce unseen in that window (seen nonces are remembered for the window, a bounded number
of them). Everything that fails is dropped without an answer and counted by reason: an unauthenticated peer
learns nothing, not even why, and an on-path observer learns only sizes and timing.
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

MAGIC = b"KVB2"
OLD_MAGICS = (b"KVB1",)
_HEADER = len(MAGIC) + 1 + 8 + 16 + 16
_MAC = 32
OVERHEAD = _HEADER + _MAC
"""Bytes a sealed frame adds to its body."""
MIN_KEY_BYTES = 16


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the auth key has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


def destination(port: int, engine_id: str = "", dp_rank: int = 0, pp: int = 0, tp: int = 0) -> bytes:
    """The identity a sealed request is bound to: the prefill worker (engine id, dp, pp, tp) and its port. Both ends
    compute it, the server for itself, the client from the kv_transfer_params it was given."""
    return f"{engine_id}|dp{dp_rank}|pp{pp}|tp{tp}|{port}".encode()


def _binding(dest: bytes | int) -> bytes:
    label = destination(dest) if isinstance(dest, int) else dest
    return hashlib.sha256(b"kvbridge-dest-v1|" + label).digest()[:16]


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
        key = check_key(key)
        self._enc_key = hmac.new(key, b"kvbridge-enc-v1", hashlib.sha256).digest()
        self._mac_key = hmac.new(key, b"kvbridge-mac-v1", hashlib.sha256).digest()
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten
        self.dropped: Counter[str] = Counter()

    def _crypt(self, kind: bytes, nonce: bytes, data: bytes) -> bytes:
        if not data:
            return data
        stream = hashlib.shake_256(self._enc_key + kind + nonce).digest(len(data))
        return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")

    def _seal(self, kind: bytes, binding: bytes, body: bytes) -> tuple[bytes, bytes]:
        nonce = secrets.token_bytes(16)
        ts = int(self.clock() * 1000).to_bytes(8, "big")
        sealed = MAGIC + kind + ts + nonce + binding + self._crypt(kind, nonce, body)
        return sealed + hmac.new(self._mac_key, sealed, hashlib.sha256).digest(), nonce

    def _open(self, kind: bytes, frame: bytes) -> tuple[bytes, bytes, bytes, float] | None:
        """(ciphertext, nonce, binding, timestamp) if the frame is a `kind` frame sealed with our key, else None
        (counted). Nothing is decrypted before its MAC is checked."""
        if len(frame) < OVERHEAD or not frame.startswith(MAGIC):
            self.dropped["old_format" if frame[:4] in OLD_MAGICS else "unauthenticated"] += 1
            return None
        sealed, mac = frame[:-_MAC], frame[-_MAC:]
        if not hmac.compare_digest(mac, hmac.new(self._mac_key, sealed, hashlib.sha256).digest()):
            self.dropped["unauthenticated"] += 1
            return None
        if frame[4:5] != kind:
            self.dropped["unrelated"] += 1
            return None
        ts, nonce, binding = frame[5:13], frame[13:29], frame[29:45]
        return sealed[_HEADER:], nonce, binding, int.from_bytes(ts, "big") / 1000

    def seal_request(self, body: bytes, dest: bytes | int = 0) -> tuple[bytes, bytes]:
        """(frame, nonce) of a request to the worker `dest` names (a `destination`; an int: a port, no engine
        identity): keep the nonce to open the answer."""
        return self._seal(b"Q", _binding(dest), body)

    def open_request(self, frame: bytes, dest: bytes | int = 0) -> tuple[bytes, bytes] | None:
        """(body, nonce) of an authentic, fresh, first-seen request to `dest`; None otherwise (drop it)."""
        opened = self._open(b"Q", frame)
        if opened is None:
            return None
        ciphertext, nonce, binding, ts = opened
        if not hmac.compare_digest(binding, _binding(dest)):
            self.dropped["misaddressed"] += 1
            return None
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
        return self._crypt(b"Q", nonce, ciphertext), nonce

    def seal_answer(self, body: bytes, nonce: bytes) -> bytes:
        """The sealed answer to the request sent with `nonce` (its own nonce is fresh)."""
        return self._seal(b"A", nonce, body)[0]

    def open_answer(self, frame: bytes, nonce: bytes) -> bytes | None:
        """The body of the authentic answer to the request sent with `nonce`, or None."""
        opened = self._open(b"A", frame)
        if opened is None:
            return None
        ciphertext, their_nonce, binding, _ = opened
        if not hmac.compare_digest(binding, nonce):
            self.dropped["unrelated"] += 1
            return None
        return self._crypt(b"A", their_nonce, ciphertext)


def sign(key: bytes, domain: bytes, payload: bytes) -> str:
    """A hex HMAC of `payload` under `domain` (kv_transfer_params, release requests)."""
    return hmac.new(key, domain + b"|" + payload, hashlib.sha256).hexdigest()


def verify(key: bytes, domain: bytes, payload: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(key, domain, payload), signature or "")
