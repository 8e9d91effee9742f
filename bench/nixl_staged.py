"""Direct vs staged vs the one-descriptor anchor, side by side in one run.

One request's KV read by decode worker 0 from the prefill workers it needs, over NIXL between two processes,
scattered blocks on both sides (the setup of `bench/nixl_curve.py`, whose helpers this imports), three ways,
interleaved, each timed from "block ids in hand" to "bytes in place":

  direct   kvbridge's per-request path: coalesced descriptors (`worker_descriptors`), one READ per prefill worker
  staged   kvbridge's staged path, the real classes: `runtime.staging.Stager` in the prefill process (behind a real
           side channel, one port per prefill worker) gathers each part into its registered staging buffer,
           `runtime.staged_reads.StagedReads` in this process asks chunk by chunk (`wire.Stage`), READs each chunk
           as one descriptor into its own registered staging buffer and scatters it; parts of different prefill
           workers run on their own driver threads. The lease check is left out (the bench holds no requests).
  anchor   the same bytes per READ as one contiguous descriptor

plus what the cost model (`core.staging.StageCostModel`) would choose and its two estimates. Every direct and staged
READ is checked byte for byte on its first and last repetition. Also measured: the host gather rate (numpy take of
the request's runs into one buffer), the constant the cost model's copy term uses.

    python3 bench/nixl_staged.py                       # this machine: DRAM, UCX self,sm,cma,tcp; JSON to bench/results
    UCX_TLS=tcp python3 bench/nixl_staged.py           # the same over UCX tcp on loopback only
    python3 bench/nixl_staged.py --netns               # UCX tcp between two network namespaces (root, iproute2)
    # on the GPU device machine (host DRAM; NIXL there needs cuda_copy in UCX_TLS):
    UCX_TLS=self,sm,cma,tcp,cuda_copy python3 bench/nixl_staged.py --tokens 8192 --budget-s 500
    # KV in GPU memory (cuda:0 in both processes): staging buffers in VRAM, gathers and scatters torch copies on
    # the GPU (`transport.device_copy`); UCX_TLS left to UCX unless set
    python3 bench/nixl_staged.py --mem VRAM --tokens 8192 --budget-s 300
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
sys.path.insert(0, str(ROOT / "bench"))

import nixl_curve as curve  # noqa: E402
from kvbridge.core.config import BridgeConfig  # noqa: E402
from kvbridge.core.descriptors import Descriptors, block_lists, worker_descriptors  # noqa: E402
from kvbridge.core.identity import WorkerIdentity  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.staging import StageCostModel, cost_model  # noqa: E402
from kvbridge.core.topology import ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.runtime.load import Load, LoadJob  # noqa: E402
from kvbridge.runtime.nixl_reader import NixlReader  # noqa: E402
from kvbridge.runtime.peers import Peer  # noqa: E402
from kvbridge.runtime.staged_reads import StagedReads  # noqa: E402
from kvbridge.runtime.staging import Stager  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402
from kvbridge.wire import messages as wire  # noqa: E402
from kvbridge.wire.params import PrefillDone  # noqa: E402
from kvbridge.wire.side_channel import side_channel_port  # noqa: E402
from kvbridge.wire.side_channel_server import SideChannelServer  # noqa: E402

DECODE = curve.DECODE
WAYS = ("direct", "staged", "anchor")


def transport_config(device: str = "", mem: str = "DRAM") -> TransportConfig:
    default = "self,sm,cma,tcp" if mem == "DRAM" else None  # GPU memory: UCX's own choice, as NixlReads leaves it
    return TransportConfig(ucx_tls=os.environ.get("UCX_TLS", default), ucx_net_devices=device or "lo")


def tls_of(args) -> str | None:
    return transport_config(args.device, args.mem).ucx_tls


def staging_config(args) -> BridgeConfig:
    return BridgeConfig(
        nixl_staging_bytes=args.staging_mib << 20, nixl_staging_chunk_bytes=args.chunk_kib << 10, nixl_staging="always"
    )


def prefill_main(args) -> None:
    work = Path(args.dir)
    buf = curve.Buffer(curve.total_bytes(args), args.mem, args.seed)
    tensors = (buf.tensor,) if args.mem == "VRAM" else ()
    bs = min(args.block_sizes)
    memory = curve.memories(args, "tp=1", bs, buf.addr)[DECODE]  # the whole buffer; the most blocks of any case
    layout = ParallelLayout.parse("tp=4")  # a stager and a side channel for each of up to four prefill workers
    stagers = {rank: Stager(memory, args.staging_mib << 20, args.chunk_kib << 10, tensors) for rank in layout.workers()}
    servers = []
    with NixlTransport("staged-prefill", transport_config(args.device, args.mem)) as transport:
        transport.register(buf.memory(), args.mem)
        for stager in stagers.values():
            stager.start()
            transport.register(stager.memory_region, stager.mem_type)

        def answerer(stager: Stager):
            def answer(message: wire.Message) -> wire.Message:
                if isinstance(message, wire.Stage):
                    return stager.answer(message, time.monotonic() + 600, "bench")
                return wire.ErrorReply(message="unexpected")

            return answer

        for rank, stager in stagers.items():
            port = side_channel_port(args.port, layout, 0, rank)
            server = SideChannelServer(port, answerer(stager), host=args.host)
            server.start()
            servers.append(server)
        (work / "prefill.addr").write_text(str(buf.addr))
        (work / "prefill.staging").write_text(
            "\n".join(f"{rank.tp} {s.region.addr} {s.region.nbytes} {s.slot_bytes}" for rank, s in stagers.items())
        )
        (work / "prefill.meta.tmp").write_bytes(transport.agent_metadata())
        os.replace(work / "prefill.meta.tmp", work / "prefill.meta")
        backoff = Backoff(first_s=10e-6, cap_s=200e-6)  # the target's progress serves tcp GETs and notifications
        while not (work / "stop").exists():
            notes = transport.notifications()
            for raw_list in notes.values():
                for raw in raw_list:
                    msg = wire.decode(raw)
                    if isinstance(msg, wire.Notify):  # one agent here serves every worker: `expected` names it
                        stagers[WorkerRank(0, msg.expected - 1)].finish(msg.request_id, msg.engine_id, str(msg.worker))
            if notes:
                backoff.reset()
            backoff.sleep()
    for server in servers:
        server.close()
    for stager in stagers.values():
        stager.close()


def copy_rate(args) -> dict:
    """The gather rate for the cost model (`device_copy_rate` for GPU memory)."""
    return host_copy_rate() if args.mem == "DRAM" else device_copy_rate()


def device_copy_rate() -> dict:
    """`transport.device_copy.gather` on cuda:0 (what the stager runs for GPU memory) of 512 scattered rows of
    4/16/64 KiB into one chunk, median of 5."""
    import torch

    from kvbridge.core.memory import Region
    from kvbridge.core.staging import Piece
    from kvbridge.transport.device_copy import DeviceViews, gather

    rng = np.random.default_rng(0)
    out = {}
    for kib in (4, 16, 64):
        n = kib << 10
        rows = torch.ones(1024 * n, dtype=torch.uint8, device="cuda:0")
        views = DeviceViews([Region(rows.data_ptr(), rows.numel(), 0)], [rows])
        blocks = rng.permutation(1024)[:512].astype(np.int64)
        dst = torch.empty(512 * n, dtype=torch.uint8, device="cuda:0")
        seg = [np.array([v], dtype=np.int64) for v in (rows.data_ptr(), n, n)]
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            gather(views, *seg, blocks, [Piece(0, 0, 512, 0)], dst)
            times.append(time.perf_counter() - t0)
        out[f"{kib}KiB"] = dst.numel() / statistics.median(times[1:]) / 1e9
    return out


def host_copy_rate() -> dict:
    """The host gather rate for the cost model: `transport.host_copy.gather` (what the stager runs) of 512 scattered
    rows of 4/16/64 KiB into one chunk, median of 5."""
    from kvbridge.core.memory import Region
    from kvbridge.core.staging import Piece
    from kvbridge.transport.host_copy import HostViews, gather

    rng = np.random.default_rng(0)
    out = {}
    for kib in (4, 16, 64):
        n = kib << 10
        rows = np.ones(1024 * n, dtype=np.uint8)
        views = HostViews([Region(rows.ctypes.data, rows.nbytes, 0)])
        blocks = rng.permutation(1024)[:512].astype(np.int64)
        dst = np.empty(512 * n, dtype=np.uint8)
        seg = [np.array([v], dtype=np.int64) for v in (rows.ctypes.data, n, n)]
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            gather(views, *seg, blocks, [Piece(0, 0, 512, 0)], dst)
            times.append(time.perf_counter() - t0)
        out[f"{kib}KiB"] = dst.nbytes / statistics.median(times[1:]) / 1e9
    return out


def decode_main(args, child=None) -> list[dict]:
    work = Path(args.dir)
    while not (work / "prefill.meta").exists():
        if child is not None and child.poll() is not None:
            raise RuntimeError(f"the prefill process exited ({child.returncode})")
        time.sleep(0.05)
    nbytes = curve.total_bytes(args)
    src_base = int((work / "prefill.addr").read_text())
    from kvbridge.core.memory import Region

    staging = {}  # prefill tp rank -> (its staging region, slot bytes)
    for row in (work / "prefill.staging").read_text().splitlines():
        tp, s_addr, s_bytes, s_slot = (int(v) for v in row.split())
        staging[tp] = (Region(s_addr, s_bytes, 0), s_slot)
    ref = curve.Buffer(nbytes, args.mem, args.seed).view()  # the prefill's bytes (the same seed, the same device)
    dst = curve.Buffer(nbytes, args.mem, None)
    regions = (dst.tensor,) if args.mem == "VRAM" else ()
    rng = np.random.default_rng(args.seed + 1)
    model = cost_model(True, tls_of(args), args.mem)  # what the decode worker uses
    cases = []
    with NixlTransport("staged-decode", transport_config(args.device, args.mem)) as transport:
        transport.register(dst.memory(), args.mem)
        peer_name = transport.add_peer((work / "prefill.meta").read_bytes())
        reads = NixlReader(transport, "bench-decode", args.mem)
        t_start = time.monotonic()
        contexts = {}
        for bs in args.block_sizes:
            g = curve.geometry(args, bs)
            for ratio in args.ratios:
                p_text, d_text = curve.PAIRS[ratio]
                plan = make_plan(ParallelLayout.parse(p_text), ParallelLayout.parse(d_text), g)
                sources = curve.memories(args, p_text, bs, src_base)
                dst_mem = curve.memories(args, d_text, bs, dst.addr)[DECODE]
                contexts[bs, ratio] = (plan, sources, dst_mem)
        staged_by_mem: dict = {}
        for tokens in args.tokens:
            for (bs, ratio), (plan, sources, dst_mem) in contexts.items():
                if time.monotonic() - t_start > args.budget_s:
                    print(f"budget of {args.budget_s:g} s spent: stopping before bs={bs} {ratio} {tokens}")
                    break
                key = id(dst_mem)
                if key not in staged_by_mem:
                    ident = WorkerIdentity("bench-decode", plan.decode, 0, DECODE, plan.geometry)
                    staged = StagedReads(ident, dst_mem, staging_config(args), reads, None, model, regions)
                    with reads.lock:
                        staged.start()
                    staged_by_mem[key] = staged
                staged = staged_by_mem[key]
                peers = {r: Peer(peer_name, m, "bench", True, (), *staging[r.tp]) for r, m in sources.items()}
                case = measure(
                    args, transport, peer_name, plan, sources, dst_mem, peers, staged, tokens, bs, rng, dst, ref
                )
                case.update(ratio=ratio, prefill=curve.PAIRS[ratio][0], decode=curve.PAIRS[ratio][1], block_size=bs)
                check = case.pop("_check")
                case["exact"] = {w: check(w) for w in ("direct", "staged")}
                cases.append(case)
                print(line(case), flush=True)
                del check
        for staged in staged_by_mem.values():
            staged.close()
    return cases


def measure(args, transport, peer_name, plan, sources, dst_mem, peers, staged, tokens, bs, rng, dst, ref) -> dict:
    n = -(-tokens // bs)
    nb = curve.num_blocks(args, bs)
    sb, db = rng.permutation(nb)[:n], rng.permutation(nb)[:n]
    descs = {r: d for r, d in worker_descriptors(plan, DECODE, dst_mem, sources, sb, db).items() if len(d)}
    nbytes = sum(d.nbytes for d in descs.values())
    anchors = {}
    for r, d in descs.items():
        s0, d0 = sources[r].layers[0].addr, dst_mem.layers[0].addr
        anchors[r] = Descriptors(*(np.array([v], dtype=np.int64) for v in (s0, d0, d.nbytes, 0, 0)))
    segments = worker_segments(plan, DECODE, dst_mem, sources)  # once per peer, as NixlReads caches them
    chunk = min(staged.slot_bytes, peers[next(iter(peers))].staging_slot_bytes)
    model = staged.model
    choice = {
        str(r): {
            "descriptors": len(d),
            "bytes": d.nbytes,
            "direct_est_s": model.direct_s(d.nbytes, len(d)),
            "staged_est_s": model.staged_s(d.nbytes, chunk),
            "staged": model.prefers_staged(d.nbytes, len(d), chunk),
        }
        for r, d in descs.items()
    }
    request = [0]

    def post_direct():
        built = worker_descriptors(plan, DECODE, dst_mem, sources, sb, db)
        ts = [transport.read(peer_name, d, dst_mem, sources[r], b"") for r, d in built.items() if len(d)]
        for t in ts:
            transport.wait(t, args.read_timeout_s)
        for t in ts:
            transport.release(t)

    def post_anchor():
        ts = [transport.read(peer_name, a, dst_mem, sources[r], b"") for r, a in anchors.items()]
        for t in ts:
            transport.wait(t, args.read_timeout_s)
        for t in ts:
            transport.release(t)

    def post_staged():
        request[0] += 1
        source = PrefillDone(
            remote_engine_id="bench-prefill",
            remote_request_id=f"req-{request[0]}",
            remote_block_ids=[],
            remote_host=args.host,
            remote_port=args.port,
            remote_layout="tp=4",  # the prefill process listens on the ports of a tp=4 layout
        )
        job = LoadJob(f"d-{request[0]}", source, (tuple(db.tolist()),), (tuple(sb.tolist()),))
        load = Load(job, time.monotonic(), time.monotonic() + args.read_timeout_s)

        def note(rank):  # `expected` tells the prefill process which worker's stager served it (one agent there)
            return wire.encode(
                wire.Notify(
                    request_id=source.remote_request_id,
                    engine_id="bench-decode",
                    worker=wire.Worker(),
                    expected=rank.tp + 1,
                )
            )

        parts = []
        for r in descs:
            s_blocks, d_blocks = block_lists(sb, db, sources[r], dst_mem)
            part = staged.consider(load, r, peers[r], segments[r], s_blocks, d_blocks, len(descs[r]))
            if part is None:
                raise RuntimeError("no staging slots free")
            parts.append(part)
        for part in parts:
            staged.run(part, note(part.rank))
        backoff = Backoff(first_s=20e-6, cap_s=1e-3)
        while not all(p.finished for p in parts):
            backoff.sleep()
        errors = [p.error for p in parts if p.error]
        if errors:
            raise RuntimeError(errors[0])
        return sum(p.reads for p in parts)

    ways = {"direct": post_direct, "staged": post_staged, "anchor": post_anchor}
    times = {w: [] for w in ways}
    ok = {"direct": True, "staged": True}
    errors = {}
    staged_reads = 0
    fallbacks0 = staged.fallbacks
    for rep in range(args.reps + 1):
        for way, post in ways.items():
            if way in errors:
                continue
            check = way in ok and rep in (0, args.reps)
            if check:
                dst.clear()
            try:
                t0 = time.perf_counter()
                result = post()
                s = time.perf_counter() - t0
            except Exception as exc:
                errors[way] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            if way == "staged":
                staged_reads = result
            if rep:
                times[way].append(s)
            if check:
                view = dst.view()
                base = int(sources[next(iter(sources))].regions[0].addr)
                ok[way] &= all(curve.exact(d, ref, view, base, dst.addr) for d in descs.values())
    case = {
        "tokens": tokens,
        "blocks": n,
        "bytes": nbytes,
        "reps": args.reps,
        "descriptors": {"direct": sum(len(d) for d in descs.values()), "staged": staged_reads, "anchor": len(anchors)},
        "chunk_bytes": chunk,
        "staged_fallbacks": staged.fallbacks - fallbacks0,
        "model": choice,
        "errors": errors,
    }
    for way in ways:
        if times[way]:
            med = statistics.median(times[way])
            case[way] = {"s": med, "times_s": times[way], "gbps": nbytes / med / 1e9}
    if "anchor" in case:
        for way in ok:
            if way in case:
                case[way]["ratio_to_anchor"] = case["anchor"]["s"] / case[way]["s"]
    case["_check"] = lambda w: ok.get(w) and w not in errors
    return case


def line(case: dict) -> str:
    parts = [f"bs={case['block_size']:3} {case['ratio']:4} {case['tokens']:6} tok {case['bytes'] / 2**20:6.0f} MiB:"]
    for way in WAYS:
        if way in case:
            c = case[way]
            r = f" x{c['ratio_to_anchor']:.2f}" if "ratio_to_anchor" in c else ""
            parts.append(f"{way} {c['gbps']:5.2f} GB/s{r} ({case['descriptors'][way]})")
        elif way in case["errors"]:
            parts.append(f"{way} ERROR {case['errors'][way][:80]}")
    picks = {m["staged"] for m in case["model"].values()}
    parts.append(f"model: {'staged' if picks == {True} else 'direct' if picks == {False} else 'mixed'}")
    parts.append("" if all(case["exact"].values()) else f"MISMATCH {case['exact']}")
    return "  ".join(parts)


def fit(cases: list[dict]) -> dict:
    """The cost model's transport constants from this run: least squares of time = descriptors x desc_s + bytes /
    link over every direct and anchor READ (medians)."""
    rows, times = [], []
    for c in cases:
        for way in ("direct", "anchor"):
            if way in c:
                rows.append([c["descriptors"][way], c["bytes"]])
                times.append(c[way]["s"])
    if len(rows) < 3:
        return {}
    (desc_s, per_byte), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(times), rcond=None)
    pred = np.array(rows, dtype=float) @ np.array([desc_s, per_byte])
    return {
        "desc_s": float(desc_s),
        "link_bytes_per_s": float(1 / per_byte) if per_byte > 0 else None,
        "median_rel_error": float(np.median(np.abs(pred - times) / np.array(times))),
        "points": len(rows),
    }


def render(path: Path) -> str:
    record = json.loads(path.read_text())
    order = list(curve.PAIRS)
    cases = sorted(record["cases"], key=lambda c: (c["tokens"], c["block_size"], order.index(c["ratio"])))
    tls = record["transport"].rsplit("UCX_TLS=", 1)[-1]
    mem = "VRAM" if ", VRAM, " in record["transport"] else "DRAM"
    tls_arg = None if tls == "None" else tls
    model = cost_model(True, tls_arg, mem)  # the picks with the constants in the code now
    # GPU memory: also the picks once the first load's rate showed UCX emulating the path (NixlReads._judge_rate)
    emulated = cost_model(True, tls_arg, mem, emulated=True) if mem == "VRAM" else None
    extra_head = " picked / anchor | emulated model picks | picked / anchor |" if emulated else ""
    rows = [
        f"Source: `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`; {record['transport']}; "
        f"machine: {record['machine'].get('host')} ({record['machine'].get('cpu_count')} CPUs); chunk "
        f"{cases[0]['chunk_bytes'] >> 10} KiB. Ratio = anchor time / time (median of {cases[0]['reps']}). "
        f"Model picks: `core.staging.cost_model(same_host=True, UCX_TLS={tls}, {mem})` per prefill worker read"
        + (
            ", and with `emulated=True` (what the decode worker uses once a load's rate shows emulation)."
            if emulated
            else "."
        ),
        "",
        "| tokens | block | TP | MiB | direct GB/s (descs) | staged GB/s (READs) | anchor GB/s | direct / anchor |"
        " staged / anchor | model picks |" + extra_head + " exact |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if emulated else "") + "---|",
    ]
    for c in cases:

        def g(w, c=c):
            return f"{c[w]['gbps']:.2f}" if w in c else "error"

        def r(w, c=c):
            return f"{c[w]['ratio_to_anchor']:.2f}" if w in c and "ratio_to_anchor" in c[w] else "-"

        def pick(m, c=c):
            picks = {m.prefers_staged(v["bytes"], v["descriptors"], c["chunk_bytes"]) for v in c["model"].values()}
            return "staged" if picks == {True} else "direct" if picks == {False} else "mixed"

        extra = ""
        if emulated:
            p1, p2 = pick(model), pick(emulated)
            extra = f" {r(p1) if p1 != 'mixed' else '-'} | {p2} | {r(p2) if p2 != 'mixed' else '-'} |"
        rows.append(
            f"| {c['tokens']} | {c['block_size']} | {c['ratio']} | {c['bytes'] / 2**20:.0f} | {g('direct')} "
            f"({c['descriptors']['direct']}) | {g('staged')} ({c['descriptors']['staged']}) | {g('anchor')} | "
            f"{r('direct')} | {r('staged')} | {pick(model)} |{extra} {'yes' if all(c['exact'].values()) else 'NO'} |"
        )
    return "\n".join(rows) + "\n"


def run_netns(args, passed: list[str], env: dict, work: str) -> tuple[list[dict], dict]:
    """Prefill and decode processes in the namespaces of tests/support/hosts.py (root, iproute2),
    UCX tcp on their veths."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from hosts import network_hosts

    env = {k: v for k, v in env.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES")}
    env["UCX_TLS"] = "tcp"
    with network_hosts("prefill", "decode") as hosts:
        procs = []
        for role in ("prefill", "decode"):
            host = hosts[role]
            cmd = ["ip", "netns", "exec", host.netns, sys.executable, __file__, *passed, "--role", role]
            cmd += ["--dir", work, "--port", str(args.port), "--host", hosts["prefill"].ip, "--device", host.device]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            if procs[1].wait(timeout=args.budget_s + 600):
                raise RuntimeError(f"the decode process exited with {procs[1].returncode}")
        finally:
            Path(work, "stop").touch()
            procs[0].wait(timeout=60)
        info = {r: {"ip": h.ip, "device": h.device} for r, h in hosts.items()}
    return json.loads(Path(work, "cases.json").read_text()), info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "prefill", "decode"], default="run")
    p.add_argument("--netns", action="store_true", help="prefill and decode in two network namespaces, UCX tcp")
    p.add_argument("--host", default="127.0.0.1", help="the prefill process's side-channel address (set by --netns)")
    p.add_argument("--device", default="", help="UCX_NET_DEVICES (set by --netns; default lo)")
    p.add_argument("--dir", default="")
    p.add_argument("--block-sizes", nargs="+", type=int, default=[16, 64, 128])
    p.add_argument("--ratios", nargs="+", default=list(curve.PAIRS), choices=list(curve.PAIRS))
    p.add_argument("--tokens", nargs="+", type=int, default=[8192])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--layout", default="LBHNC")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staging-mib", type=int, default=64, help="each side's staging buffer")
    p.add_argument("--chunk-kib", type=int, default=8192, help="a chunk (a staging slot)")
    p.add_argument("--port", type=int, default=0, help="base side-channel port (0: a free one)")
    p.add_argument("--read-timeout-s", type=float, default=120.0)
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--render", type=Path)
    p.add_argument("--mem", choices=["DRAM", "VRAM"], default="DRAM", help="where both sides' KV and staging live")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0
    if args.role == "prefill":
        prefill_main(args)
        return 0
    if args.role == "decode":  # --netns: the decode process in its namespace
        Path(args.dir, "cases.json").write_text(json.dumps(decode_main(args)))
        return 0
    if not args.port:
        from kvbridge.serving.launcher import free_base_port

        args.port = free_base_port(4)
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a and a != "--netns"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    hosts_info = None
    with tempfile.TemporaryDirectory() as work:
        if args.netns:
            cases, hosts_info = run_netns(args, passed, env, work)
        else:
            child = subprocess.Popen(
                [sys.executable, __file__, *passed, "--role", "prefill", "--dir", work, "--port", str(args.port)],
                env=env,
            )
            try:
                args.dir = work
                cases = decode_main(args, child)
            finally:
                Path(work, "stop").touch()
                child.wait(timeout=60)
    if args.netns:
        os.environ["UCX_TLS"] = "tcp"
    record = {
        "command": [sys.executable, *sys.argv],
        "settings": {k: str(v) for k, v in vars(args).items()},
        "transport": (
            "NIXL UCX between two network namespaces (veth), "
            if args.netns
            else "NIXL UCX between two processes on one host, "
        )
        + f"{args.mem}, {args.layout}, "
        f"UCX_TLS={tls_of(args)}",
        "machine": curve.machine(args),
        "copy_gbps": copy_rate(args),
        "cost_model": {
            k: getattr(cost_model(True, tls_of(args), args.mem), k) for k in StageCostModel.__dataclass_fields__
        },
        "hosts": hosts_info,
        "wall_s": time.time() - t0,
        "fitted": fit(cases),
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"nixl-staged-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(render(path))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
