"""The side channel's messages: tagged msgspec structs, one union, one encoder and one decoder.

Every message is a map whose "type" key names it (its tag), encoded with msgpack. A decode worker asks each
prefill worker it reads from for that worker's metadata (`HandshakeRequest`); the prefill worker answers with
its `HandshakeReply` or a `HandshakeRefused` naming the first field that does not match. After the handshake,
per-request messages (`Notify`, `Abort`) travel on the same channel and are answered with `Ack`. Anything that
cannot be decoded is answered with `ErrorReply`.

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
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec

from kvbridge.core import memory as mem
from kvbridge.core import topology
from kvbridge.core.errors import IncompatiblePeerError, LayoutError, ProtocolError
from kvbridge.core.model_identity import ModelFingerprint
from kvbridge.core.token_runs import VERIFIED_FORMATS

PROTOCOL_VERSION = 4
"""Bumped only for a change an older peer cannot read correctly (see the module docstring).
2: claims, notifications and aborts carry the request's token (a claim also its prompt hash) and are refused
without it; claims pin the request for the read.
3: sealed frames (wire.auth, `KVB2`) are encrypted and a sealed request is bound to its destination worker's
identity (engine id, dp/pp/tp, port); version-2 sealed frames (`KVB1`) are dropped.
4: sealed frames are AES-GCM from `cryptography` under keys derived with HKDF and named by a key id (`KVB3`;
`KVB1`/`KVB2` frames are dropped as old_format); signed params name their key id."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Id = Annotated[str, msgspec.Meta(max_length=512)]
"""Request and engine ids: bounded, so that nothing a peer sends is kept at any size."""
Secret = Annotated[str, msgspec.Meta(max_length=64)]
Planes = Annotated[int, msgspec.Meta(ge=1, le=2)]


class _Struct(msgspec.Struct, frozen=True):
    """Base of the nested (untagged) structs; each class also sets kw_only (msgspec does not inherit it)."""


# --- nested structs, mirroring the core dataclasses -------------------------------------------------------


class Layout(_Struct, kw_only=True):
    """topology.ParallelLayout: `dp` engines of `pp` stages of `tp` workers."""

    pp: Positive = 1
    tp: Positive = 1
    dp: Positive = 1
    layer_partition: tuple[Positive, ...] | None = None

    def __post_init__(self) -> None:
        self.to_core()

    @classmethod
    def from_core(cls, layout: topology.ParallelLayout) -> Layout:
        return cls(pp=layout.pp, tp=layout.tp, dp=layout.dp, layer_partition=layout.layer_partition)

    def to_core(self) -> topology.ParallelLayout:
        return topology.ParallelLayout(self.pp, self.tp, self.dp, self.layer_partition)


class Worker(_Struct, kw_only=True):
    """One worker of a deployment: its engine's dp rank and its (pp, tp) rank inside the engine."""

    dp_rank: NonNegative = 0
    pp: NonNegative = 0
    tp: NonNegative = 0

    @classmethod
    def from_core(cls, dp_rank: int, rank: topology.WorkerRank) -> Worker:
        return cls(dp_rank=dp_rank, pp=rank.pp, tp=rank.tp)

    @property
    def rank(self) -> topology.WorkerRank:
        return topology.WorkerRank(self.pp, self.tp)

    def check_in(self, layout: topology.ParallelLayout) -> None:
        """Raise LayoutError if this worker is not part of `layout`."""
        if self.dp_rank >= layout.dp:
            raise LayoutError(f"dp rank {self.dp_rank} is outside dp={layout.dp}")
        layout.check_rank(self.rank)

    def __str__(self) -> str:
        return f"dp{self.dp_rank}/pp{self.pp}/tp{self.tp}"


class Geometry(_Struct, kw_only=True):
    """topology.KVGeometry. `dtype` is not checked on decode: an unknown dtype is a mismatch, not garbage."""

    num_layers: Positive
    num_kv_heads: Positive
    head_size: Positive
    dtype: str = "bfloat16"
    block_size: Positive = 16
    kv_scales: tuple[tuple[NonNegative, float, float], ...] = ()
    """A quantized cache's (layer, k_scale, v_scale) per layer the worker holds; empty for an unquantized one."""
    kernel: str = ""
    """A quantized cache's attention backend and kernel variant ("CPU_ATTN/vec"); empty for an unquantized one."""

    @classmethod
    def from_core(cls, geometry: topology.KVGeometry) -> Geometry:
        return cls(
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_size=geometry.head_size,
            dtype=geometry.dtype,
            block_size=geometry.block_size,
            kv_scales=geometry.kv_scales,
            kernel=geometry.kernel,
        )

    def to_core(self) -> topology.KVGeometry:
        return topology.KVGeometry(
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.dtype,
            self.block_size,
            kv_scales=self.kv_scales,
            kernel=self.kernel,
        )


