"""kvbridge's worker runtimes on GPUs: real prefill and decode worker processes, side channel, NIXL, CUDA IPC.

Each scenario runs `kvbridge.testing.transfer_scenario.run_transfer` (what the connector does inside vLLM, minus
vLLM) with the prefill workers' KV on GPU 0 and the decode workers' on GPU 1, one allocation per layer as vLLM
makes on GPU, with `gpu_peer_copy="auto"` (the decode workers open the prefill workers' CUDA IPC handles and copy with
kvbridge's gather kernel, then notify over the side channel) and with `gpu_peer_copy="nixl"` (coalesced NIXL
READs), each with claims on (`verify_requests`, the default: one side-channel round trip per prefill worker) and
off. Every decode worker loads `--repeats` requests on the same blocks (the first includes the handshake and the
kernel's compilation) and checks every byte it holds against the seeded reference; every prefill worker must
free every request on its readers' notifications (not at lease expiry). Next to each, in the same run: a torch
copy cuda:0 -> cuda:1 of as many contiguous bytes as one decode worker loads, and, for all decode workers
together, torch copies of as many bytes as the plan moves between each (prefill GPU, decode GPU) pair, all pairs
at once. `--prefill-gpus`/`--decode-gpus` place the workers one per GPU (e.g. pp2 on GPUs 0-1, tp2 on 2-3).
Prints a line per run, writes JSON.

    python3 bench/gpu_workers.py --out DIR        # nvidia-h200-x2, nixl wheels carried: docs/benchmarks/device-runs.md
    python3 bench/gpu_workers.py --pairs pp2->tp2 tp2->pp2 --prefill-gpus 0 1 --decode-gpus 2 3 --out DIR  # x4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.core.config import BridgeConfig  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout  # noqa: E402
from kvbridge.testing.transfer_scenario import Scenario, run_transfer  # noqa: E402

PAIRS = ["pp1->pp1", "pp2->pp1", "pp1->tp2", "pp2->tp2", "tp2->pp2"]


def scenario_of(pair: str, path: str, verify: bool, args) -> Scenario:
    prefill, decode = (ParallelLayout.parse(x.replace("pp", "pp=").replace("tp", "tp=")) for x in pair.split("->"))
    return Scenario(
        prefill,
        decode,
        KVGeometry(args.layers, args.kv_heads, args.head_size, "float32", args.block_size),
        num_blocks=args.blocks,
        request_blocks=args.request_blocks,
        seed=7,
        prefill_device="cpu" if args.sim_cpu else ",".join(f"cuda:{g}" for g in args.prefill_gpus),
        decode_device="cpu" if args.sim_cpu else ",".join(f"cuda:{g}" for g in args.decode_gpus),
        config=BridgeConfig(gpu_peer_copy=path, verify_requests=verify, lease_s=60.0, transfer_timeout_s=60.0),
        repeats=args.repeats,
        concurrent=args.concurrent,
        layer_tensors=not args.one_allocation,
    )


def one(pair: str, path: str, verify: bool, args) -> dict:
    scenario = scenario_of(pair, path, verify, args)
    t0 = time.monotonic()
    result = run_transfer(scenario, timeout_s=240)
    result["wall_s"] = time.monotonic() - t0
    result["pair"], result["path_asked"], result["verify_requests"] = pair, path, verify
    return result


def copy_seconds(nbytes: int, src_gpu: int, dst_gpu: int, reps: int = 20) -> float:
    """Median seconds of a torch copy of `nbytes` contiguous bytes cuda:src_gpu -> cuda:dst_gpu (the reference)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(src_gpu), torch.cuda.synchronize(dst_gpu)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src_gpu), torch.cuda.synchronize(dst_gpu)
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def pair_copies(scenario: Scenario, reps: int = 20) -> dict:
    """The reference for all decode workers together: torch copies of as many bytes as the plan moves between
    each (prefill GPU, decode GPU) pair, all pairs at once (a stream each), median seconds."""
    import torch

    from kvbridge.core.plan import make_plan

    g = scenario.geometry
    tokens = scenario.request_blocks * g.block_size
    by_pair: dict[tuple[str, str], int] = {}
    for read in make_plan(scenario.prefill, scenario.decode, g):
        key = (scenario.device("prefill", read.prefill_worker), scenario.device("decode", read.decode_worker))
        by_pair[key] = by_pair.get(key, 0) + g.kv_bytes_per_token(len(read.layers), read.num_heads) * tokens
    bufs = [
        (torch.empty(n, dtype=torch.uint8, device=s), torch.empty(n, dtype=torch.uint8, device=d), s)
        for (s, d), n in by_pair.items()
    ]
    streams = [torch.cuda.Stream(s) for _, _, s in bufs]
    devices = sorted({d for pair in by_pair for d in pair})
    times = []
    for _ in range(reps + 1):
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for (src, dst, _), stream in zip(bufs, streams, strict=True):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for d in devices:
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - t0)
    del bufs
    torch.cuda.empty_cache()
    return {
        "pairs": {f"{s}->{d}": n for (s, d), n in by_pair.items()},
        "bytes": sum(by_pair.values()),
        "copy_s": statistics.median(times[1:]),
    }


