"""Where a worker's KV bytes are: each layer as byte strides over vLLM's logical dims.

vLLM hands a connector one tensor per layer. Whatever the physical order (vLLM 0.32's KVCacheLayout: LBHNC,
LBNHC, ... inside one shared buffer; older GPU backends' separate K and V planes), a layer is fully described
by the byte address of its first element and the byte strides of its logical dims:

    K  plane (K and V separate: 2 planes; joined in the last dim: 1 plane)
    B  block            H  KV head (local to the worker)
    N  token in block   C  channels of one (plane, head, token), always contiguous

The prefill side publishes these numbers in its handshake; the decode side computes every address from them,
so both sides agree on the bytes without sharing code paths that could drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvbridge.core.errors import LayoutError
from kvbridge.core.topology import KVGeometry

# vLLM 0.32's KVCacheLayout names (outer to inner), plus the older per-layer layouts with K and V planes.
# L layer, K plane, B block, H head, N token, C channels (head_size + head_size_v when K and V share a page;
# MLA's latent is one plane of head_size).
NAMED_LAYOUTS: dict[str, str] = {
    "LBHNC": "LBHNC",  # CPU default: per layer, each (block, head) page contiguous
    "LBNHC": "LBNHC",  # GPU default (FlashAttention/Triton): heads interleaved per token
    "LHBNC": "LHBNC",
    "BLHNC": "BLHNC",  # block-outer: one block of all layers contiguous
    "BLNHC": "BLNHC",
    "BHLNC": "BHLNC",
    "KV_NHD": "LKBNHC",  # older GPU backends: [2, num_blocks, block_size, heads, head_size] per layer
    "KV_HND": "LKBHNC",  # older GPU backends with HND: [2, num_blocks, heads, block_size, head_size]
}


PAGE_ROWS = ""
"""A page format (`LayerKV.page_format`): the strides are the truth (token n of plane p is a row of `row_bytes` at
`p * plane_stride + n * token_stride`)."""

PAGE_CPU_ATTN = "cpu_attn"
"""vLLM's CPU_ATTN pages (ISAs vec, vec16): each (block, head) page holds K channel-major, then V token-major
(`core.token_runs`), not the rows its tensor's shape suggests; copied whole unless the block sizes differ."""


@dataclass(frozen=True)
class Region:
    """One registered allocation: NIXL registers it once, descriptors point inside it."""

    addr: int
    nbytes: int
    device_id: int = 0

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV in one worker: the address of element 0 and byte strides (see module docstring)."""

    layer: int
    region: int
    addr: int
    num_blocks: int
    num_heads: int
    block_size: int
    row_bytes: int
    block_stride: int
    head_stride: int
    token_stride: int
    plane_stride: int = 0
    num_planes: int = 1
    group: int = 0
    """The layer's KV-cache group (vLLM's hybrid KV-cache manager): its blocks are named by that group's block
    ids. Layers of different groups may alias the same bytes (`core.groups`)."""
    page_format: str = PAGE_ROWS
    """Where a page keeps each token (`core.token_runs`): PAGE_ROWS, PAGE_CPU_ATTN, or any other name for pages
    only ever copied whole (then the two sides' block sizes must be equal)."""
    itemsize: int = 1
    """Bytes of one channel (element): what a channel-major page is addressed in."""
    state: bool = False
    """A state layer (Mamba): each block is one TP rank's state page (conv + SSM state, opaque bytes: `row_bytes`
    of them, in one head of one token), copied whole between workers of the same TP rank (`core.segments`)."""

    def __post_init__(self) -> None:
        if self.group < 0:
            raise LayoutError(f"layer {self.layer}: group must be non-negative, got {self.group}")
        if self.num_planes not in (1, 2):
            raise LayoutError(f"layer {self.layer}: num_planes must be 1 or 2, got {self.num_planes}")
        for name in ("num_blocks", "num_heads", "block_size", "row_bytes", "itemsize"):
            if getattr(self, name) < 1:
                raise LayoutError(f"layer {self.layer}: {name} must be positive")
        if self.row_bytes % self.itemsize:
            raise LayoutError(f"layer {self.layer}: row_bytes {self.row_bytes} is not a multiple of {self.itemsize}")
        if self.page_format == PAGE_CPU_ATTN and not (
            self.num_planes == 1 and self.token_stride == self.row_bytes and self.row_bytes % (2 * self.itemsize) == 0
        ):
            raise LayoutError(f"layer {self.layer}: a {PAGE_CPU_ATTN} page is one plane of K|V token rows")

    def extent(self) -> tuple[int, int]:
        """[first byte, end) spanned by this layer (strides are non-negative)."""
        last = (
            (self.num_planes - 1) * self.plane_stride
            + (self.num_blocks - 1) * self.block_stride
            + (self.num_heads - 1) * self.head_stride
            + (self.block_size - 1) * self.token_stride
            + self.row_bytes
        )
        return self.addr, self.addr + last

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this layer (all planes, heads, tokens)."""
        return self.num_planes * self.num_heads * self.block_size * self.row_bytes


@dataclass(frozen=True)
class WorkerMemory:
    """All KV memory of one worker: registered regions and the layers inside them, by global layer id."""

    regions: tuple[Region, ...]
    layers: tuple[LayerKV, ...]
    num_groups: int = 1
    """The engine's KV-cache groups (several with vLLM's hybrid KV-cache manager): a load then carries one block
    list per group (`core.groups`). Local only: a peer's layers name their groups."""

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise LayoutError(f"num_groups must be positive, got {self.num_groups}")
        seen: set[int] = set()
        for lk in self.layers:
            if lk.layer in seen:
                raise LayoutError(f"layer {lk.layer} appears twice in one worker's memory")
            seen.add(lk.layer)
            if not 0 <= lk.region < len(self.regions):
                raise LayoutError(f"layer {lk.layer} names region {lk.region} of {len(self.regions)}")
            start, end = lk.extent()
            if not self.regions[lk.region].contains(start, end - start):
                raise LayoutError(f"layer {lk.layer} spans [{start:#x}, {end:#x}) outside its region")

    def layer(self, layer: int) -> LayerKV:
        for lk in self.layers:
            if lk.layer == layer:
                return lk
        raise LayoutError(f"layer {layer} is not held by this worker (holds {self.layer_ids()})")

    def layer_ids(self) -> tuple[int, ...]:
        return tuple(lk.layer for lk in self.layers)

    @cached_property  # checked on every request
    def num_blocks(self) -> int:
        return min(lk.num_blocks for lk in self.layers)

    @cached_property  # every READ's descriptors are checked against it
    def region_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, device id) of each region, as read-only int64 arrays (`region_table`)."""
        return region_table(self.regions)


def region_table(regions: Sequence[Region]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, device id) of each region, as read-only int64 arrays."""
    start = np.array([r.addr for r in regions], dtype=np.int64)
    end = start + np.array([r.nbytes for r in regions], dtype=np.int64)
    dev = np.array([r.device_id for r in regions], dtype=np.int64)
    for a in (start, end, dev):
        a.flags.writeable = False
    return start, end, dev


