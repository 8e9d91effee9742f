"""A CUDA kernel that copies a list of byte runs (source address, destination address, length) in one launch.

Used by bench/gpu_transfer.py for the one-node path: the prefill process shares its KV buffer through CUDA IPC,
the decode process opens it (on the prefill GPU, where the IPC mapping is valid), and launches this kernel on that
GPU; it reads the mapped pages locally and writes them into the decode GPU's memory over NVLink (peer access).

The runs are kvbridge's coalesced descriptors. Each is cut into chunks of at most `chunk` bytes, and each chunk is
copied by `tpi` threads (a whole 256-thread block, or one warp) with 16-byte loads and stores. The cutting happens
on the GPU: the host packs only (source, destination, 16-byte vectors, first chunk) per run into pinned memory;
each chunk finds its run by binary search over the first-chunk column (skipped when no run needs more than one
chunk, the usual case for scattered blocks). Runs go in batches of growing size, one upload and one launch each, so
that the host packs the next batch while the GPU copies the previous one.

Runs must be 16-byte aligned in address and length (vLLM's KV pages are: rows are 2*head_size*itemsize bytes).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

THREADS = 256

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256)
peer_gather(const long long* __restrict__ runs, long long n_runs, long long n_items, int direct)
{
    // runs: [4][n_runs] = source address, destination address, 16-byte vectors, index of the run's first chunk.
    const long long item = (long long)blockIdx.x * (256 / TPI) + threadIdx.x / TPI;
    if (item >= n_items) return;
    long long r = item, off = 0;
    if (!direct) {
        const long long* __restrict__ first = runs + 3 * n_runs;
        long long lo = 0, hi = n_runs - 1;
        while (lo < hi) {
            const long long mid = (lo + hi + 1) >> 1;
            if (first[mid] <= item) lo = mid; else hi = mid - 1;
        }
        r = lo;
        off = (item - first[r]) * CHUNKV;
    }
    const uint4* __restrict__ src = reinterpret_cast<const uint4*>(runs[r]) + off;
    uint4* __restrict__ dst = reinterpret_cast<uint4*>(runs[n_runs + r]) + off;
    long long n = runs[2 * n_runs + r] - off;
    if (n > CHUNKV) n = CHUNKV;
    for (long long base = threadIdx.x % TPI; base < n; base += (long long)TPI * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = base + (long long)u * TPI;
            if (k < n) v[u] = src[k];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = base + (long long)u * TPI;
            if (k < n) dst[k] = v[u];
        }
    }
}
"""


@dataclass(frozen=True)
class GatherConfig:
    """How work is cut: runs into chunks of `chunk` bytes, each copied by `tpi` threads, `unroll` loads in flight."""

    name: str
    tpi: int
    chunk: int
    unroll: int

    def __post_init__(self) -> None:
        if THREADS % self.tpi or self.chunk % 16:
            raise ValueError(f"{self}: tpi must divide {THREADS} and chunk must be a multiple of 16")

    @property
    def chunk_vectors(self) -> int:
        return self.chunk // 16


CONFIGS = {
    c.name: c
    for c in (
        GatherConfig("block64k", tpi=256, chunk=64 << 10, unroll=4),  # one thread block per 64 KiB chunk
        GatherConfig("warp16k", tpi=32, chunk=16 << 10, unroll=8),  # one warp per 16 KiB chunk
    )
}


@dataclass(frozen=True)
class Packed:
    """The kernel's input: `table` is [4][n_runs] int64 (see SOURCE); `direct` when every run is one chunk."""

    table: np.ndarray
    n_runs: int
    n_items: int
    direct: bool