Digest = Annotated[str, msgspec.Meta(max_length=128)]


class Model(_Struct, kw_only=True):
    """model_identity.ModelFingerprint: what shapes the KV beyond the geometry, one digest per part."""

    config: Digest = ""
    tokenizer: Digest = ""
    weights: Digest = ""
    quantization: Digest = ""
    kv_cache_dtype: Digest = ""

    @classmethod
    def from_core(cls, model: ModelFingerprint) -> Model:
        return cls(**{f: getattr(model, f) for f in cls.__struct_fields__})

    def to_core(self) -> ModelFingerprint:
        return ModelFingerprint(**{f: getattr(self, f) for f in self.__struct_fields__})


class Region(_Struct, kw_only=True):
    """memory.Region: one registered allocation."""

    addr: NonNegative
    nbytes: NonNegative
    device_id: int = 0

    @classmethod
    def from_core(cls, region: mem.Region) -> Region:
        return cls(addr=region.addr, nbytes=region.nbytes, device_id=region.device_id)

    def to_core(self) -> mem.Region:
        return mem.Region(self.addr, self.nbytes, self.device_id)


class Layer(_Struct, kw_only=True):
    """memory.LayerKV: one layer's KV as the address of element 0 and byte strides."""

    layer: NonNegative
    region: NonNegative
    addr: NonNegative
    num_blocks: Positive
    num_heads: Positive
    block_size: Positive
    row_bytes: Positive
    block_stride: NonNegative
    head_stride: NonNegative
    token_stride: NonNegative
    plane_stride: NonNegative = 0
    num_planes: Planes = 1
    group: Annotated[int, msgspec.Meta(ge=0, lt=64)] = 0  # its KV-cache group (core.groups); 0 from older peers
    page_format: str = ""  # where a page keeps each token (core.token_runs); "" from older peers
    itemsize: Positive = 1
    state: bool = False  # a state layer (Mamba): one opaque page of row_bytes per block (memory.LayerKV)

    @classmethod
    def from_core(cls, lk: mem.LayerKV) -> Layer:
        return cls(**{f: getattr(lk, f) for f in _LAYER_FIELDS})

    def to_core(self) -> mem.LayerKV:
        return mem.LayerKV(**{f: getattr(self, f) for f in _LAYER_FIELDS})


_LAYER_FIELDS = tuple(Layer.__struct_fields__)


class Memory(_Struct, kw_only=True):
    """memory.WorkerMemory: a worker's registered regions and its layers (at least one) inside them."""

    regions: tuple[Region, ...]
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayoutError("a worker's memory holds no layers")
        self.to_core()

    @classmethod
    def from_core(cls, memory: mem.WorkerMemory) -> Memory:
        return cls(
            regions=tuple(Region(addr=r.addr, nbytes=r.nbytes, device_id=r.device_id) for r in memory.regions),
            layers=tuple(Layer.from_core(lk) for lk in memory.layers),
        )

    def to_core(self) -> mem.WorkerMemory:
        return mem.WorkerMemory(
            tuple(region.to_core() for region in self.regions),
            tuple(layer.to_core() for layer in self.layers),
        )


class IpcRegion(_Struct, kw_only=True):
    """memory.IpcHandle: a CUDA IPC handle of one of a worker's regions, for readers on the same host."""

    device: NonNegative
    handle: bytes
    storage_bytes: NonNegative
    storage_offset: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes
    event_sync_required: bool
    region_offset: NonNegative
    region_bytes: NonNegative

    @classmethod
    def from_core(cls, handle: mem.IpcHandle) -> IpcRegion:
        return cls(**{f: getattr(handle, f) for f in cls.__struct_fields__})

    def to_core(self) -> mem.IpcHandle:
        return mem.IpcHandle(**{f: getattr(self, f) for f in self.__struct_fields__})


# --- messages ---------------------------------------------------------------------------------------------


class _Message(msgspec.Struct, frozen=True, tag_field="type"):
    """Base of the tagged messages; each class also sets kw_only (msgspec does not inherit it)."""