def aggregate(r: dict, ref: dict) -> str:
    """All decode workers together: bytes of every load after each worker's first over the span from the first
    of those loads to the last (all workers), against the copies over the same GPU pairs at once."""
    workers = r["decode"]
    windows = [w["warm_window"] for w in workers if w.get("warm_window")]
    if r["repeats"] < 2 or not windows or len(windows) != len(workers):
        return ""
    # From the first worker's first load done to the last worker's last: the workers' loads may not overlap
    # (conservative: the span may hold a worker's uncounted first load).
    per_load = (max(end for _, end in windows) - min(start for start, _ in windows)) / (r["repeats"] - 1)
    total = sum(w["bytes"] for w in workers)
    r["aggregate"] = {
        "bytes_per_load": total,
        "s_per_load": per_load,
        "gbps": total / per_load / 1e9,
        "copy": ref,
        "ratio": ref["copy_s"] / per_load * total / ref["bytes"],
    }
    a = r["aggregate"]
    return (
        f"    all {len(workers)} decode workers: {total / 2**20:7.1f} MiB per load in {per_load * 1e3:6.2f} ms"
        f" ({a['gbps']:5.1f} GB/s); copies over the same GPU pairs at once {ref['copy_s'] * 1e3:6.2f} ms"
        f" ({ref['bytes'] / ref['copy_s'] / 1e9:5.1f} GB/s, {len(ref['pairs'])} pairs); ratio {a['ratio']:.2f}"
    )