def check_aligned(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Raise ValueError unless every run is 16-byte aligned in source, destination and length. Alignment follows
    from the layouts (buffer bases and strides), so a caller checks it once per layout pair, not per request."""
    if np.bitwise_or.reduce(src | dst | length, initial=0) & 15:
        raise ValueError("every run must be 16-byte aligned in source, destination and length")


def pack(src: np.ndarray, dst: np.ndarray, length: np.ndarray, chunk: int, out: np.ndarray | None = None) -> Packed:
    """Pack runs (16-byte aligned: see check_aligned) for the kernel, into `out` (a flat int64 array of at least
    4*n, e.g. pinned memory) if given."""
    n = len(length)
    table = (np.empty(4 * n, dtype=np.int64) if out is None else out[: 4 * n]).reshape(4, n)
    table[0], table[1] = src, dst
    np.right_shift(length, 4, out=table[2])
    if n == 0 or int(length.max()) <= chunk:
        return Packed(table, n, n, True)
    cv = chunk // 16
    counts = (table[2] + (cv - 1)) // cv
    table[3, 0] = 0
    np.cumsum(counts[:-1], out=table[3, 1:])
    return Packed(table, n, int(table[3, -1] + counts[-1]), False)


def batches(n: int, first: int = 1024, most: int = 65536) -> list[tuple[int, int]]:
    """[start, end) of each batch of runs: `first` runs, then doubling up to `most`."""
    out, start, size = [], 0, first
    while start < n:
        out.append((start, min(n, start + size)))
        start, size = start + size, min(most, 2 * size)
    return out


def emulate(p: Packed, chunk: int) -> None:
    """Do the kernel's copies on the CPU, item by item with the kernel's indexing (for host memory only)."""
    cv = chunk // 16
    src, dst, nvec, first = p.table
    for item in range(p.n_items):
        r, off = item, 0
        if not p.direct:
            r = int(np.searchsorted(first, item, side="right")) - 1
            off = (item - int(first[r])) * cv
        n = min(cv, int(nvec[r]) - off)
        ctypes.memmove(int(dst[r]) + off * 16, int(src[r]) + off * 16, n * 16)


class PeerGather:
    """The compiled kernel on one device, with peer access from it to `peer` enabled, and reusable pinned and
    device buffers for the packed runs."""

    def __init__(self, device: int, peer: int, config: GatherConfig) -> None:
        self.device, self.peer, self.config = device, peer, config
        self._kernel = None
        self._pinned = None
        self._host = np.empty(0, dtype=np.int64)
        self._dev = None

    def start(self) -> PeerGather:
        import cupy as cp

        with cp.cuda.Device(self.device):
            if self.peer != self.device:
                if not cp.cuda.runtime.deviceCanAccessPeer(self.device, self.peer):
                    raise RuntimeError(f"device {self.device} cannot access device {self.peer}")
                try:
                    cp.cuda.runtime.deviceEnablePeerAccess(self.peer)
                except cp.cuda.runtime.CUDARuntimeError as exc:  # already enabled (by torch's copies)
                    if "AlreadyEnabled" not in str(exc):
                        raise
            options = (f"-DTPI={self.config.tpi}", f"-DUNROLL={self.config.unroll}")
            options += (f"-DCHUNKV={self.config.chunk_vectors}LL",)
            self._kernel = cp.RawKernel(SOURCE, "peer_gather", options=options)
            self._kernel.compile()
            self._start, self._end = cp.cuda.Event(), cp.cuda.Event()
        return self

    def _buffers(self, count: int):
        import cupy as cp

        if self._host.size < count:
            size = max(count, 2 * self._host.size)
            self._pinned = cp.cuda.alloc_pinned_memory(size * 8)
            self._host = np.frombuffer(self._pinned, dtype=np.int64, count=size)
            with cp.cuda.Device(self.device):
                self._dev = cp.empty(size, dtype=np.int64)
        return self._host, self._dev

    def prepare(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Packed:
        """Check alignment and pack the whole request at once (to count work items; `transfer` packs by batch)."""
        check_aligned(src, dst, length)
        return pack(src, dst, length, self.config.chunk)

    def transfer(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> dict[str, float]:
        """Copy every run: per batch, pack into pinned memory, upload (async), launch; then wait. Seconds: `s` the
        whole (packing included), `kernel_s` from the first launch to the last kernel's end, `batches`."""
        import cupy as cp

        t0 = time.perf_counter()
        host, dev = self._buffers(4 * len(length))
        per_block = THREADS // self.config.tpi
        parts = batches(len(length))
        with cp.cuda.Device(self.device):
            stream = cp.cuda.Stream.null
            for i, (a, b) in enumerate(parts):
                base = 4 * a  # each batch's table lies at 4 * (runs before it) in both buffers
                p = pack(src[a:b], dst[a:b], length[a:b], self.config.chunk, host[base:])
                table = dev[base : base + 4 * p.n_runs]
                cp.cuda.runtime.memcpyAsync(table.data.ptr, p.table.ctypes.data, 32 * p.n_runs, 1, stream.ptr)
                if i == 0:
                    self._start.record(stream)
                grid = ((p.n_items + per_block - 1) // per_block,)
                args = (table, np.int64(p.n_runs), np.int64(p.n_items), np.int32(p.direct))
                self._kernel(grid, (THREADS,), args)
            self._end.record(stream)
            self._end.synchronize()
            wall = time.perf_counter() - t0
            gpu = cp.cuda.get_elapsed_time(self._start, self._end) / 1e3 if parts else 0.0
            return {"s": wall, "kernel_s": gpu, "batches": len(parts)}
