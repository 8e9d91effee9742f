"""The staged NIXL path, pure: when it pays (a cost model), and how a request's runs are laid out in staging chunks.

Direct: one READ per prefill worker with one NIXL descriptor per run (after coalescing). Each descriptor costs
the transport a fixed time whatever its size, so scattered small runs (16-token blocks, a TP 4:1 head split) are
descriptor-bound. Staged: the prefill worker gathers the request's runs into a registered contiguous buffer, the
decode worker READs it in large chunks (one descriptor each) into its own registered buffer and scatters them into
its KV; chunks are pipelined (the prefill gathers chunk k+1 while chunk k is read), so a request costs about the
link and the copies (the decode scatters chunk k-1 while chunk k is read), plus a chunk of gathering and scattering
to fill and drain the pipeline and a round trip per chunk.

The stream order is canonical: segment-major, then the request's block pairs in order (`expand`'s order). Piece
(k, i) is `length[k]` bytes of run k of block pair i, at stream offset `n * prefix[k] + i * length[k]` (n block
pairs). Both sides compute the same layout from the same segment lengths and block count, so the stream itself is
a `Segments` table on each side (the staging buffer as the other side's "blocks" 0..n-1, block stride = length):
a GPU gather kernel over segments and block ids can do the copies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.core.memory import Region

TCP_DESC_S = 19.6e-6
TCP_LINK_BYTES_PER_S = 0.375e9
TCP_STAGE_BYTES_PER_S = 0.65e9
"""UCX tcp between two network namespaces (veth, 2 shared cores), bench/results/nixl-staged-20261201-175609.json:
least squares of its 24 direct and anchor READs (median error 9%), and the median rate of its 12 staged parts (8 MiB
READs in a pipeline move faster than one large READ there; loopback tcp, nixl-staged-20261201-174011.json: 12.8 us,
0.47 GB/s, staged 0.78 GB/s)."""


@dataclass(frozen=True)
class StageCostModel:
    """Seconds for one prefill worker's part of a request, direct or staged. Defaults fitted to
    bench/results/nixl-curve-dram-20261201-150120.json (host DRAM between two processes, UCX cma, 16-core VM:
    least squares of 52 timed READs, time = descriptors x desc_s + bytes / link; median error 10%) and, for the copy
    rate, a numpy gather of 4-64 KiB runs (bench/nixl_staged.py's `copy` figures)."""

    desc_s: float = 1.5e-6
    """What one NIXL descriptor costs beyond its bytes (fitted: 1.51 us)."""

    link_bytes_per_s: float = 4.4e9
    """What the transport moves per second once descriptors do not count (fitted: 4.41 GB/s; the one-descriptor
    anchor: 4.8 GB/s)."""

    copy_bytes_per_s: float = 5e9
    """A host gather or scatter of KV runs (numpy take/put of 4-64 KiB rows, one thread)."""

    stage_bytes_per_s: float | None = None
    """What the staged READs (chunk-sized, pipelined) move per second; None: `link_bytes_per_s`."""

    round_trip_s: float = 2e-4
    """One side-channel exchange per chunk (the Stage request and its answer), which the pipeline does not hide
    for the first chunk."""

    margin: float = 0.85
    """Staged only when its estimate is below this share of the direct one: the model is a fit, not a measurement
    of this request."""

    def __post_init__(self) -> None:
        if self.stage_bytes_per_s is not None and not self.stage_bytes_per_s > 0:
            raise ValueError(f"stage_bytes_per_s must be positive, got {self.stage_bytes_per_s!r}")
        for name in ("desc_s", "link_bytes_per_s", "copy_bytes_per_s", "round_trip_s", "margin"):
            value = getattr(self, name)
            if not value >= 0 or (name != "desc_s" and name != "round_trip_s" and not value > 0):
                raise ValueError(f"{name} must be positive, got {value!r}")

    def direct_s(self, nbytes: int, descriptors: int) -> float:
        return descriptors * self.desc_s + nbytes / self.link_bytes_per_s

    def staged_s(self, nbytes: int, chunk_bytes: int) -> float:
        """Three stages pipelined by chunk (the prefill gathers chunk k+1 and the decode scatters chunk k-1 while
        chunk k is read): the slower of the link and the copies, plus the first chunk's gather and the last one's
        scatter, plus a descriptor and a round trip per chunk."""
        if nbytes <= 0:
            return 0.0
        chunks = -(-nbytes // chunk_bytes)
        first = min(chunk_bytes, nbytes)
        bottleneck = min(self.stage_bytes_per_s or self.link_bytes_per_s, self.copy_bytes_per_s)
        return nbytes / bottleneck + 2 * first / self.copy_bytes_per_s + chunks * (self.desc_s + self.round_trip_s)

    def break_even_run_bytes(self) -> float:
        """The mean run length below which staging a large part is expected to win (fill, drain and round trips
        left out): where a descriptor costs more than the extra time its bytes spend in the slower pipeline."""
        stage = self.stage_bytes_per_s or self.link_bytes_per_s
        extra = 1 / min(stage, self.copy_bytes_per_s) - self.margin / self.link_bytes_per_s
        return float("inf") if extra <= 0 else self.margin * self.desc_s / extra

    def prefers_staged(self, nbytes: int, descriptors: int, chunk_bytes: int) -> bool:
        """Whether staging this part is expected to beat `descriptors` direct descriptors for `nbytes`."""
        if nbytes <= 0 or descriptors <= 1 or chunk_bytes <= 0:
            return False
        return self.staged_s(nbytes, chunk_bytes) < self.margin * self.direct_s(nbytes, descriptors)


HOST_MEMORY = StageCostModel()
"""Host DRAM between processes of one host (UCX sm/cma): the fitted defaults."""

NETWORK_TCP = StageCostModel(
    desc_s=TCP_DESC_S, link_bytes_per_s=TCP_LINK_BYTES_PER_S, stage_bytes_per_s=TCP_STAGE_BYTES_PER_S
)
"""UCX over tcp (another host, or a UCX_TLS without cma)."""


GPU_EMULATED = StageCostModel(desc_s=14e-6, link_bytes_per_s=0.51e9, stage_bytes_per_s=0.43e9, copy_bytes_per_s=50e9)
"""GPU memory over a path UCX can only emulate (tcp through host bounce buffers: no cuda_ipc lane, no RDMA; two
processes on one GPU), fitted to bench/results/nixl-staged-vram-20261201-204323.json (one H200): least squares of
its 24 direct and anchor READs (14 us per descriptor, 0.51 GB/s; median error 3.5%), the median rate of its 12
staged parts (8 MiB READs one after another: 0.43 GB/s), and a torch gather of 16 KiB rows on the GPU (54 GB/s;
4 KiB rows 13, 64 KiB 211). It stages only where descriptors are many and small (TP 4:1, 2:1 and 1:2 at block 16).
"""

GPU_LINK = StageCostModel(desc_s=5e-6, link_bytes_per_s=100e9, copy_bytes_per_s=300e9)
"""GPU memory over a GPU transport (UCX cuda_ipc between GPUs, RDMA): 3-5 us per descriptor (docs/benchmarks/),
the link not measured through NIXL here (NVLink moves 390 GB/s; 100 GB/s assumed): staging pays for any
run below about a megabyte."""


def cost_model(same_host: bool, ucx_tls: str | None, mem_type: str = "DRAM", emulated: bool = False) -> StageCostModel:
    """The model for a READ path. Host memory: tcp's where UCX can only use tcp for it (another host, or no sm/cma
    in UCX_TLS, and no RDMA transport named), else host memory's. RDMA (rc, dc, ud) was not measured: its
    descriptors cost about what cma's do, so it gets the host-memory model, which stages only runs of a few KB.
    GPU memory ("VRAM"): the emulated model where UCX_TLS names no CUDA or RDMA transport or the path was found
    emulated (`emulated`: its READs ran at a rate no GPU transport has, `NixlReads._judge_rate`), else the GPU
    link's (UCX's own choice, None, included: until a READ tells, a GPU lane is assumed)."""
    names = {t.strip().lower() for t in (ucx_tls or "").split(",") if t.strip()}
    rdma = any(n.startswith(("rc", "dc", "ud", "ib", "gdr")) or n == "all" for n in names)
    if mem_type == "VRAM":
        gpu = rdma or any(n.startswith("cuda_ipc") for n in names) or not names or ucx_tls.startswith("^")
        return GPU_LINK if gpu and not emulated else GPU_EMULATED
    if not names or rdma or ucx_tls.startswith("^"):
        return HOST_MEMORY
    local = same_host and bool(names & {"sm", "cma", "shm", "posix", "sysv", "xpmem", "knem"})
    return HOST_MEMORY if local or "tcp" not in names else NETWORK_TCP


@dataclass(frozen=True)
class Piece:
    """Part of a chunk: block pairs [first, stop) of segment `segment`, at `offset` bytes into the chunk."""

    segment: int
    first: int
    stop: int
    offset: int


@dataclass(frozen=True, eq=False)
class StageLayout:
    """One prefill worker's part of a request as a stream of chunks of at most `chunk_bytes`, cut between pieces
    (a chunk holds whole runs, so each side copies rows, never parts of them)."""

    lengths: np.ndarray  # per segment: bytes of one run
    num_pairs: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.num_pairs <= 0 or not len(self.lengths):
            raise ValueError(f"a staged part needs runs and block pairs, got {len(self.lengths)}, {self.num_pairs}")
        if int(self.lengths.min()) <= 0:
            raise ValueError("every run must have bytes")
        if int(self.lengths.max()) > self.chunk_bytes:
            raise ValueError(f"a run of {int(self.lengths.max())} bytes does not fit a chunk of {self.chunk_bytes}")

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum()) * self.num_pairs

    def chunks(self) -> list[list[Piece]]:
        """The chunks in stream order; each a list of pieces (consecutive pieces of one segment merged)."""
        out: list[list[Piece]] = []
        current: list[Piece] = []
        used = 0
        for k, length in enumerate(int(n) for n in self.lengths):
            i = 0
            while i < self.num_pairs:
                fit = (self.chunk_bytes - used) // length
                if fit == 0:
                    out.append(current)
                    current, used = [], 0
                    continue
                stop = min(self.num_pairs, i + fit)
                current.append(Piece(k, i, stop, used))
                used += (stop - i) * length
                i = stop
        if current:
            out.append(current)
        return out

    def chunk_sizes(self) -> list[int]:
        return [sum((p.stop - p.first) * int(self.lengths[p.segment]) for p in c) for c in self.chunks()]


def runs_inside(
    regions: tuple[Region, ...],
    addr: np.ndarray,
    block_stride: np.ndarray,
    length: np.ndarray,
    blocks: np.ndarray,
) -> str:
    """ "" if every run `addr[k] + b * block_stride[k]` (`length[k]` bytes) for every b in `blocks` lies inside one
    of `regions`, else what does not. What a prefill worker checks before gathering runs a peer named: it copies
    only bytes a NIXL READ of its registered memory could read anyway."""
    if not len(addr):
        return ""
    if not (len(addr) == len(block_stride) == len(length)):
        return "segment arrays differ in length"
    if not blocks.size:
        return ""
    if int(length.min()) <= 0:
        return "a run without bytes"
    lo, hi = int(blocks.min()), int(blocks.max())
    if lo < 0:
        return f"block {lo} is negative"
    # a run is affine in the block id: its extremes are at the smallest and the largest block
    first = np.minimum(addr + lo * block_stride, addr + hi * block_stride)
    last = np.maximum(addr + lo * block_stride, addr + hi * block_stride) + length
    for k in range(len(addr)):
        a, b = int(first[k]), int(last[k])
        if not any(r.addr <= a and b <= r.addr + r.nbytes for r in regions):
            return f"run {k} [{a:#x}, {b:#x}) lies outside the registered regions"
    return ""
