"""The side channel's messages: tagged msgspec structs, one union, one encoder and one decoder.

Every message is a map whose "type" key names it (its tag), encoded with msgpack. A decode worker asks each
prefill worker it reads from for that worker's metadata (`HandshakeRequest`); the prefill worker answers with
its `HandshakeReply` or a `HandshakeRefused` naming the first field that does not match. After the handshake,
per-request messages (`Notify`, `Abort`) and a reader's `Ping` travel on the same channel and are answered with
`Ack`. Anything that cannot be decoded is answered with `ErrorReply`.

Schema evolution (msgspec's rules, as in its docs/schema-evolution.rst):
- A new field is added with a default value, so that a peer that does not send it is still understood.
  Unknown fields are ignored on decode, so an older peer understands a newer one.
- Fields are never removed, renamed or retyped, and tags never change; new messages get new tags.
- All structs are keyword-only, so a field may be added anywhere in a class.
- `PROTOCOL_VERSION` is bumped only for a change an older peer cannot read correctly (a changed meaning, a
  removed field); peers whose versions differ refuse each other in the handshake.

Nested structs mirror the core dataclasses (`topology.ParallelLayout`, `topology.WorkerRank`,
`topology.KVGeometry`, `memory.Region`, `memory.LayerKV`, `memory.WorkerMemory`) field for field and convert
with `from_core`/`to_core`. Decoding checks types, ranges and each struct's own invariants (the core
dataclasses' checks); `check_compatible` then compares two peers and checks that a peer's handshake agrees
with itself.

The handshake's messages and the nested structs are defined in `handshake_messages` and re-exported here, so
that every message is imported from this module and the one union (`Message`) lists them all.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Annotated

import msgspec

from kvbridge.core.errors import IncompatiblePeerError, LayoutError, ProtocolError
from kvbridge.core.model_identity import ModelFingerprint
from kvbridge.core.token_runs import VERIFIED_FORMATS
from kvbridge.wire.handshake_messages import (  # every name re-exported: messages are imported from here
    PROTOCOL_VERSION,  # noqa: F401
    Digest,  # noqa: F401
    Geometry,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    Id,
    IpcRegion,  # noqa: F401
    Layer,  # noqa: F401
    Layout,  # noqa: F401
    Memory,  # noqa: F401
    Model,  # noqa: F401
    NonNegative,
    Peer,
    Planes,  # noqa: F401
    Positive,
    Region,  # noqa: F401
    Secret,
    Worker,
    _Message,
)

# --- per-request messages ---------------------------------------------------------------------------------


class Notify(_Message, tag="notify", kw_only=True):
    """Decode worker -> prefill worker: `worker` of decode engine `engine_id` finished reading `request_id`.

    The prefill worker frees the request's blocks once every reader the plan names has notified it.
    Notifications may be retried, so handlers must treat a repeated one as a no-op.
    """

    request_id: Id
    engine_id: Id
    worker: Worker
    expected: Positive = 1
    """How many notifications the prefill worker gets for this request in all (one per decode worker)."""
    token: Secret = ""
    """The request's secret token (from its kv_transfer_params): without it a notification frees nothing."""


class Claim(_Message, tag="claim", kw_only=True):
    """Decode worker -> prefill worker, before reading: is `request_id` held here, with these blocks?

    Answered by Ack, or ErrorReply saying why not (unknown, finished, lease expired, blocks not the request's):
    a decode side must never read blocks that no longer, or never did, hold the request's KV. A granted claim
    pins the request for this decode engine for `read_timeout_s` (plus a margin): no lease expiry under the read.
    The blocks read, as the params carry them: `block_ids` for one KV-cache group, or per group
    `group_block_ids` (`block_ids` then empty).
    """

    request_id: Id
    block_ids: Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=1 << 16)]
    engine_id: Id
    worker: Worker
    token: Secret = ""
    prompt_hash: Secret = ""
    read_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    blocks_digest: Secret = ""  # core.leases.groups_digest of the request's block lists as its params publish them
    group_block_ids: Annotated[
        tuple[Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=1 << 16)], ...], msgspec.Meta(max_length=64)
    ] = ()
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0
    """How long the prefill worker may keep the claim of a request it does not hold yet, answering it once the hold
    comes (it learns of a hold one engine step after the client got the params): the reader waits on that answer
    instead of retrying. 0: answer at once (and an older prefill worker always answers at once)."""
    issued: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """When the prefill issued the params claimed (their `remote_issued`; 0: not said): a worker started after
    that is another run, which never held the request, and answers at once instead of waiting for its hold."""

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The blocks read per KV-cache group."""
        return self.group_block_ids or (self.block_ids,)

    @staticmethod
    def blocks_of(groups: tuple[tuple[int, ...], ...]) -> dict[str, tuple]:
        """The block fields of a claim of `groups` (per KV-cache group): one group's list in `block_ids`."""
        if len(groups) == 1:
            return {"block_ids": groups[0]}
        return {"block_ids": (), "group_block_ids": groups}


