"""Sealed side-channel frames and signed kv_transfer_params, with the deployment's keys (`wire.keys`).

Why a sealed frame rather than ZMQ CURVE: the secret a deployment already has to distribute is one key (the
prefill signs the kv_transfer_params that clients carry to a decode instance, and only a shared key lets the
decode verify them without another round trip), so the side channel uses the same key and nothing else: no
per-worker key pairs to provision and pin, no ZAP handler thread, no libsodium requirement in pyzmq builds.

A sealed frame (format 3: `KVB3`; `KVB1` and `KVB2` frames of earlier formats are dropped and counted as
"old_format") is

    header = b"KVB3" | kind (1: Q, A or S) | key id (8) | timestamp (8, ms) | nonce (12) | binding (16)
    frame  = header | AES-256-GCM(frames key of `key id`, nonce, body, associated data = header)

AES-GCM comes from `cryptography` (chosen over ChaCha20-Poly1305 by bench/auth_cost.py: faster on both a 16 MiB
and a small frame here, bench/results/auth-seal-cost-*.json); nothing here builds a cipher. The frames key is
derived from the deployment key (`wire.keys`); the key id says which of an instance's accepted keys sealed a frame,
and an answer is sealed with its request's key. Nonces count up from a random start per `Sealer`, so none repeats
within a sealer and two sealers' ranges overlap only with negligible probability.

The binding of a request (kind Q) is the digest of its destination: the prefill engine id, its dp/pp/tp worker
and port (`destination`), so a request captured on its way to one worker is dropped ("misaddressed") by any
other. The binding of an answer (kinds A and S) is its request's nonce, so an answer can only be taken for the
request it answers. A server accepts a request once: its timestamp must be within `window_s` of the server's
clock, and its nonce unseen in that window (seen nonces are remembered for the window, a bounded number of them).

Freshness without synchronized clocks: a server answers an authentic request whose timestamp is outside its
window with a sealed "stale" answer (kind S) that carries the server's clock and nothing else. The client then
knows the server's clock offset, keeps it for that destination, and seals its next attempt with the server's time
(`ClockSkew`): a host whose clock is off works after one extra round trip, and a request that is still stale
raises an error naming the measured skew. Everything else that fails is dropped without an answer and counted by
reason: an unauthenticated peer learns nothing, not even why.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvbridge.core.errors import ProtocolError
from kvbridge.wire.keys import KEY_ID_BYTES, DeploymentKey, KeyRing

MAGIC = b"KVB3"
OLD_MAGICS = (b"KVB1", b"KVB2")
_NONCE = 12
_BINDING = 16
_HEADER = len(MAGIC) + 1 + KEY_ID_BYTES + 8 + _NONCE + _BINDING
_TAG = 16
OVERHEAD = _HEADER + _TAG
"""Bytes a sealed frame adds to its body."""
_KEY_AT, _TS_AT = 5, 5 + KEY_ID_BYTES
_NONCE_AT = _TS_AT + 8
_BINDING_AT = _NONCE_AT + _NONCE
MAX_OFFSETS = 4096
"""Destinations whose clock offset a sealer remembers (least recently measured first out)."""


class ClockSkew(ProtocolError):
    """A server refused a request as stale: its clock differs from ours by `skew_s` (theirs minus ours)."""

    def __init__(self, skew_s: float, window_s: float | None = None) -> None:
        self.skew_s = skew_s
        within = f" (its window: {window_s:g} s)" if window_s is not None else ""
        super().__init__(
            f"the side-channel peer's clock differs from this host's by {skew_s:+.1f} s and it refused a request "
            f"as stale{within}: fix the clocks (NTP), or check that the peer's clock is not jumping"
        )


def destination(port: int, engine_id: str = "", dp_rank: int = 0, pp: int = 0, tp: int = 0) -> bytes:
    """The identity a sealed request is bound to: the prefill worker (engine id, dp, pp, tp) and its port. Both ends
    compute it, the server for itself, the client from the kv_transfer_params it was given."""
    return f"{engine_id}|dp{dp_rank}|pp{pp}|tp{tp}|{port}".encode()


def _binding(dest: bytes | int) -> bytes:
    label = destination(dest) if isinstance(dest, int) else dest
    return hashlib.sha256(b"kvbridge-dest-v1|" + label).digest()[:_BINDING]


def _answer_binding(nonce: bytes) -> bytes:
    return nonce.ljust(_BINDING, b"\0")


class Sealer:
    """Seals and opens side-channel frames with an instance's keys (`wire.keys.KeyRing`, or one deployment key's
    bytes). Thread-safe for sealing and opening answers; `open_request` is meant for one server thread (it keeps
    the seen nonces).

    A request's "ticket" (what `seal_request` returns and `open_request` gives the server) is its nonce and key id:
    the answer is sealed with that key, for that nonce."""

    def __init__(
        self,
        key: bytes | KeyRing,
        *,
        window_s: float = 30.0,
        max_nonces: int = 1 << 18,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = KeyRing.of(key)
        self._aead = {k.key_id: AESGCM(k.frames) for k in self.keys.all}
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._counter = itertools.count(int.from_bytes(secrets.token_bytes(_NONCE), "big"))
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten
        self.offsets: OrderedDict[bytes, float] = OrderedDict()  # destination binding -> its clock minus ours
        self._offsets_lock = threading.Lock()
        self.dropped: Counter[str] = Counter()

    def _nonce(self) -> bytes:
        return (next(self._counter) % (1 << (8 * _NONCE))).to_bytes(_NONCE, "big")  # next() is atomic

    def _seal(self, key: DeploymentKey, kind: bytes, binding: bytes, body: bytes, now: float) -> tuple[bytes, bytes]:
        nonce = self._nonce()
        header = MAGIC + kind + key.key_id + int(now * 1000).to_bytes(8, "big", signed=True) + nonce + binding
        aead = self._aead[key.key_id]
        if len(body) < 1 << 16 or not hasattr(aead, "encrypt_into"):  # encrypt_into: cryptography 46+
            return header + aead.encrypt(nonce, body, header), nonce
        frame = bytearray(_HEADER + len(body) + _TAG)  # a large body is copied once, not twice
        frame[:_HEADER] = header
        aead.encrypt_into(nonce, body, header, memoryview(frame)[_HEADER:])
        return frame, nonce

    def _open(self, kind: bytes, frame: bytes) -> tuple[bytes, bytes, bytes, float, bytes] | None:
        """(body, nonce, binding, timestamp, key id) if the frame is a `kind` frame sealed with one of our keys,
        else None (counted). The header is authenticated with the body (associated data)."""
        if len(frame) < OVERHEAD or not frame.startswith(MAGIC):
            self.dropped["old_format" if bytes(frame[:4]) in OLD_MAGICS else "unauthenticated"] += 1
            return None
        header = bytes(frame[:_HEADER])  # small fields copied; the body is read in place
        aead = self._aead.get(header[_KEY_AT:_TS_AT])
        if aead is None:
            self.dropped["unauthenticated"] += 1
            return None
        nonce = header[_NONCE_AT:_BINDING_AT]
        try:
            body = aead.decrypt(nonce, memoryview(frame)[_HEADER:], header)
        except InvalidTag:
            self.dropped["unauthenticated"] += 1
            return None
        if header[4:5] != kind and not (kind == b"A" and header[4:5] == b"S"):
            self.dropped["unrelated"] += 1
            return None
        ts = int.from_bytes(header[_TS_AT:_NONCE_AT], "big", signed=True) / 1000
        return body, nonce, header[_BINDING_AT:], ts, header[_KEY_AT:_TS_AT]

    def seal_request(self, body: bytes, dest: bytes | int = 0) -> tuple[bytes, bytes]:
        """(frame, ticket) of a request to the worker `dest` names (a `destination`; an int: a port, no engine
        identity), timed by that worker's clock as last measured (`offsets`): keep the ticket to open the
        answer."""
        binding = _binding(dest)
        with self._offsets_lock:
            now = self.clock() + self.offsets.get(binding, 0.0)
        frame, nonce = self._seal(self.keys.current, b"Q", binding, body, now)
        return frame, nonce + self.keys.current.key_id

    def open_request(self, frame: bytes, dest: bytes | int = 0) -> tuple[bytes | None, bytes] | None:
        """(body, ticket) of an authentic, fresh, first-seen request to `dest`; (None, ticket) of an authentic one
        that is stale (answer it with `seal_stale`); None otherwise (drop it)."""
        opened = self._open(b"Q", frame)
        if opened is None:
            return None
        body, nonce, binding, ts, key_id = opened
        if not hmac.compare_digest(binding, _binding(dest)):
            self.dropped["misaddressed"] += 1
            return None
        now = self.clock()
        if abs(now - ts) > self.window_s:
            self.dropped["stale"] += 1
            return None, nonce + key_id
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            self.dropped["replayed"] += 1
            return None
        if len(self._seen) >= self.max_nonces:  # only key holders get here: refuse rather than forget
            self.dropped["overloaded"] += 1
            return None
        self._seen[nonce] = ts + self.window_s  # older frames are refused as stale from then on
        return body, nonce + key_id

    def _ticket_key(self, ticket: bytes) -> DeploymentKey:
        key = self.keys.get(ticket[_NONCE:])
        if key is None or len(ticket) != _NONCE + KEY_ID_BYTES:
            raise ValueError("not a ticket of this sealer's keys")
        return key

    def seal_answer(self, body: bytes, ticket: bytes) -> bytes:
        """The sealed answer to the request `ticket` names, with its key (its own nonce is fresh)."""
        return self._seal(self._ticket_key(ticket), b"A", _answer_binding(ticket[:_NONCE]), body, self.clock())[0]

    def seal_stale(self, ticket: bytes) -> bytes:
        """The answer to an authentic request refused as stale: no body, this server's clock in its header."""
        key = self._ticket_key(ticket)
        return self._seal(key, b"S", _answer_binding(ticket[:_NONCE]), b"", self.clock())[0]

    def open_answer(self, frame: bytes, ticket: bytes, dest: bytes | int | None = None) -> bytes | None:
        """The body of the authentic answer to the request `ticket` names, or None. A stale answer raises
        ClockSkew; with `dest` (the request's destination) the server's clock offset is kept for the next
        request to it."""
        opened = self._open(b"A", frame)
        if opened is None:
            return None
        body, _, binding, ts, key_id = opened
        if not hmac.compare_digest(binding, _answer_binding(ticket[:_NONCE])) or key_id != ticket[_NONCE:]:
            self.dropped["unrelated"] += 1
            return None
        if frame[4:5] == b"S":  # authenticated (the header is associated data)
            skew = ts - self.clock()
            if dest is not None:
                where = _binding(dest)
                with self._offsets_lock:
                    self.offsets[where] = skew
                    self.offsets.move_to_end(where)
                    while len(self.offsets) > MAX_OFFSETS:
                        self.offsets.popitem(last=False)
            raise ClockSkew(skew)
        return body


def sign(key: bytes, domain: bytes, payload: bytes) -> str:
    """A hex HMAC-SHA256 of `payload` under `domain` with a derived key (`DeploymentKey.params`)."""
    return hmac.new(key, domain + b"|" + payload, hashlib.sha256).hexdigest()


def verify(key: bytes, domain: bytes, payload: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(key, domain, payload), signature or "")
