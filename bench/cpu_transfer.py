"""CPU benchmark of kvbridge's NIXL READ path, next to a local torch copy of the same bytes.

Prefill workers run in one spawned process (one NIXL agent each), decode workers here (one agent each), KV in
vLLM's CPU layout (LBHNC, bf16, block size 128 by default). For each layout pair and block pattern it times:
- nixl: descriptors built, READs posted and polled to completion (progress thread off, polling with backoff);
- torch gather: the same (layers, blocks, heads) copied locally with index_select + index_copy_;
- torch contiguous: one copy_ of the same number of bytes.
It prints a table and writes JSON (command line, machine, settings, every figure) under bench/results/.

    .venv/bin/python bench/cpu_transfer.py [--tokens 16384] [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the test suite's worker helpers (tests/support/nixl_peer.py)

from nixl_peer import DecodeSide, Scenario, logical_view, prefill_main  # noqa: E402

from kvbridge.core.topology import KVGeometry, ParallelLayout  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402

PAIRS = {
    "pp2tp1->pp1tp2": (ParallelLayout(pp=2, tp=1), ParallelLayout(pp=1, tp=2)),
    "pp1tp1->pp1tp1": (ParallelLayout(pp=1, tp=1), ParallelLayout(pp=1, tp=1)),
}


def median_time(fn, reps: int) -> float:
    fn()  # warm-up: page faults, first connection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, ...] with everything after the block dim flattened when that needs no copy (a head
    range of a (block, head)-page layout), so index_select copies whole runs instead of single elements."""
    try:
        return x.view(*x.shape[:2], -1)
    except RuntimeError:
        return x


def torch_baselines(side: DecodeSide, descs, src_blocks, dst_blocks, reps: int, threads: int) -> dict[str, float]:
    """Seconds for the same copies done locally, into the decode buffers from local stand-ins of the prefill
    buffers (same layout and size, so the same strides): by index (index_select + index_copy_), one copy_ per
    descriptor run (the granularity NIXL works at), and one contiguous copy_ of as many bytes."""
    scn, plan, g = side.scn, side.plan, side.scn.geometry
    dtype = next(iter(side.workers.values())).buf.dtype
    sources = {}
    for pw in scn.prefill.workers():
        layers = scn.prefill.stage_layers(g.num_layers, pw.pp)
        heads = scn.prefill.kv_heads(g.num_kv_heads, pw.tp)
        numel = len(layers) * scn.prefill_blocks * len(heads) * g.block_size * 2 * g.head_size
        sources[pw] = (torch.ones(numel, dtype=dtype), layers, heads)

    src_idx, dst_idx = torch.as_tensor(src_blocks), torch.as_tensor(dst_blocks)
    by_index = []
    nbytes = 0
    for rank, w in side.workers.items():
        dst_view = w.view()
        for read in plan.reads_of(rank):
            buf, layers, heads = sources[read.prefill_worker]
            src_view = logical_view(buf, scn.prefill_layout, g, len(layers), len(heads), scn.prefill_blocks)
            sl = slice(read.layers[0] - layers.start, read.layers[-1] + 1 - layers.start)
            dl = slice(read.layers[0] - w.layers.start, read.layers[-1] + 1 - w.layers.start)
            sh = slice(read.kv_heads[0] - heads.start, read.kv_heads[1] - heads.start)
            dh = slice(read.kv_heads[0] - w.heads.start, read.kv_heads[1] - w.heads.start)
            by_index.append((_rows(src_view[sl, :, sh]), _rows(dst_view[dl, :, dh])))
            nbytes += len(read.layers) * len(src_blocks) * read.num_heads * g.block_size * 2 * g.head_size
    nbytes *= g.itemsize

    runs = []  # (src bytes, dst bytes) slices, one per descriptor
    for rank, per_peer in descs.items():
        w = side.workers[rank]
        dst_u8, dst_base = w.buf.view(torch.uint8), w.memory.regions[0].addr
        for pw, d in per_peer.items():
            src_u8, src_base = sources[pw][0].view(torch.uint8), side.sources[pw].regions[0].addr
            for s, t, n in zip(d.src_addr.tolist(), d.dst_addr.tolist(), d.length.tolist(), strict=True):
                runs.append((src_u8[s - src_base : s - src_base + n], dst_u8[t - dst_base : t - dst_base + n]))

    def index() -> None:
        for src, dst in by_index:
            dst.index_copy_(1, dst_idx, src.index_select(1, src_idx))

    def per_run() -> None:
        for src, dst in runs:
            dst.copy_(src)

    flat_src = torch.ones(nbytes, dtype=torch.uint8)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8)

    def contiguous() -> None:
        flat_dst.copy_(flat_src)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {
            name: median_time(fn, reps)
            for name, fn in [("index", index), ("per_run", per_run), ("contiguous", contiguous)]
        }
    finally:
        torch.set_num_threads(old)
    out["bytes"] = nbytes
    return out