class Abort(_Message, tag="abort", kw_only=True):
    """Decode worker (or the proxy) -> prefill worker: `request_id` will not be read (the load failed, timed
    out or was cancelled, or the decode leg never happened): free its blocks now. Needs the request's token."""

    request_id: Id
    engine_id: Id
    worker: Worker
    reason: Annotated[str, msgspec.Meta(max_length=256)] = ""
    token: Secret = ""


MAX_STAGE_SEGMENTS = 1 << 14
"""The most segments one `Stage` names (heads split per token in a 128-token block, 64 layers: 8192)."""

Address = Annotated[int, msgspec.Meta(ge=0, lt=1 << 56)]


class Stage(_Message, tag="stage", kw_only=True):
    """Decode worker -> prefill worker, after a granted claim (staged NIXL path): gather chunk `chunk` of this
    reader's part of the request into the staging buffer, and answer where it is (`Staged`).

    The part is the runs `length[k]` bytes at `src_addr[k] + b * block_stride[k]` for every block b of `block_ids`
    (in that order), laid out segment-major in chunks of at most `chunk_bytes` (`core.staging.StageLayout`); the
    prefill worker checks every run against its registered memory and the blocks against the claim. `released`:
    the reader has read (and NIXL let go of) every chunk below it, so their slots may be reused. The segments are
    needed only on the first Stage of a request (an empty `src_addr` refers to that one). Repeats are answered
    alike."""

    request_id: Id
    engine_id: Id
    worker: Worker
    token: Secret = ""
    block_ids: Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=1 << 16)] = ()
    src_addr: Annotated[tuple[Address, ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)] = ()
    block_stride: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)], ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)
    ] = ()
    length: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)], ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)
    ] = ()
    chunk_bytes: Positive = 1
    chunk: NonNegative = 0
    released: NonNegative = 0


class Staged(_Message, tag="staged", kw_only=True):
    """The answer to `Stage`: chunk `chunk` (of `chunks`) lies at `offset` in the staging buffer, `nbytes` long."""

    request_id: str = ""
    chunk: NonNegative = 0
    chunks: NonNegative = 0
    offset: NonNegative = 0
    nbytes: NonNegative = 0
    epoch: str = ""


class Ping(_Message, tag="ping", kw_only=True):
    """Decode worker -> prefill worker whose NIXL READs it has had in flight a while: are you there? Answered by
    `Ack` (with the worker's epoch) from the side-channel thread, nothing else done. NIXL says nothing of a READ
    that makes no progress, so the reader asks the side channel instead: a worker that does not answer within the
    answer deadline is silent (stopped, its host or link down) and its READs fail. An older peer cannot decode it
    and answers with an `ErrorReply`, which is an answer all the same: its process runs."""

    engine_id: str = ""
    """The asking decode engine (for the prefill's logs; nothing depends on it)."""


class Ack(_Message, tag="ack", kw_only=True):
    """The answer to `Claim`, `Notify`, `Abort` and `Ping`; `epoch` is the answering worker's (see
    HandshakeReply)."""

    request_id: str = ""
    epoch: str = ""


class Refusal(enum.Enum):
    """Why a prefill worker refused a per-request message: the typed `reason` of an `ErrorReply`, which a reader
    acts on (`message` is for people and logs). An older peer sends none (`ErrorReply.reason` None)."""

    NOT_HELD = "not_held"
    """Claim: no such request held here with that token (unknown, freed, lapsed; or its hold did not come within
    the claim's wait)."""
    MISMATCH = "mismatch"
    """Claim: the prompt hash, the blocks or their order are not the request's."""
    OTHER_READER = "other_reader"
    """Claim: another decode engine claimed the request."""
    NOT_CLAIMED = "not_claimed"
    """Stage: the reader holds no claim of the request (or the blocks are not the request's)."""
    BUSY = "busy"
    """Stage: the staging slots are taken: read this part directly."""
    STAGE = "stage"
    """Stage: the session ended, or the chunk is out of range or no longer staged."""
    REFUSED = "refused"
    """Notify, Abort: no such request held here, or a wrong token (says nothing more to one without it)."""
    UNEXPECTED = "unexpected"
    """A message this side channel does not answer."""


