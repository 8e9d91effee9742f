"""DRAM over UCX tcp between two network namespaces (the path across hosts): one request's NIXL READ three ways.

A prefill process in one namespace registers its KV buffer (host memory, one LBNHC buffer); a decode process in
the other reads a request's blocks from it over UCX tcp on the namespaces' veth devices (UCX_TLS=tcp: no shared
memory or CMA between them), timing each way from "descriptors in hand" to "bytes in place":

  nixl         kvbridge's per-request path: coalesced descriptors, `NixlTransport.read` (initialize_xfer)
  nixl-prep    prepared lists: the pair's PreparedTable prepared once, `read_prepared` (make_prepped_xfer)
  nixl-contig  the anchor: the same bytes as one contiguous region (one descriptor)

Every nixl and nixl-prep READ is checked byte for byte against the prefill buffer's seeded contents. The
namespaces come from tests/support/hosts.py (root and iproute2 needed); the processes exchange metadata through files.

    .venv/bin/python bench/cpu_netns_nixl.py                      # writes bench/results/cpu-netns-nixl-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from kvbridge.core.descriptors import Descriptors, PreparedTable, worker_descriptors  # noqa: E402
from kvbridge.core.memory import synthesize_memory  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402

RANK = WorkerRank(0, 0)


def geometry(args) -> KVGeometry:
    return KVGeometry(args.layers, args.kv_heads, args.head_size, "bfloat16", args.block_size)


def buffer_bytes(args) -> int:
    return (
        synthesize_memory(args.layout, geometry(args), list(range(args.layers)), args.kv_heads, args.blocks, 0)
        .regions[0]
        .nbytes
    )


def contents(args) -> np.ndarray:
    return np.random.default_rng(args.seed).integers(0, 256, buffer_bytes(args), dtype=np.uint8)


def transport_config(device: str) -> TransportConfig:
    return TransportConfig(ucx_tls="tcp", ucx_net_devices=device)


def prefill_main(args) -> None:
    work = Path(args.dir)
    buf = contents(args)
    mem = synthesize_memory(
        args.layout, geometry(args), list(range(args.layers)), args.kv_heads, args.blocks, buf.ctypes.data
    )
    with NixlTransport("netns-prefill", transport_config(args.device)) as transport:
        transport.register(mem, "DRAM")
        (work / "prefill.meta.tmp").write_bytes(transport.agent_metadata())
        os.replace(work / "prefill.meta.tmp", work / "prefill.meta")
        (work / "prefill.addr").write_text(str(buf.ctypes.data))
        backoff = Backoff(first_s=10e-6, cap_s=100e-6)  # the target's progress serves the reader's tcp GETs
        while not (work / "stop").exists():
            if transport.notifications():
                backoff.reset()
            backoff.sleep()


def decode_main(args) -> None:
    work = Path(args.dir)
    while not (work / "prefill.meta").exists():
        time.sleep(0.05)
    g = geometry(args)
    src_base = int((work / "prefill.addr").read_text())
    ref = contents(args)
    dst = np.zeros(buffer_bytes(args), dtype=np.uint8)
    layers = list(range(args.layers))
    src_mem = synthesize_memory(args.layout, g, layers, args.kv_heads, args.blocks, src_base)
    dst_mem = synthesize_memory(args.layout, g, layers, args.kv_heads, args.blocks, dst.ctypes.data)
    plan = make_plan(ParallelLayout.parse("pp=1"), ParallelLayout.parse("pp=1"), g)
    cases = []
    with NixlTransport("netns-decode", transport_config(args.device)) as transport:
        transport.register(dst_mem, "DRAM")
        peer = transport.add_peer((work / "prefill.meta").read_bytes())
        t0 = time.perf_counter()
        segments = worker_segments(plan, RANK, dst_mem, {RANK: src_mem})[RANK]
        prepared = transport.prepare(peer, PreparedTable(segments, args.blocks, args.blocks), dst_mem, src_mem)
        prep_s = time.perf_counter() - t0
        n = -(-args.tokens // args.block_size)
        rng = np.random.default_rng(args.seed + 1)
        for pattern in args.patterns:
            if pattern == "contiguous":
                sb, db = np.arange(1, 1 + n), np.arange(2, 2 + n)
            else:
                sb, db = rng.permutation(args.blocks)[:n], rng.permutation(args.blocks)[:n]
            t0 = time.perf_counter()
            descs = worker_descriptors(plan, RANK, dst_mem, {RANK: src_mem}, sb, db)[RANK]
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            src_idx, dst_idx = prepared.table.indices(sb, db)
            index_s = time.perf_counter() - t0
            one = Descriptors(*(np.array([v], dtype=np.int64) for v in (src_base, dst.ctypes.data, descs.nbytes, 0, 0)))
            ways = {
                "nixl": (lambda d=descs: transport.read(peer, d, dst_mem, src_mem, b"b"), True),
                "nixl-prep": (lambda s=src_idx, d=dst_idx: transport.read_prepared(prepared, s, d, b"b"), True),
                "nixl-contig": (lambda d=one: transport.read(peer, d, dst_mem, src_mem, b"b"), False),
            }
            case = {"pattern": pattern, "blocks": n, "bytes": descs.nbytes, "descriptors": len(descs)}
            case.update(build_s=build_s, index_s=index_s, prep_s=prep_s)
            times: dict[str, list[float]] = {w: [] for w in ways}
            ok = {w: True for w in ways}
            for rep in range(args.reps + 1):  # interleaved, the first round a warm-up
                for way, (post, check) in ways.items():
                    dst[:] = 0
                    t0 = time.perf_counter()
                    transfer = post()
                    transport.wait(transfer, 120)
                    s = time.perf_counter() - t0
                    transport.release(transfer)
                    if rep:
                        times[way].append(s)
                    if check and rep in (0, args.reps):
                        ok[way] &= exact(descs, ref, dst, src_base, dst.ctypes.data)
            for way in ways:
                med = statistics.median(times[way])
                case[way] = {"s": med, "times_s": times[way], "gbps": descs.nbytes / med / 1e9}
                if ways[way][1]:
                    case[way]["ok"] = ok[way]
            anchor = case["nixl-contig"]["s"]
            for way in ("nixl", "nixl-prep"):
                case[way]["ratio_to_anchor"] = anchor / case[way]["s"]
            cases.append(case)
            print(
                f"{pattern:10} {len(descs):6} descs {descs.nbytes / 2**20:6.0f} MiB: "
                + "  ".join(f"{w} {case[w]['s'] * 1e3:7.1f} ms ({case[w]['gbps']:.2f} GB/s)" for w in ways)
                + f"  per-request/anchor {case['nixl']['ratio_to_anchor']:.2f}"
                f"  prepared/anchor {case['nixl-prep']['ratio_to_anchor']:.2f}  checks {ok}",
                flush=True,
            )
    (work / "decode.json").write_text(json.dumps(cases))


def exact(descs: Descriptors, ref: np.ndarray, dst: np.ndarray, src_base: int, dst_base: int) -> bool:
    for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
        if not np.array_equal(dst[d - dst_base : d - dst_base + n], ref[s - src_base : s - src_base + n]):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "prefill", "decode"], default="run")
    p.add_argument("--dir", default="")
    p.add_argument("--device", default="", help="UCX_NET_DEVICES (set by the run role)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layout", default="LBNHC")
    p.add_argument("--blocks", type=int, default=1100)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--patterns", nargs="+", default=["contiguous", "scattered"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if args.role == "prefill":
        prefill_main(args)
        return 0
    if args.role == "decode":
        decode_main(args)
        return 0

    from hosts import network_hosts

    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--role", "run")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("UCX_TLS", None)
    env.pop("UCX_NET_DEVICES", None)
    with tempfile.TemporaryDirectory() as work, network_hosts("prefill", "decode") as hosts:
        procs = []
        for role in ("prefill", "decode"):
            host = hosts[role]
            cmd = ["ip", "netns", "exec", host.netns, sys.executable, __file__, *passed]
            cmd += ["--role", role, "--dir", work, "--device", host.device]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            rc = procs[1].wait(timeout=900)
        finally:
            Path(work, "stop").touch()
            procs[0].wait(timeout=30)
        if rc != 0:
            return rc
        cases = json.loads(Path(work, "decode.json").read_text())
        record = {
            "command": [sys.executable, *sys.argv],
            "settings": {k: str(v) for k, v in vars(args).items()},
            "transport": "NIXL 1.5.1 UCX, UCX_TLS=tcp over veth between two network namespaces, DRAM",
            "machine": {"cpu_count": os.cpu_count(), "platform": sys.platform},
            "hosts": {name: {"ip": h.ip, "device": h.device} for name, h in hosts.items()},
            "cases": cases,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu-netns-nixl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