def run_pair(name: str, args, results: list[dict]) -> None:
    prefill, decode = PAIRS[name]
    blocks = -(-args.tokens // args.block_size)
    geometry = KVGeometry(args.layers, args.kv_heads, args.head_size, args.dtype, args.block_size)
    scn = Scenario(
        name,
        geometry,
        prefill,
        decode,
        args.layout,
        args.layout,
        prefill_blocks=2 * blocks,
        decode_blocks=2 * blocks,
        request_blocks=blocks,
        seed=7,
        config=TransportConfig(),
    )
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, scn, list(prefill.workers())), daemon=True)
    proc.start()
    child.close()
    side = None
    try:
        side = DecodeSide(scn, decode.workers()).start()
        if not conn.poll(300):
            raise TimeoutError("prefill process did not start")
        kind, info = conn.recv()
        if kind != "ready":
            raise RuntimeError(info)
        side.connect(info)
        rng = np.random.default_rng(0)
        patterns = {
            "scattered": (rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]),
            "contiguous": (np.arange(blocks), np.arange(blocks)),
        }
        for pattern, (src_blocks, dst_blocks) in patterns.items():
            for rank, w in side.workers.items():  # back to the known initial bytes, for the check
                w.buf.copy_(side.initial[rank])
            t0 = time.perf_counter()
            descs = side.descriptors(src_blocks, dst_blocks)
            build_s = time.perf_counter() - t0
            count = sum(len(d) for per in descs.values() for d in per.values())
            nbytes = sum(d.nbytes for per in descs.values() for d in per.values())
            post_times = []

            def nixl_read(descs=descs, post_times=post_times) -> None:
                t0 = time.perf_counter()
                posted = side.post(descs)
                post_times.append(time.perf_counter() - t0)
                side.wait(posted)

            nixl_s = median_time(nixl_read, args.reps)
            mismatched = 0
            if args.verify:
                mismatched = sum(side.mismatched_bytes(r, src_blocks, dst_blocks) for r in side.workers)
            row = {
                "pair": name,
                "pattern": pattern,
                "blocks": int(blocks),
                "bytes": int(nbytes),
                "descriptors": int(count),
                "descriptor_build_ms": build_s * 1e3,
                "nixl_s": nixl_s,
                "nixl_post_median_s": statistics.median(post_times[1:] or post_times),
                "nixl_GBps": nbytes / nixl_s / 1e9,
                "verified_mismatched_bytes": mismatched if args.verify else None,
            }
            for threads in sorted({1, torch.get_num_threads()}):
                base = torch_baselines(side, descs, src_blocks, dst_blocks, args.reps, threads)
                assert base["bytes"] == nbytes, (base["bytes"], nbytes)
                for method in ("index", "per_run", "contiguous"):
                    row[f"torch_{method}_{threads}t_GBps"] = nbytes / base[method] / 1e9
            results.append(row)
            print_row(row)
        conn.send("notifs")
        if conn.poll(30):
            kind, notifs = conn.recv()
            row_count = sum(len(m) for per in notifs.values() for m in per.values())
            print(f"  ({name}: prefill side received {row_count} notifications)")
    finally:
        if side is not None:
            side.close()
        with contextlib.suppress(OSError):
            conn.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            os.kill(proc.pid, 9)
            proc.join()


HEADER = (
    f"{'pair':15} {'blocks':10} {'MiB':>5} {'descs':>5} {'nixl':>6} {'index':>6} {'per-run':>7} {'contig':>6}"
    f" {'nixl/index':>10} {'nixl/per-run':>12} {'nixl/contig':>11} {'ok':>3}\n"
    f"{'':38}{'GB/s (torch: 1 thread)':^30}"
)


def print_row(row: dict) -> None:
    index, per_run, contig = (row[f"torch_{m}_1t_GBps"] for m in ("index", "per_run", "contiguous"))
    nixl = row["nixl_GBps"]
    ok = {None: "-", 0: "yes"}.get(row["verified_mismatched_bytes"], "NO")
    print(
        f"{row['pair']:15} {row['pattern']:10} {row['bytes'] / 2**20:5.0f} {row['descriptors']:5d} {nixl:6.2f}"
        f" {index:6.2f} {per_run:7.2f} {contig:6.2f} {nixl / index:10.2f} {nixl / per_run:12.2f}"
        f" {nixl / contig:11.2f} {ok:>3}",
        flush=True,
    )


def machine() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nixl": version("nixl") or version("nixl-cu12"),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "loadavg_at_start": os.getloadavg(),  # other work on the machine skews every figure
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--tokens", type=int, default=16384, help="prompt tokens of the request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default is 128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="LBHNC", help="vLLM's CPU layout is LBHNC")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the byte-for-byte check")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)

    # What the transport would set anyway; set here too so that the recorded environment is the one used.
    for key, value in TransportConfig().ucx_env().items():
        os.environ.setdefault(key, value)
    info = machine()
    print(
        f"{info['platform']}, {info['nproc']} CPUs, torch {info['torch']}, nixl {info['nixl']}, {info['ucx_env']},"
        f" load average {info['loadavg_at_start'][0]:.2f}"
    )
    print(HEADER)
    results: list[dict] = []
    for name in args.pairs:
        run_pair(name, args, results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"cpu_transfer-{stamp}.json"
    info["loadavg_at_end"] = os.getloadavg()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"command": [sys.executable, *sys.argv], "settings": settings, "machine": info, "results": results}
    path.write_text(json.dumps(record, indent=2))
    print(f"saved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