class HandshakeRequest(_Message, tag="handshake_request", kw_only=True):
    """Decode worker -> prefill worker: who I am, what my KV looks like, and whom I think I am talking to.

    `row_bytes` and `num_planes` are the decode worker's page format (see memory.py): bytes of one
    (plane, head, token) row and whether K and V are separate planes; they must equal the prefill's for pages
    to be copied byte for byte. `target` is the prefill worker the decode side computed this address for;
    the prefill worker refuses the handshake if it is someone else (None: anyone).
    """

    protocol_version: int = PROTOCOL_VERSION
    engine_id: str
    layout: Layout
    worker: Worker
    geometry: Geometry
    kv_layout: str
    row_bytes: Positive
    num_planes: Planes = 1
    target: Worker | None = None
    token_layout: str = ""
    """The decode worker's page format (`core.token_runs`): with different block sizes both sides' must be one
    whose tokens can be addressed."""
    state_bytes: NonNegative = 0
    """Bytes of the decode worker's state pages (Mamba layers; 0: none): one TP rank's conv and SSM state, so a
    peer of another TP size (or another state dtype or conv layout) has another size and is refused."""
    model: Model | None = None
    """The decode's model fingerprint (`core.model_identity`); None: an engine without one (tests)."""

    def __post_init__(self) -> None:
        _check_worker(self)

    @classmethod
    def build(
        cls,
        engine_id: str,
        layout: topology.ParallelLayout,
        dp_rank: int,
        rank: topology.WorkerRank,
        geometry: topology.KVGeometry,
        kv_layout: str,
        memory: mem.WorkerMemory,
        target: tuple[int, topology.WorkerRank] | None = None,
        model: ModelFingerprint | None = None,
    ) -> HandshakeRequest:
        """A request from core values; the page format is taken from the decode worker's `memory`."""
        num_planes, row_bytes = _page_format(Memory.from_core(memory).layers)
        return cls(
            engine_id=engine_id,
            layout=Layout.from_core(layout),
            worker=Worker.from_core(dp_rank, rank),
            geometry=Geometry.from_core(geometry),
            kv_layout=kv_layout,
            row_bytes=row_bytes,
            num_planes=num_planes,
            target=None if target is None else Worker.from_core(*target),
            token_layout=_token_format(memory.layers),
            state_bytes=_state_bytes(Memory.from_core(memory).layers),
            model=_model(model),
        )

    def page_format(self) -> tuple[int, int]:
        """(num_planes, row_bytes)."""
        return self.num_planes, self.row_bytes

    def token_format(self) -> str:
        return self.token_layout

    def state_format(self) -> int:
        return self.state_bytes