class ErrorReply(_Message, tag="error", kw_only=True):
    """The answer to a message that could not be decoded or handled; `message` says why, `reason` (a refusal of a
    per-request message) says it in a form a reader acts on."""

    message: str
    reason: Refusal | None = None
    final: bool = False
    """A `not_held` claim refusal that asking again cannot change: the request was held here with the claim's token
    and is freed (read, aborted or expired). An older peer never says it (the reader then retries within its
    claim window)."""
    epoch: str = ""
    """The answering worker's epoch, on a claim's refusal (see HandshakeReply): a reader that cached another one
    (the worker restarted on its address) handshakes again rather than asking the new run for the old one's
    request."""


Message = (
    HandshakeRequest
    | HandshakeReply
    | HandshakeRefused
    | Notify
    | Claim
    | Abort
    | Stage
    | Staged
    | Ping
    | Ack
    | ErrorReply
)
MESSAGE_TYPES: tuple[type[_Message], ...] = (
    HandshakeRequest,
    HandshakeReply,
    HandshakeRefused,
    Notify,
    Claim,
    Abort,
    Stage,
    Staged,
    Ping,
    Ack,
    ErrorReply,
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class _VersionProbe(msgspec.Struct):
    protocol_version: int | None = None


_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)
# What msgspec raises for bad input (ValidationError, DecodeError), and what __post_init__ checks raise.
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError)


