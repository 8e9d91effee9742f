"""kvbridge's KV channel against NIXL over UCX tcp, same link, same run: scattered 8k-token requests between two
network namespaces.

A prefill process in one namespace holds a KV buffer (host memory, seeded contents), registered with NIXL (UCX_TLS=tcp
on its veth device: the opt-in deployment, `ucx_tcp_exposes_process_memory`) and served by two
`runtime.stream_server.KvStreamServer`s (AES-256-GCM frames, and integrity only). A decode process in the other
namespace reads the same request's blocks (scattered on both sides) three ways, interleaved, each timed from "block
ids in hand" to "bytes in place":

  ucx-tcp           kvbridge's NIXL path: coalesced descriptors, one READ (`NixlTransport.read`), polled to its end
  stream            the real `runtime.stream_reads.StreamReads` (pooled authenticated connections, chunks gathered,
                    sealed, sent, opened and scattered), encrypted; the connections of the first repetition are
                    set up in its time, later ones reuse them (as a decode does)
  stream-integrity  the same, frames authenticated but not encrypted (`kv_stream_encrypt: false`)

Every way's result is checked byte for byte against the seeded contents on its first and last repetition. The
claim check is left out (the bench holds no requests: the servers grant every read). The namespaces come from
tests/support/hosts.py (root and iproute2 needed).

    flock /tmp/kvbridge-vllm.lock .venv/bin/python bench/kv_stream_rate.py   # bench/results/kv-stream-rate-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from kvbridge.core.config import BridgeConfig  # noqa: E402
from kvbridge.core.descriptors import Descriptors, worker_descriptors  # noqa: E402
from kvbridge.core.identity import WorkerIdentity  # noqa: E402
from kvbridge.core.memory import synthesize_memory  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.runtime.load import Load, LoadJob  # noqa: E402
from kvbridge.runtime.peers import Engine, Peer  # noqa: E402
from kvbridge.runtime.stream_reads import StreamReads  # noqa: E402
from kvbridge.runtime.stream_server import KvStreamServer  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.kv_stream import stream_key  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402
from kvbridge.wire.params import PrefillDone  # noqa: E402

RANK = WorkerRank(0, 0)
KEY = b"kv-stream-rate-bench-deployment-key"
WAYS = ("ucx-tcp", "stream", "stream-integrity")


def geometry(args) -> KVGeometry:
    return KVGeometry(args.layers, args.kv_heads, args.head_size, "bfloat16", args.block_size)


def memory(args, addr: int):
    return synthesize_memory(args.layout, geometry(args), list(range(args.layers)), args.kv_heads, args.blocks, addr)


def contents(args) -> np.ndarray:
    return np.random.default_rng(args.seed).integers(0, 256, memory(args, 0).regions[0].nbytes, dtype=np.uint8)


def transport_config(device: str) -> TransportConfig:
    return TransportConfig(ucx_tls="tcp", ucx_net_devices=device)


def prefill_main(args) -> None:
    work = Path(args.dir)
    buf = contents(args)
    mem = memory(args, buf.ctypes.data)
    servers = {
        mode: KvStreamServer(mem, stream_key(KEY), lambda r: float("inf"), host=args.ip, mode=mode).start()
        for mode in ("encrypt", "integrity")
    }
    try:
        with NixlTransport("rate-prefill", transport_config(args.device)) as transport:
            transport.register(mem, "DRAM")
            (work / "prefill.json").write_text(
                json.dumps({"addr": buf.ctypes.data, "ports": {m: s.port for m, s in servers.items()}})
            )
            (work / "prefill.meta.tmp").write_bytes(transport.agent_metadata())
            os.replace(work / "prefill.meta.tmp", work / "prefill.meta")
            backoff = Backoff(first_s=10e-6, cap_s=100e-6)  # the target's progress serves the reader's tcp GETs
            while not (work / "stop").exists():
                if transport.notifications():
                    backoff.reset()
                backoff.sleep()
    finally:
        for s in servers.values():
            s.close()


class StreamWay:
    """A StreamReads reading one engine (the prefill process), a load at a time."""

    def __init__(self, args, dst_mem, src_mem, port: int, encrypt: bool) -> None:
        config = BridgeConfig(
            kv_stream_encrypt=encrypt,
            kv_stream_connections=args.connections,
            kv_stream_chunk_bytes=args.chunk_kib << 10,
        )
        layout = ParallelLayout()
        self.identity = WorkerIdentity("decode", layout, 0, RANK, geometry(args))
        self.done = threading.Event()
        self.error = ""
        self.reads = StreamReads(self.identity, dst_mem, config, KEY, loaded=self._loaded, failed=self._failed).start()
        peer = Peer("rate-prefill", src_mem, "bench", stream_port=port)
        self.engine = Engine(
            ("prefill", args.prefill_ip, 5600, 0), layout, {RANK: peer}, make_plan(layout, layout, geometry(args))
        )
        self.engine.stream = True
        self.host = args.prefill_ip

    def _loaded(self, load) -> None:
        self.done.set()

    def _failed(self, load, error: str) -> None:
        self.error = error
        self.done.set()

    def read(self, sb: np.ndarray, db: np.ndarray) -> None:
        source = PrefillDone(
            remote_engine_id="prefill",
            remote_request_id="r",
            remote_block_ids=sb.tolist(),
            remote_host=self.host,
            remote_port=5600,
            remote_layout="pp=1,tp=1",
            remote_token="t",
        )
        job = LoadJob("r", source, (tuple(db.tolist()),), (tuple(sb.tolist()),))
        now = time.monotonic()
        load = Load(job, now, now + 120, engine=self.engine)
        self.done.clear()
        self.reads.launch(load)
        self.done.wait(150)
        if self.error:
            raise RuntimeError(self.error)

    def close(self) -> None:
        self.reads.close()


def exact(descs: Descriptors, ref: np.ndarray, dst: np.ndarray, src_base: int, dst_base: int) -> bool:
    for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
        if not np.array_equal(dst[d - dst_base : d - dst_base + n], ref[s - src_base : s - src_base + n]):
            return False
    return True


def decode_main(args) -> None:
    work = Path(args.dir)
    while not (work / "prefill.meta").exists():
        time.sleep(0.05)
    info = json.loads((work / "prefill.json").read_text())
    src_base = info["addr"]
    ref = contents(args)
    dst = np.zeros(ref.nbytes, dtype=np.uint8)
    src_mem, dst_mem = memory(args, src_base), memory(args, dst.ctypes.data)
    layout = ParallelLayout()
    plan = make_plan(layout, layout, geometry(args))
    n = -(-args.tokens // args.block_size)
    rng = np.random.default_rng(args.seed + 1)
    streams = {
        "stream": StreamWay(args, dst_mem, src_mem, info["ports"]["encrypt"], True),
        "stream-integrity": StreamWay(args, dst_mem, src_mem, info["ports"]["integrity"], False),
    }
    cases = []
    try:
        with NixlTransport("rate-decode", transport_config(args.device)) as transport:
            transport.register(dst_mem, "DRAM")
            peer = transport.add_peer((work / "prefill.meta").read_bytes())
            for case_no in range(args.requests):
                sb, db = rng.permutation(args.blocks)[:n], rng.permutation(args.blocks)[:n]
                descs = worker_descriptors(plan, RANK, dst_mem, {RANK: src_mem}, sb, db)[RANK]

                def ucx(d=descs) -> None:
                    transfer = transport.read(peer, d, dst_mem, src_mem, b"b")
                    try:
                        transport.wait(transfer, 120)
                    finally:
                        transport.release(transfer)

                ways = {"ucx-tcp": ucx, **{w: (lambda s=s, a=sb, b=db: s.read(a, b)) for w, s in streams.items()}}
                times: dict[str, list[float]] = {w: [] for w in ways}
                ok = dict.fromkeys(ways, True)
                for rep in range(args.reps + 1):  # interleaved; the first round a warm-up
                    for way, run in ways.items():
                        dst[:] = 0
                        t0 = time.perf_counter()
                        run()
                        s = time.perf_counter() - t0
                        if rep:
                            times[way].append(s)
                        if rep in (0, args.reps):
                            ok[way] &= exact(descs, ref, dst, src_base, dst.ctypes.data)
                case = {"request": case_no, "blocks": n, "bytes": descs.nbytes, "descriptors": len(descs)}
                for way in ways:
                    med = statistics.median(times[way])
                    case[way] = {"s": med, "times_s": times[way], "gbps": descs.nbytes / med / 1e9, "ok": ok[way]}
                for way in streams:
                    case[way]["ratio_to_ucx_tcp"] = case["ucx-tcp"]["s"] / case[way]["s"]
                cases.append(case)
                print(
                    f"request {case_no}: {n} blocks, {len(descs)} descs, {descs.nbytes / 2**20:.0f} MiB: "
                    + "  ".join(f"{w} {case[w]['s'] * 1e3:.0f} ms ({case[w]['gbps']:.2f} GB/s)" for w in ways)
                    + "  ratios "
                    + " ".join(f"{w} {case[w]['ratio_to_ucx_tcp']:.2f}" for w in streams)
                    + f"  exact {all(case[w]['ok'] for w in ways)}",
                    flush=True,
                )
    finally:
        for s in streams.values():
            s.close()
    (work / "decode.json").write_text(json.dumps(cases))


def git_commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src", "bench"], capture_output=True)
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "prefill", "decode"], default="run")
    p.add_argument("--dir", default="")
    p.add_argument("--device", default="", help="UCX_NET_DEVICES (set by the run role)")
    p.add_argument("--ip", default="", help="this namespace's address (set by the run role)")
    p.add_argument("--prefill-ip", default="", help="(set by the run role)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layout", default="LBNHC")
    p.add_argument("--blocks", type=int, default=1100)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--requests", type=int, default=2, help="scattered requests (other block ids each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--connections", type=int, default=BridgeConfig().kv_stream_connections)
    p.add_argument("--chunk-kib", type=int, default=BridgeConfig().kv_stream_chunk_bytes >> 10)
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
            cmd += ["--role", role, "--dir", work, "--device", host.device, "--ip", host.ip]
            cmd += ["--prefill-ip", hosts["prefill"].ip]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            rc = procs[1].wait(timeout=900)
        finally:
            Path(work, "stop").touch()
            procs[0].wait(timeout=30)
        if rc != 0:
            return rc
        cases = json.loads(Path(work, "decode.json").read_text())
        summary = {
            way: {
                "median_ratio_to_ucx_tcp": statistics.median(c[way]["ratio_to_ucx_tcp"] for c in cases),
                "median_gbps": statistics.median(c[way]["gbps"] for c in cases),
            }
            for way in ("stream", "stream-integrity")
        }
        summary["ucx-tcp"] = {"median_gbps": statistics.median(c["ucx-tcp"]["gbps"] for c in cases)}
        record = {
            "command": [sys.executable, *sys.argv],
            "commit": git_commit(),
            "settings": {k: str(v) for k, v in vars(args).items()},
            "transports": {
                "ucx-tcp": "NIXL UCX, UCX_TLS=tcp over the veth between two network namespaces, DRAM",
                "stream": "kvbridge KV channel, AES-256-GCM, TCP over the same veth",
                "stream-integrity": "kvbridge KV channel, AES-GCM integrity only (KV as associated data)",
            },
            "machine": {"cpu_count": os.cpu_count(), "platform": sys.platform, "uname": " ".join(os.uname())},
            "hosts": {name: {"ip": h.ip, "device": h.device} for name, h in hosts.items()},
            "summary": summary,
            "cases": cases,
        }
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kv-stream-rate-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
