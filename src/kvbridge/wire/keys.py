"""The deployment key and what is derived from it: one key per purpose, a key id, a set of accepted keys.

The deployment key (the master key, `auth_key_file`) never encrypts, signs or authenticates anything itself:
every use gets its own key, derived with HKDF-SHA256 (RFC 5869, from `cryptography`) under a purpose label
(`derive_key`):

    frames   side-channel frames (AEAD, `wire.auth.Sealer`)
    params   the kv_transfer_params signature (HMAC-SHA256, `wire.params.PrefillDone.signed`)
    tokens   request tokens that a prefill worker can check without knowing the request (`request_token`)
    key id   8 bytes naming the key in frames and in signed params (public: HKDF is one-way)

A key must hold at least `MIN_KEY_BYTES` (32 bytes, 256 bits) of material: a key file of hex digits counts half a
byte per digit (`openssl rand -hex 32` gives 64 digits, 32 bytes), any other content a byte per byte.

Rotation, instance by instance: an instance sends with its current key (`auth_key_file`) and accepts that key and
those of `auth_accepted_key_files` (`KeyRing`); frames and signed params name their key by id, and an answer is
sealed with the key its request used. To rotate: add the new key file to every instance's accepted files
(restarting them one at a time), then make it each one's `auth_key_file` with the old one accepted, then drop the
old one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import string
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvbridge.core.errors import ConfigError

MIN_KEY_BYTES = 32
"""The least key material a deployment key may hold (256 bits), checked at startup."""

KEY_ID_BYTES = 8

FRAMES = b"kvbridge side-channel frames v3"
PARAMS = b"kvbridge kv_transfer_params signature v2"
TOKENS = b"kvbridge request tokens v1"
KEY_ID = b"kvbridge key id v1"
STREAM = b"kvbridge/kv-stream/v1"  # the KV channel's key: the same label is transport.kv_stream.PURPOSE (wire may
# not import transport, nor transport wire: tests/test_layers.py; test_kv_stream.py keeps them equal)


def derive_key(master: bytes, purpose: bytes, length: int = 32) -> bytes:
    """A key for one `purpose` (a label no other use shares) from the deployment key: HKDF-SHA256, no salt."""
    if not purpose:
        raise ValueError("a derived key needs a purpose label")
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=purpose).derive(master)


def key_material(key: bytes) -> int:
    """Bytes of key material in `key`: half its length for hex digits only, else its length."""
    if key and all(c in _HEX for c in key):
        return len(key) // 2
    return len(key)


_HEX = frozenset(string.hexdigits.encode())


def check_strength(key: bytes, field: str = "auth_key") -> bytes:
    """`key`, or ConfigError naming `field` if it holds under MIN_KEY_BYTES of material."""
    have = key_material(key)
    if have < MIN_KEY_BYTES:
        what = f"{len(key)} hex digits ({have} bytes)" if have != len(key) else f"{have} bytes"
        raise ConfigError(
            f"kv_connector_extra_config: {field} holds {what} of key material; at least {MIN_KEY_BYTES} bytes "
            f"({2 * MIN_KEY_BYTES} hex digits) are needed: make one with `openssl rand -hex {MIN_KEY_BYTES}` "
            "(kvbridge serve and demo make one)"
        )
    return key


@dataclass(frozen=True, repr=False)
class DeploymentKey:
    """The keys derived from one deployment key (see the module docstring); `key_id` is public."""

    key_id: bytes
    frames: bytes
    params: bytes
    tokens: bytes
    stream: bytes
    """The KV channel's key (`transport.kv_stream`): connections derive theirs from it."""

    @classmethod
    def derive(cls, master: bytes, field: str = "auth_key") -> DeploymentKey:
        check_strength(master, field)
        return cls(
            derive_key(master, KEY_ID, KEY_ID_BYTES),
            derive_key(master, FRAMES),
            derive_key(master, PARAMS),
            derive_key(master, TOKENS),
            derive_key(master, STREAM),
        )

    def __repr__(self) -> str:  # never the keys
        return f"DeploymentKey({self.key_id.hex()})"