def encode(message: Message) -> bytes:
    """The message as msgpack bytes."""
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"not a kvbridge message: {type(message).__name__}")
    return _encoder.encode(message)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in `data`; ProtocolError if it is not exactly one valid message."""
    try:
        return _decoder.decode(data)
    except _DECODE_ERRORS as exc:
        what = f"{len(data)} bytes" if isinstance(data, bytes | bytearray | memoryview) else "not bytes"
        raise ProtocolError(f"cannot decode a side-channel message ({what}): {exc}") from exc


def peer_version(data: bytes | bytearray | memoryview) -> int | None:
    """Best effort: the `protocol_version` of a message that may not decode as ours, or None."""
    try:
        return _probe_decoder.decode(data).protocol_version
    except _DECODE_ERRORS:
        return None


# --- compatibility ----------------------------------------------------------------------------------------

_GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_size", "dtype", "kernel")


def _block_size_mismatch(ours: Peer, theirs: Peer) -> tuple[str, object, object] | None:
    """(field, ours, theirs) when the block sizes differ and the tokens cannot be copied one by one: pages of a
    format not checked against its backend's kernel (`core.token_runs.VERIFIED_FORMATS`; "" from older peers and
    backends kvbridge has not checked: pages copied whole), formats that differ, a quantized cache (its in-page
    layout is not checked). None when the block sizes are equal or can differ."""
    mine, other = ours.geometry.block_size, theirs.geometry.block_size
    if mine == other:
        return None
    formats = (ours.token_format(), theirs.token_format())
    if formats[0] != formats[1] or formats[0] not in VERIFIED_FORMATS or ours.geometry.kernel or theirs.geometry.kernel:
        return "block_size", mine, other
    return None


def _scale_mismatch(ours: Geometry, theirs: Geometry) -> tuple[str, object, object] | None:
    """(field, ours, theirs) for the first layer both peers hold whose k_scale or v_scale differs, or for scales on
    one side only (`kv_scales`); None when they agree. The values name the layer: "layer 3: 0.5"."""
    if bool(ours.kv_scales) != bool(theirs.kv_scales):
        return "kv_scales", len(ours.kv_scales), len(theirs.kv_scales)
    other = {layer: (k, v) for layer, k, v in theirs.kv_scales}
    for layer, k, v in ours.kv_scales:
        if layer in other:
            for field, mine, peer in (("k_scale", k, other[layer][0]), ("v_scale", v, other[layer][1])):
                if mine != peer:
                    return field, f"layer {layer}: {mine}", f"layer {layer}: {peer}"
    return None


def check_compatible(ours: Peer, theirs: Peer) -> None:
    """Raise IncompatiblePeerError for the first field on which the peers' KV caches disagree.

    Compared, in order: protocol_version, the geometry (num_layers, num_kv_heads, head_size, dtype, kernel;
    then a quantized cache's k_scale and v_scale on the layers both hold), block_size (which may differ where both
    sides' pages keep tokens addressable: `core.token_runs`), the page format (num_planes, row_bytes) and, where
    both hold state layers (Mamba), the state pages' size (`state_bytes`), then the model fingerprint
    (`core.model_identity`: config, tokenizer, weights, quantization, kv_cache_dtype; the error names the parts
    that differ).
    The physical layout names (`kv_layout`) may differ: descriptors are computed
    from strides. Then each side's own handshake must agree with itself (ProtocolError otherwise): its layout must
    fit the geometry and hold its worker, and a reply's memory must hold every layer of its stage with the KV
    heads of its TP rank.
    """
    if ours.protocol_version != theirs.protocol_version:
        raise IncompatiblePeerError("protocol_version", ours.protocol_version, theirs.protocol_version)
    for field in _GEOMETRY_FIELDS:
        mine, other = getattr(ours.geometry, field), getattr(theirs.geometry, field)
        if mine != other:
            raise IncompatiblePeerError(field, mine, other)
    scales = _scale_mismatch(ours.geometry, theirs.geometry)
    if scales is not None:
        raise IncompatiblePeerError(*scales)
    blocks = _block_size_mismatch(ours, theirs)
    if blocks is not None:
        raise IncompatiblePeerError(*blocks)
    pages = zip(("num_planes", "row_bytes"), ours.page_format(), theirs.page_format(), strict=True)
    for field, mine, other in pages:
        if mine != other:
            raise IncompatiblePeerError(field, mine, other)
    if ours.state_format() and theirs.state_format() and ours.state_format() != theirs.state_format():
        raise IncompatiblePeerError("state_bytes", ours.state_format(), theirs.state_format())
    mine, other = (peer.model.to_core() if peer.model else ModelFingerprint() for peer in (ours, theirs))
    differ = mine.differences(other)
    if differ:
        raise IncompatiblePeerError("model_fingerprint", mine.describe(differ), other.describe(differ))
    for peer in (ours, theirs):
        problem = next(_inconsistencies(peer), None)
        if problem is not None:
            raise ProtocolError(f"handshake of {peer.engine_id} {peer.worker} contradicts itself: {problem}")


def answer_handshake(ours: HandshakeReply, request: HandshakeRequest) -> HandshakeReply | HandshakeRefused:
    """The prefill worker's answer to a request: its reply, or a refusal naming the mismatching field."""
    try:
        check_compatible(ours, request)
        if request.target is not None and request.target != ours.worker:
            raise IncompatiblePeerError("worker", str(ours.worker), str(request.target))
    except IncompatiblePeerError as exc:
        return HandshakeRefused.from_error(exc)
    return ours


def _inconsistencies(peer: Peer) -> Iterator[str]:
    try:
        geometry = peer.geometry.to_core()
        layout = peer.layout.to_core()
        layout.check(geometry)
    except LayoutError as exc:
        yield str(exc)
        return
    if not isinstance(peer, HandshakeReply):
        return
    rank = peer.worker.rank
    stage = layout.stage_layers(geometry.num_layers, rank.pp)
    heads = len(layout.kv_heads(geometry.num_kv_heads, rank.tp))
    held = {layer.layer: layer for layer in peer.memory.layers}
    missing = [layer for layer in stage if layer not in held]
    if missing:
        yield f"stage {rank.pp} has layers {stage.start}..{stage.stop - 1} but memory lacks {missing}"
    for layer in held.values():
        if layer.layer >= geometry.num_layers:
            yield f"layer {layer.layer} is outside the model's {geometry.num_layers} layers"
        if layer.state:
            if (layer.num_heads, layer.block_size, layer.num_planes) != (1, 1, 1):
                yield f"state layer {layer.layer} is not one page per block"
            continue
        if layer.num_heads != heads:
            yield f"layer {layer.layer} holds {layer.num_heads} KV heads, tp rank {rank.tp} has {heads}"
        if layer.block_size != geometry.block_size:
            yield f"layer {layer.layer} has block_size {layer.block_size}, geometry {geometry.block_size}"
