"""Copy engines for scattered KV: one cuMemcpyBatchAsync call against kvbridge's gather kernel and a plain copy.

The gather kernel moves an 8k-token request at about 0.9 of a contiguous copy: the SMs read over NVLink. CUDA 12.8
added a batched memcpy that hands many copies to the copy engines (the hardware the contiguous copy uses) in one
call. Does that reach the copy's rate for a request's scattered pages, and at what host cost?

One process, two GPUs with peer access: one worker's KV (Qwen2.5-7B geometry, bf16, in a named physical layout) on
cuda:0 as the source, the decode worker's on cuda:1; a request's blocks contiguous or scattered. Per case, methods
run in rotating order on one stream of cuda:0, timed with CUDA events (all three push from the source GPU: in one
process the kernel runs on its source tensor's device; bench/gpu_transfer.py measures pull through CUDA IPC):

  copy     one torch copy of as many contiguous bytes, cuda:0 -> cuda:1
  kernel   kvbridge.transport.gpu_gather.GatherKernel (one launch, ids uploaded)
  batch    every coalesced descriptor (kvbridge.core.descriptors) in one cuMemcpyBatchAsync call

plus the host time to build the descriptors and to submit the batch. Every byte of kernel and batch is checked.

    python3 bench/gpu_memcpy_batch.py --out DIR      # nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.core.descriptors import expand  # noqa: E402
from kvbridge.core.memory import synthesize_memory  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.gpu_gather import GatherKernel  # noqa: E402

CASES = {  # name: (prefill layout, decode layout, physical layout): the decode worker is rank 0
    "pp1->pp1 LBNHC (32 KiB runs)": ("pp=1", "pp=1", "LBNHC"),
    "pp1->tp2 LBHNC (16 KiB runs)": ("pp=1", "tp=2", "LBHNC"),
    "pp1->tp2 LBNHC (1 KiB runs)": ("pp=1", "tp=2", "LBNHC"),
}


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


class BatchCopy:
    """cuMemcpyBatchAsync through ctypes (the driver API: libcuda is there whenever a GPU is)."""

    def __init__(self, src_device: int, dst_device: int) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.with_fail_idx = hasattr(lib, "cuMemcpyBatchAsync")  # CUDA 12.8's signature has failIdx
        self.fn = lib.cuMemcpyBatchAsync if self.with_fail_idx else lib.cuMemcpyBatchAsync_v2
        self.fn.restype = ctypes.c_int
        # Copies read in stream order (the source is ready when the stream reaches the call); device hints.
        self.attrs = _Attrs(1, _Loc(1, src_device), _Loc(1, dst_device), 0)
        self.attr_idx = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t(0)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
        ptr = ctypes.c_void_p
        args = [
            ptr(dsts.ctypes.data),
            ptr(srcs.ctypes.data),
            ptr(sizes.ctypes.data),
            ctypes.c_size_t(len(sizes)),
            ctypes.byref(self.attrs),
            self.attr_idx,
            ctypes.c_size_t(1),
        ]
        if self.with_fail_idx:
            args.append(ctypes.byref(self.fail))
        args.append(ptr(stream.cuda_stream))
        rc = self.fn(*args)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned CUresult {rc} (failIdx {self.fail.value})")


def worker_buffer(layout: str, g: KVGeometry, p: ParallelLayout, rank: WorkerRank, blocks: int, device: str):
    layers, heads = list(p.stage_layers(g.num_layers, rank.pp)), len(p.kv_heads(g.num_kv_heads, rank.tp))
    size = synthesize_memory(layout, g, layers, heads, blocks, 1 << 20).regions[0].nbytes
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    return buf, synthesize_memory(layout, g, layers, heads, blocks, buf.data_ptr())


def check(src: torch.Tensor, dst: torch.Tensor, descs) -> bool:
    """Every descriptor's bytes at the destination equal the source's (compared as int64 words)."""
    s8, d8 = src.view(torch.int64), dst.view(torch.int64)
    for length in np.unique(descs.length):
        pick = descs.length == length
        s_all = (descs.src_addr[pick] - src.data_ptr()) // 8
        d_all = (descs.dst_addr[pick] - dst.data_ptr()) // 8
        ar = torch.arange(int(length) // 8, device=src.device)
        step = max(1, (1 << 26) // len(ar))  # descriptors per comparison: 512 MiB of words at most
        for k in range(0, len(s_all), step):
            s_start = torch.from_numpy(s_all[k : k + step]).to(src.device)
            d_start = torch.from_numpy(d_all[k : k + step]).to(dst.device)
            got = d8[(d_start[:, None] + ar.to(dst.device)[None, :]).reshape(-1)]
            want = s8[(s_start[:, None] + ar[None, :]).reshape(-1)].to(dst.device)
            if not torch.equal(got, want):
                return False
    return True


def measure(args, seg, src, dst, kernel, batch, stream, sb, db) -> dict:
    """One request: build its descriptors, check each method's bytes once, then time them in rotating order."""
    t0 = time.perf_counter()
    descs = expand(seg, sb, db).coalesced()
    build_s = time.perf_counter() - t0
    nbytes = int(descs.length.sum())
    dsts, srcs = descs.dst_addr.astype(np.uint64), descs.src_addr.astype(np.uint64)
    sizes = descs.length.astype(np.uint64)
    flat_src, flat_dst = src[:nbytes], torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    ids = kernel.block_ids(sb, db)
    torch.cuda.synchronize()
    submit: list[float] = []

    def run_batch() -> None:
        t = time.perf_counter()
        batch(dsts, srcs, sizes, stream)
        submit.append(time.perf_counter() - t)

    methods = {
        "copy": lambda: flat_dst.copy_(flat_src, non_blocking=True),
        "kernel": lambda: kernel.launch(ids, stream),
    }
    if len(sizes) <= args.max_batch:
        methods["batch"] = run_batch
    rec = {"bytes": nbytes, "copies": len(sizes)}
    rec["descriptor_build_s"] = build_s
    rec["run_bytes"] = sorted({int(x) for x in descs.length})[:4]
    times: dict[str, list[float]] = {m: [] for m in methods}
    try:
        with torch.cuda.stream(stream):
            for m, fn in methods.items():  # warm up, and check the bytes
                dst.zero_()  # on cuda:1's stream: done before the copies (on cuda:0's) start
                torch.cuda.synchronize(dst.device)
                fn()
                torch.cuda.synchronize(src.device)
                if m != "copy":
                    rec[f"{m}_exact"] = check(src, dst, descs)
            order = list(methods)
            for rep in range(args.reps):
                for m in order[rep % len(order) :] + order[: rep % len(order)]:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    methods[m]()
                    end.record(stream)
                    end.synchronize()
                    times[m].append(start.elapsed_time(end) / 1e3)
    except Exception as exc:
        rec["error"] = repr(exc)
    for m, ts in times.items():
        if ts:
            rec[f"{m}_s"] = statistics.median(ts)
            rec[f"{m}_gbps"] = nbytes / rec[f"{m}_s"] / 1e9
    if submit:
        rec["batch_submit_s"] = statistics.median(submit)
    for m in ("kernel", "batch"):
        if f"{m}_s" in rec and "copy_s" in rec:
            rec[f"{m}_ratio"] = rec["copy_s"] / rec[f"{m}_s"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--patterns", nargs="+", default=["scattered", "contiguous"])
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--max-batch", type=int, default=200_000, help="skip batches with more copies than this")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    g = KVGeometry(28, 4, 128, "bfloat16", 16)
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda:0").copy_(torch.ones(1, device="cuda:1"))  # peer access both ways
    torch.empty(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))
    stream = torch.cuda.Stream("cuda:0")
    batch = BatchCopy(0, 1)
    rng = np.random.default_rng(0)
    results = []
    for name in args.cases:
        ptext, dtext, layout = CASES[name]
        p, d = ParallelLayout.parse(ptext), ParallelLayout.parse(dtext)
        rank = WorkerRank(0, 0)
        src, src_mem = worker_buffer(layout, g, p, rank, args.blocks, "cuda:0")
        dst, dst_mem = worker_buffer(layout, g, d, rank, args.blocks, "cuda:1")
        src.view(torch.int16).random_(generator=torch.Generator("cuda:0").manual_seed(1))
        seg = worker_segments(make_plan(p, d, g), rank, dst_mem, {rank: src_mem})[rank]
        kernel = GatherKernel(seg, src_mem.regions, [src], dst_mem.regions, [dst])
        for tokens in args.tokens:
            n = tokens // g.block_size
            for pattern in args.patterns:
                if pattern == "scattered":
                    sb, db = rng.permutation(args.blocks)[:n], rng.permutation(args.blocks)[:n]
                else:
                    sb, db = np.arange(n) + 7, np.arange(n) + 3 * n
                rec = {"case": name, "tokens": tokens, "pattern": pattern}
                rec.update(measure(args, seg, src, dst, kernel, batch, stream, sb, db))
                results.append(rec)
                print(
                    f"{name:30} {tokens // 1024:3}k {pattern:10} copies {rec['copies']:7} "
                    + " ".join(f"{m} {rec.get(f'{m}_gbps', 0):5.0f} GB/s" for m in ("copy", "kernel", "batch"))
                    + f" | kernel/copy {rec.get('kernel_ratio', 0):.3f} batch/copy {rec.get('batch_ratio', 0):.3f}"
                    + f" | build {rec['descriptor_build_s'] * 1e3:.2f} ms"
                    + f" submit {rec.get('batch_submit_s', 0) * 1e3:.2f} ms"
                    + f" exact k={rec.get('kernel_exact')} b={rec.get('batch_exact')}"
                    + (f" ERROR {rec['error']}" if "error" in rec else ""),
                    flush=True,
                )
        del src, dst, kernel
        torch.cuda.empty_cache()
    record = {
        "command": [sys.executable, *sys.argv],
        "driver_signature": "cuMemcpyBatchAsync (12.8, failIdx)" if batch.with_fail_idx else "cuMemcpyBatchAsync_v2",
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "results": results,
    }
    path = args.out / f"gpu-memcpy-batch-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