def layer_from_strides(
    layer: int,
    region: int,
    addr: int,
    dims: str,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
) -> LayerKV:
    """A LayerKV from a tensor's shape and element strides, `dims` naming each dim (e.g. "BHNC", "KBNHC").

    The channel dim C must be the innermost and contiguous; K (planes) is optional.
    """
    if sorted(dims) != sorted(set(dims)) or set(dims) - set("KBHNC") or not set("BHNC") <= set(dims):
        raise LayoutError(f"dims {dims!r} must name B, H, N, C once each and optionally K")
    if not len(dims) == len(shape) == len(strides):
        raise LayoutError(f"dims {dims!r} do not match shape {tuple(shape)}")
    size = dict(zip(dims, shape, strict=True))
    stride = {d: s * itemsize for d, s in zip(dims, strides, strict=True)}
    if stride["C"] != itemsize:
        raise LayoutError(f"layer {layer}: channels are not contiguous (stride {stride['C'] // itemsize})")
    if size.get("K", 1) not in (1, 2):
        raise LayoutError(f"layer {layer}: the K/V plane dim has size {size['K']}, expected 2")
    return LayerKV(
        layer=layer,
        region=region,
        addr=addr,
        num_blocks=size["B"],
        num_heads=size["H"],
        block_size=size["N"],
        row_bytes=size["C"] * itemsize,
        block_stride=stride["B"],
        head_stride=stride["H"],
        token_stride=stride["N"],
        plane_stride=stride.get("K", 0),
        num_planes=size.get("K", 1),
    )


def layout_nbytes(geometry: KVGeometry, num_layers: int, num_heads: int, num_blocks: int) -> int:
    """Bytes of one worker's KV buffer holding `num_layers` layers of `num_heads` heads."""
    return num_layers * num_blocks * num_heads * geometry.block_size * geometry.token_channels * geometry.itemsize


def synthesize_memory(
    layout: str,
    geometry: KVGeometry,
    layers: Sequence[int],
    num_heads: int,
    num_blocks: int,
    base: int,
    device_id: int = 0,
) -> WorkerMemory:
    """The memory of a worker whose KV for `layers` lies in one buffer at `base`, in a named layout.

    Used by the planner CLI, benchmarks and tests to model vLLM's allocation without vLLM.
    """
    if layout not in NAMED_LAYOUTS:
        raise LayoutError(f"unknown KV layout {layout!r}; known: {', '.join(NAMED_LAYOUTS)}")
    order = NAMED_LAYOUTS[layout]
    planes = 2 if "K" in order else 1
    if planes == 2 and geometry.head_size_v != geometry.head_size:
        raise LayoutError(
            f"layout {layout} keeps K and V in planes of one size; this model's are {geometry.head_size} "
            f"and {geometry.head_size_v}"
        )
    size = {
        "L": len(layers),
        "K": 2,
        "B": num_blocks,
        "H": num_heads,
        "N": geometry.block_size,
        "C": geometry.token_channels // planes,
    }
    stride: dict[str, int] = {}
    step = geometry.itemsize
    for dim in reversed(order):
        stride[dim] = step
        step *= size[dim]
    nbytes = step
    dims = order.replace("L", "")
    out = [
        layer_from_strides(
            layer,
            0,
            base + i * stride["L"],
            dims,
            [size[d] for d in dims],
            [stride[d] // geometry.itemsize for d in dims],
            geometry.itemsize,
        )
        for i, layer in enumerate(layers)
    ]
    return WorkerMemory((Region(base, nbytes, device_id),), tuple(out))


@dataclass(frozen=True)
class IpcHandle:
    """What PyTorch's `UntypedStorage._share_cuda_()` returns for the storage of a region, plus where the region
    starts in that storage and its size."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    region_offset: int  # bytes from the storage's start to the region's first byte
    region_bytes: int