class HandshakeReply(_Message, tag="handshake_reply", kw_only=True):
    """Prefill worker -> decode worker: everything needed to read this worker's KV over NIXL.

    `kv_layout` is the free-form name of the physical layout ("LBHNC", "KV_NHD", ...), for logs: what has to
    match is the page format of `memory`'s layers, which `check_compatible` compares. `agent_metadata` is the
    NIXL agent's metadata blob (`get_agent_metadata()`), to load with `add_remote_agent`.
    """

    protocol_version: int = PROTOCOL_VERSION
    engine_id: str
    layout: Layout
    worker: Worker
    geometry: Geometry
    kv_layout: str
    agent_name: str
    agent_metadata: bytes
    memory: Memory
    host_id: str = ""
    """Which machine and network namespace the worker runs in (see `kvbridge.runtime.host.host_id`): a reader on the
    same host may use `ipc`."""

    ipc: tuple[IpcRegion, ...] = ()
    """CUDA IPC handles of `memory`'s regions, in order (empty when the KV is not in GPU memory or the worker
    does not share it): a reader on the same host may copy with a GPU kernel instead of NIXL."""

    epoch: str = ""
    """Random per start of the worker: a claim's Ack carries it too, so a reader notices a restarted peer (new
    memory, new agent) behind a cached connection and handshakes again."""

    staging: Region | None = None
    """The worker's registered staging buffer for the staged NIXL path (`Stage`), or None: it offers none."""

    staging_slot_bytes: NonNegative = 0
    """The largest chunk it stages at once (a slot of `staging`); 0: no staged path."""

    model: Model | None = None
    """The prefill's model fingerprint (`core.model_identity`); None: an engine without one (tests)."""
    kv_stream_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """The port of its KV channel (`runtime.stream_server`, on the side channel's host); 0: it offers none."""
    started: float = 0.0
    """Unix time the worker started (0: not said). kv_transfer_params issued before it (`remote_issued`) are of an
    earlier run of the engine on this address and are refused unread."""

    def __post_init__(self) -> None:
        _check_worker(self)
        _page_format(self.memory.layers)
        _state_bytes(self.memory.layers)

    @classmethod
    def build(
        cls,
        engine_id: str,
        layout: topology.ParallelLayout,
        dp_rank: int,
        rank: topology.WorkerRank,
        geometry: topology.KVGeometry,
        kv_layout: str,
        agent_name: str,
        agent_metadata: bytes,
        memory: mem.WorkerMemory,
        host_id: str = "",
        ipc: tuple[mem.IpcHandle, ...] = (),
        epoch: str = "",
        staging: mem.Region | None = None,
        staging_slot_bytes: int = 0,
        model: ModelFingerprint | None = None,
        kv_stream_port: int = 0,
        started: float = 0.0,
    ) -> HandshakeReply:
        return cls(
            engine_id=engine_id,
            layout=Layout.from_core(layout),
            worker=Worker.from_core(dp_rank, rank),
            geometry=Geometry.from_core(geometry),
            kv_layout=kv_layout,
            agent_name=agent_name,
            agent_metadata=agent_metadata,
            memory=Memory.from_core(memory),
            host_id=host_id,
            ipc=tuple(IpcRegion.from_core(h) for h in ipc),
            epoch=epoch,
            staging=None if staging is None else Region.from_core(staging),
            staging_slot_bytes=staging_slot_bytes,
            model=_model(model),
            kv_stream_port=kv_stream_port,
            started=started,
        )

    def page_format(self) -> tuple[int, int]:
        """(num_planes, row_bytes), shared by every attention layer."""
        return _page_format(self.memory.layers)

    def token_format(self) -> str:
        """Where the pages keep each token (`core.token_runs`), shared by every layer."""
        return _token_format(self.memory.layers)

    def state_format(self) -> int:
        """Bytes of a state page (0: no state layers)."""
        return _state_bytes(self.memory.layers)


class HandshakeRefused(_Message, tag="handshake_refused", kw_only=True):
    """Prefill worker -> decode worker: the handshake failed on `field`.

    `ours` is the refusing (prefill) side's value, `theirs` the requester's value as the refuser read it.
    """

    field: str
    ours: Any = None
    theirs: Any = None

    @classmethod
    def from_error(cls, error: IncompatiblePeerError) -> HandshakeRefused:
        return cls(field=error.field, ours=_plain(error.ours), theirs=_plain(error.theirs))

    def to_error(self) -> IncompatiblePeerError:
        """The error as the requester sees it: its own value first."""
        return IncompatiblePeerError(self.field, self.theirs, self.ours)


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


class Ack(_Message, tag="ack", kw_only=True):
    """The answer to `Claim`, `Notify` and `Abort`; `epoch` is the answering worker's (see HandshakeReply)."""

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


Message = (
    HandshakeRequest | HandshakeReply | HandshakeRefused | Notify | Claim | Abort | Stage | Staged | Ack | ErrorReply
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

Peer = HandshakeRequest | HandshakeReply

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


def _model(model: ModelFingerprint | None) -> Model | None:
    return Model.from_core(model) if model is not None and model.digest else None


def _check_worker(peer: Peer) -> None:
    peer.worker.check_in(peer.layout.to_core())


def _page_format(layers: tuple[Layer, ...]) -> tuple[int, int]:
    formats = {(layer.num_planes, layer.row_bytes) for layer in layers if not layer.state}
    if len(formats) != 1:
        raise LayoutError(f"layers must share one (num_planes, row_bytes) page format, got {sorted(formats)}")
    return formats.pop()


def _token_format(layers) -> str:
    formats = {layer.page_format for layer in layers}
    if len(formats) != 1:
        raise LayoutError(f"layers must share one page_format, got {sorted(formats)}")
    return formats.pop()


def _state_bytes(layers: tuple[Layer, ...]) -> int:
    """The state layers' page bytes (one size for all), or 0 without state layers."""
    sizes = {layer.row_bytes for layer in layers if layer.state}
    if len(sizes) > 1:
        raise LayoutError(f"state layers must share one page size, got {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _plain(value: object) -> object:
    """A value msgpack can carry (refusals are for people: anything else becomes its str)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return str(value)