class KeyRing:
    """The keys an instance accepts, by id, and the one it sends with (`current`)."""

    def __init__(self, current: DeploymentKey, accepted: Iterable[DeploymentKey] = ()) -> None:
        self.current = current
        self._by_id = {k.key_id: k for k in (current, *accepted)}

    @classmethod
    def of(cls, key: bytes | KeyRing) -> KeyRing:
        """`key` as a ring: a KeyRing as is, a deployment key's bytes as a ring of that key alone."""
        return key if isinstance(key, KeyRing) else _ring(bytes(key))

    def get(self, key_id: bytes) -> DeploymentKey | None:
        return self._by_id.get(key_id)

    @property
    def all(self) -> tuple[DeploymentKey, ...]:
        """Every accepted key, the current one first."""
        return tuple(self._by_id.values())

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(k.hex() for k in self._by_id)

    def __repr__(self) -> str:
        return f"KeyRing(current={self.current.key_id.hex()}, accepted={list(self.ids)})"


@functools.lru_cache(maxsize=16)
def _ring(master: bytes) -> KeyRing:
    return KeyRing(DeploymentKey.derive(master))


def read_key_file(path: str, field: str = "auth_key_file") -> bytes:
    """The key in the file `path` (surrounding whitespace stripped), checked for strength (ConfigError naming
    `field` otherwise)."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"kv_connector_extra_config: {field} {path!r} cannot be read: {exc.strerror}") from None
    return check_strength(key, f"{field} {path!r}")


def load_keys(value: str | None, path: str | None, accepted: Iterable[str] = ()) -> KeyRing | None:
    """The instance's keys from the config (`auth_key` or `auth_key_file`, and `auth_accepted_key_files`); None
    without a key. ConfigError names the field of a missing, unreadable or weak key."""
    accepted = tuple(accepted)
    if value and path:
        raise ConfigError("kv_connector_extra_config: give auth_key or auth_key_file, not both")
    if path:
        current = DeploymentKey.derive(read_key_file(path), f"auth_key_file {path!r}")
    elif value:
        current = DeploymentKey.derive(value.encode(), "auth_key")
    elif accepted:
        raise ConfigError("kv_connector_extra_config: auth_accepted_key_files is set but no auth_key_file")
    else:
        return None
    extra = [
        DeploymentKey.derive(read_key_file(p, "auth_accepted_key_files"), "auth_accepted_key_files") for p in accepted
    ]
    return KeyRing(current, extra)


def request_token(keys: KeyRing, engine_id: str, request_id: str, salt: bytes) -> str:
    """A request's secret token (48 hex): `salt` (8 random bytes) and a MAC of the prefill engine id, the request
    id and the salt under the current tokens key. A prefill worker checks it (`token_is_ours`) before it knows the
    request, so a notification that arrives before its hold is kept only if a key holder sent it."""
    if len(salt) != 8:
        raise ValueError("a token's salt is 8 bytes")
    return salt.hex() + _token_mac(keys.current, engine_id, request_id, salt)


def token_is_ours(keys: KeyRing, engine_id: str, request_id: str, token: str) -> bool:
    """Whether `token` is one `request_token` made for this request under one of `keys`."""
    if len(token) != 48:
        return False
    try:
        salt = bytes.fromhex(token[:16])
    except ValueError:
        return False
    mac = token[16:].encode()
    return any(hmac.compare_digest(_token_mac(k, engine_id, request_id, salt).encode(), mac) for k in keys.all)


def _token_mac(key: DeploymentKey, engine_id: str, request_id: str, salt: bytes) -> str:
    data = b"%d:%s|%d:%s|%s" % (len(engine_id), engine_id.encode(), len(request_id), request_id.encode(), salt)
    return hmac.new(key.tokens, data, hashlib.sha256).hexdigest()[:32]
