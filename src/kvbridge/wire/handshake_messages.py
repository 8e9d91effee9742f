"""The handshake's messages (`HandshakeRequest`, `HandshakeReply`, `HandshakeRefused`), the nested structs
they carry (mirroring the core dataclasses), and what every message is built from: `PROTOCOL_VERSION`, the
bounded field types, `Worker` and the tagged base `_Message`.

`wire.messages` re-exports every name here and holds the one tagged union, encoder and decoder, the per-request
messages and `check_compatible`; import messages from there (`from kvbridge.wire import messages as wire`). The
schema-evolution rules in its docstring apply here.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvbridge.core import memory as mem
from kvbridge.core import topology
from kvbridge.core.errors import IncompatiblePeerError, LayoutError
from kvbridge.core.model_identity import ModelFingerprint

PROTOCOL_VERSION = 5
"""Bumped only for a change an older peer cannot read correctly (see the module docstring).
2: claims, notifications and aborts carry the request's token (a claim also its prompt hash) and are refused
without it; claims pin the request for the read.
3: sealed frames (wire.auth, `KVB2`) are encrypted and a sealed request is bound to its destination worker's
identity (engine id, dp/pp/tp, port); version-2 sealed frames (`KVB1`) are dropped.
4: sealed frames are AES-GCM from `cryptography` under keys derived with HKDF and named by a key id (`KVB3`;
`KVB1`/`KVB2` frames are dropped as old_format); signed params name their key id.
5: signed params' `remote_model` is one 8-hex digest per fingerprint part (`ModelFingerprint.digest`), no
longer one 32-hex digest of the whole, so that a refusal names the parts that differ."""

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
    pid: NonNegative = 0
    """The worker's process id (0: not said), with `pid_started`, when it started in clock ticks after boot: a
    reader on the same host (`host_id`) that sees this very process in /proc knows it is gone as soon as it is
    killed, while the kernel may keep its sockets open and silent for a while."""
    pid_started: NonNegative = 0

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
        pid: int = 0,
        pid_started: int = 0,
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
            pid=pid,
            pid_started=pid_started,
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


Peer = HandshakeRequest | HandshakeReply


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
