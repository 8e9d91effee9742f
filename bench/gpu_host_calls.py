"""The host calls of one CUDA IPC load's launch, each timed alone in a hot loop (one process, one GPU).

What `IpcReader.launch` does per load, call by call: the two events (made and recorded), the id upload (ring
slot's event, packing, slicing, the non-blocking copy, its event) and one compiled Triton launch of the gather
kernel (Qwen2.5-7B KV shape, float32, 28 per-layer tensors, a 512-block scattered request). Set these medians beside
`bench/host_profile/` 's per-call times inside the worker runtime, where the same calls run once per load.

    python3 bench/gpu_host_calls.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_launch_cost import worker  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.gpu_gather import GatherKernel, pack_ids, padded_pairs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--request-blocks", type=int, default=512)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    geometry, layout = KVGeometry(args.layers, 4, 128, "float32", 16), ParallelLayout()
    src_mem, src_regions = worker("cuda:0", args.layers, args.blocks)
    dst_mem, dst_regions = worker("cuda:0", args.layers, args.blocks)
    rank = WorkerRank(0, 0)
    segments = worker_segments(make_plan(layout, layout, geometry), rank, dst_mem, {rank: src_mem})[rank]
    kernel = GatherKernel(segments, src_mem.regions, src_regions, dst_mem.regions, dst_regions)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    rng = np.random.default_rng(0)
    sb = rng.permutation(args.blocks)[: args.request_blocks].astype(np.int64)
    db = rng.permutation(args.blocks)[: args.request_blocks].astype(np.int64)
    size = 2 * padded_pairs(len(sb))
    pinned = torch.empty(4096, dtype=torch.int32, pin_memory=True)
    host, device = pinned.numpy(), torch.empty(4096, dtype=torch.int32, device="cuda:0")
    uploaded = torch.cuda.Event()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
    pack_ids(host, sb, db)
    ids = device[:size]
    ids.copy_(pinned[:size], non_blocking=True)
    kernel.launch(ids, stream)
    torch.cuda.synchronize()
    d, h = device[:size], pinned[:size]

    def events_made_and_recorded():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
        a.record(stream)
        b.record(stream)

    calls = {
        "two events made and recorded": events_made_and_recorded,
        "two events recorded (reused)": lambda: (start.record(stream), end.record(stream)),
        "ring slot event synchronize": uploaded.synchronize,
        "pack_ids (512 pairs)": lambda: pack_ids(host, sb, db),
        "slice device and pinned buffers": lambda: (device[:size], pinned[:size]),
        "non-blocking copy of the ids": lambda: d.copy_(h, non_blocking=True),
        "upload event recorded": lambda: uploaded.record(stream),
        "gather kernel launch (compiled launcher)": lambda: kernel.launch(ids, stream),
    }
    medians = {}
    for name, call in calls.items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        medians[name] = statistics.median(times)
        print(f"{name:45} {medians[name]:8.1f} us")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record = {
        "command": [sys.executable, *sys.argv],
        "commit": commit.stdout.strip() or None,  # None: a tree without git (a device run's archive)
        "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "cpus": os.cpu_count()},
        "median_us": medians,
    }
    out = args.out / f"gpu-host-calls-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