def summary(r: dict, copies: dict[int, float]) -> str:
    workers = r["decode"]
    ok = all(w["ok"] and w["exact"] and w["untouched_clean"] for w in workers)
    # Every prefill worker must free every request because its readers told it, not because its lease expired.
    released = sum(1 for _, ids, expired, _ in r["prefill_released"] if expired == 0 and len(ids) == r["repeats"])
    ok = ok and released == len(r["prefill_released"]) > 0
    paths = ",".join(sorted({w["path"] for w in workers}))
    warm = [t for w in workers for t in w["transfer_times_s"][1:]]
    first = max(w["transfer_times_s"][0] for w in workers if w["transfer_times_s"])
    per_worker = workers[0]["bytes"]
    med = statistics.median(warm) if warm else float("nan")
    copy = copies.get(per_worker)
    post = statistics.median(t for w in workers for t in w["post_times_s"][1:]) if warm else float("nan")
    gpus = [t for w in workers for t in w["gpu_times_s"][1:]]
    gpu = statistics.median(gpus) if gpus else float("nan")
    r.update(ok=ok, warm_median_s=med, post_median_s=post, gpu_median_s=gpu, copy_s=copy)
    # Each warm load's timeline (transfer_stats.PHASES): host posting = handshake (the hand-off to the thread that
    # claims, and the claim built and sent) + queue (-> taken by its path: claim granted first, except on the CUDA
    # IPC path, whose kernels go out while the claim is on the wire) + post (-> kernels queued or READs posted);
    # claim is the side-channel round trip (on the CUDA IPC path: what it took beyond the kernels).
    names = sorted({n for w in workers for n in w.get("phases_s", {})})
    r["phase_medians_s"] = {
        n: statistics.median(t for w in workers for t in w["phases_s"].get(n, [])[1:] or [float("nan")]) for n in names
    }
    hosts = [
        sum(parts)
        for w in workers
        for parts in zip(*(w.get("phases_s", {}).get(n, [])[1:] for n in ("handshake", "queue", "post")), strict=False)
    ]
    r["host_post_median_s"] = statistics.median(hosts) if hosts else None
    r["ratio"] = copy / med if copy else None
    # Throughput of the loads after the first: bytes over the time from the first done to the last done.
    spans = [w["warm_s"] for w in workers if w.get("warm_s")]
    stream = max(spans) / (r["repeats"] - 1) if spans and r["repeats"] > 1 else None
    r["stream_s_per_load"] = stream
    r["stream_ratio"] = copy / stream if copy and stream else None
    streamed = f" {workers[0].get('concurrent', 1)} in flight: {stream * 1e3:5.2f} ms/load" if stream else ""
    streamed += f" copy/that={copy / stream:5.2f}" if copy and stream else ""
    ratio = f"{copy / med:5.2f}" if copy else "    -"
    return (
        f"{r['pair']:9} {r['path_asked']:5} claims={'on ' if r['verify_requests'] else 'off'} -> {paths:9} "
        f"ok={ok!s:5} released={released} MiB/w={per_worker / 2**20:6.1f} descs/w={workers[0]['descriptors']:6} "
        f"first={first * 1e3:7.1f} ms warm median={med * 1e3:7.2f} ms ({per_worker / med / 1e9:5.1f} GB/s/worker) "
        f"copy={copy * 1e3 if copy else float('nan'):5.2f} ms  copy/warm={ratio}  (posted after {post * 1e3:5.2f} ms,"
        f" on the GPU {gpu * 1e3:5.2f} ms){streamed}"
        + (
            "\n    phases (median ms): "
            + ", ".join(f"{n} {v * 1e3:.3f}" for n, v in r["phase_medians_s"].items())
            + f"; host posting {r['host_post_median_s'] * 1e3:.3f} ms"
            if r.get("host_post_median_s") is not None
            else ""
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="+", default=PAIRS)
    p.add_argument("--paths", nargs="+", default=["auto", "nixl"], choices=["auto", "nixl"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks per worker")
    p.add_argument("--request-blocks", type=int, default=512, help="the request's blocks (scattered at random)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-gpu", type=int, default=1, help="the decode GPU (all decode workers on it)")
    p.add_argument("--prefill-gpus", nargs="+", type=int, default=[0], help="one per prefill worker, in order")
    p.add_argument("--decode-gpus", nargs="+", type=int, help="one per decode worker, in order (default: --decode-gpu)")
    p.add_argument(
        "--concurrent", type=int, default=1, help="loads in flight at once after the first (throughput, not latency)"
    )
    p.add_argument("--claims", nargs="+", default=["on", "off"], choices=["on", "off"], help="verify_requests")
    p.add_argument("--sim-cpu", action="store_true", help="KV in DRAM, no GPU (checks this script's plumbing)")
    p.add_argument("--one-allocation", action="store_true", help="all layers in one KV tensor (vLLM on CPU)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    args = p.parse_args()
    args.decode_gpus = args.decode_gpus or [args.decode_gpu]
    args.decode_gpu = args.decode_gpus[0]  # the per-worker copy reference: cuda:prefill_gpus[0] -> this
    args.out.mkdir(parents=True, exist_ok=True)
    results, lines, copies, refs = [], [], {}, {}
    for pair in args.pairs:
        for path in args.paths:
            for claims in args.claims:
                try:
                    r = one(pair, path, claims == "on", args)
                    r["repeats"] = args.repeats
                    nbytes = r["decode"][0]["bytes"]
                    if nbytes and nbytes not in copies and not args.sim_cpu:
                        copies[nbytes] = copy_seconds(nbytes, args.prefill_gpus[0], args.decode_gpu)
                    line = summary(r, copies)
                    if not args.sim_cpu:
                        if pair not in refs:
                            refs[pair] = pair_copies(scenario_of(pair, path, claims == "on", args))
                        line += "\n" + aggregate(r, refs[pair])
                except Exception as exc:  # record and go on: one scenario must not hide the others
                    r = {"pair": pair, "path_asked": path, "claims": claims, "error": f"{type(exc).__name__}: {exc}"}
                    line = f"{pair:9} {path:5} claims={claims} ERROR {r['error']}"
                results.append(r)
                lines.append(line)
                print(line, flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {"command": [sys.executable, *sys.argv], "settings": {k: str(v) for k, v in vars(args).items()}}
    (args.out / f"gpu-workers-{stamp}.json").write_text(json.dumps({**record, "results": results}, indent=1))
    good = all("error" not in r and r.get("ok") for r in results)
    print(f"\nall ok: {good}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
