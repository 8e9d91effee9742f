"""The exceptions kvbridge raises, in one tree.

    KVBridgeError
    ├── LayoutError(ValueError)        an invalid parallel layout or model geometry
    ├── ConfigError(ValueError)        an invalid kv_connector_extra_config entry
    ├── IncompatiblePeerError          a handshake with a peer whose KV cannot be read as ours
    ├── ProtocolError                  a malformed, truncated or unknown wire message
    ├── TransferError                  a NIXL transfer failed or its peer vanished
    │   ├── TransferTimeout            a transfer or handshake did not finish in time
    │   └── PeerGone                   the peer's process is gone: its port refused or reset the connection
    └── RequestParamsError(ValueError) bad kv_transfer_params from a client
        └── ParamsRefused              params that are well-formed but not this request's to load (`reason`)

Every message names the field that is wrong and, where there are two sides, both values.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base of every error kvbridge raises on purpose."""


class LayoutError(KVBridgeError, ValueError):
    """An invalid parallel layout, rank or model geometry."""


class ConfigError(KVBridgeError, ValueError):
    """An invalid configuration value: the message names the key."""


class IncompatiblePeerError(KVBridgeError):
    """The peer's KV cache cannot be read as ours: the message names the field and both values."""

    def __init__(self, field: str, ours: object, theirs: object) -> None:
        self.field = field
        self.ours = ours
        self.theirs = theirs
        super().__init__(f"incompatible peer: {field} is {ours!r} here but {theirs!r} on the peer")


class ProtocolError(KVBridgeError):
    """A wire message that cannot be decoded or is not expected here."""


class TransferError(KVBridgeError):
    """A transfer failed: NIXL reported an error or the peer disconnected."""


class TransferTimeout(TransferError):
    """A transfer or handshake did not complete within its deadline."""


class HostUnreachable(TransferTimeout):
    """The peer's host did not accept a connection, or acknowledge bytes sent to it, within `link_timeout_s`: the
    host or the link to it is down. Known from TCP, whatever its processes do (never raised for an address of this
    host, whose own kernel answers)."""


class PeerGone(TransferError):
    """The peer's process is gone: its side channel refused the connection, or reset it and then refused a new
    one. Known at once, so no deadline is waited out for it."""


class RequestParamsError(KVBridgeError, ValueError):
    """The kv_transfer_params of a request are missing fields or hold wrong values."""


class ParamsRefused(RequestParamsError):
    """kv_transfer_params that must not be loaded for this request; `reason` is the metric label
    (bad_signature, unsigned, expired, replayed, prompt_length, prompt_hash, layout, blocks, address, malformed;
    epoch: issued before the prefill worker started, refused by a decode worker)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)
