"""GPU benchmark of a request's KV transfer, prefill workers on GPU 0 -> decode workers on GPU 1, for layout pairs.

Every worker's KV is one buffer in vLLM 0.32's GPU layout (per-layer views of [blocks, kv heads, block size,
2*head size], physical order LBNHC by default, or LBHNC), described with kvbridge.core.memory.synthesize_memory
over the tensor's address; the plan (kvbridge.core.plan.make_plan) and descriptors
(kvbridge.core.descriptors.worker_descriptors) say what each decode worker copies. The prefill workers live in a
spawned process on GPU 0; this process holds the decode workers on GPU 1. For each (layout pair, physical layout,
prompt tokens, contiguous/scattered blocks) it times:

  copy       torch copy_ of as many contiguous bytes, cuda:0 -> cuda:1, in this process (the hardware reference)
  nixl       kvbridge's path: coalesced descriptors, NIXL READs (UCX, VRAM) between the two processes
  nixl-blk   the same with one descriptor per (layer, block): what vLLM's NixlConnector posts
  nixl-prep  kvbridge's prepared lists (`NixlTransport.prepare` once per (decode, prefill) worker pair: every run
             of every block; `read_prepared` names the request's runs by index: NIXL's make_prepped_xfer)
  nixl-contig  the anchor: the same transport moving the same bytes per READ as one contiguous region
  kernel     the prefill buffers shared through CUDA IPC; a kernel on GPU 0 copies every coalesced descriptor's
             bytes into GPU 1 over NVLink (bench/gpu_peer_gather.py), for each kernel configuration

Times run from "descriptors in hand" to "bytes in place" (NIXL: descriptor lists, xfer creation, posting, polling;
kernel: packing the runs into pinned memory, uploads and launches batch by batch, wait); building the descriptors
is reported on its own. Every variant is checked byte for byte against a reference of the prefill bytes (the
request's pages equal, every other decode byte untouched). Prints a table; writes the full JSON (command, machine,
settings, every figure) to --out.

    python3 bench/gpu_transfer.py                      # on nvidia-h200-x2; see docs/benchmarks/gpu-one-node.md
    .venv/bin/python bench/gpu_transfer.py --sim-cpu   # the same logic on CPU buffers (DRAM NIXL, memmove kernel)

One GPU (`--decode-gpu 0`): both sides on cuda:0. `--nixl-peer` says where the prefill agent lives: `process` (the
spawned prefill process, as across hosts), `agent` (a second agent in this process, over buffers allocated here),
`self` (NIXL loopback: this process's one agent reads its own registered prefill buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_peer_gather as gather  # noqa: E402
from kvbridge.core.descriptors import Descriptors, PreparedTable, worker_descriptors  # noqa: E402
from kvbridge.core.memory import NAMED_LAYOUTS, WorkerMemory, synthesize_memory  # noqa: E402
from kvbridge.core.plan import TransferPlan, make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402

PAIRS = {
    "pp2->pp1": ("pp=2", "pp=1"),
    "pp1->tp2": ("pp=1", "tp=2"),
    "pp2->tp2": ("pp=2", "tp=2"),
    "pp1->pp1": ("pp=1", "pp=1"),
}
POISON = 0x7FC1  # an int16 (a bf16 NaN) written over the decode buffers before each transfer
INT16 = torch.int16


# -- setup shared by both processes ------------------------------------------------------------------------


def geometry(args) -> KVGeometry:
    return KVGeometry(args.layers, args.kv_heads, args.head_size, "bfloat16", args.block_size)


def worker_shape(layout: ParallelLayout, g: KVGeometry, rank: WorkerRank) -> tuple[range, range]:
    return layout.stage_layers(g.num_layers, rank.pp), layout.kv_heads(g.num_kv_heads, rank.tp)


def buffer_numel(g: KVGeometry, layers: range, heads: range, blocks: int) -> int:
    return len(layers) * blocks * len(heads) * g.block_size * 2 * g.head_size


def worker_keys(args, side: int) -> list[tuple[str, WorkerRank]]:
    """(layout text, rank) of every worker buffer one side needs (side 0: prefill, 1: decode)."""
    keys: list[tuple[str, WorkerRank]] = []
    for pair in args.pairs:
        text = PAIRS[pair][side]
        for rank in ParallelLayout.parse(text).workers():
            if (text, rank) not in keys:
                keys.append((text, rank))
    return keys


def fill_pattern(t16: torch.Tensor, seed: int, chunk: int = 1 << 27) -> None:
    """Deterministic, device-independent pseudo-random int16 contents (a 32-bit hash of index and seed), so that
    the decode process can rebuild the prefill bytes on its own GPU for the checks."""
    n = t16.numel()
    salt = (seed * 0x9E3779B1) & 0xFFFFFFFF
    for start in range(0, n, chunk):
        idx = torch.arange(start, min(n, start + chunk), dtype=torch.int64, device=t16.device)
        x = (idx & 0xFFFFFFFF) ^ (((idx >> 32) * 0x85EBCA6B + salt) & 0xFFFFFFFF)
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (x >> 16) ^ x
        t16[start : start + idx.numel()] = ((x & 0xFFFF) - 32768).to(INT16)


def seed_of(text: str, rank: WorkerRank) -> int:
    return 1 + sum(map(ord, text)) * 100 + rank.pp * 10 + rank.tp


def logical_view(buf16: torch.Tensor, layout: str, g: KVGeometry, layers: int, heads: int, blocks: int):
    """A worker's buffer as [layers, blocks, heads, tokens, K/V, head_size], whatever its physical order.

    Built with torch's row-major reshape of the layout's dim order, independently of kvbridge.core.memory.
    """
    order = NAMED_LAYOUTS[layout]
    size = {"L": layers, "K": 2, "B": blocks, "H": heads, "N": g.block_size, "D": g.head_size}
    dims: list[str] = []
    for d in order:
        if d == "C":
            dims += ["D"] if "K" in order else ["K", "D"]
        else:
            dims.append(d)
    return buf16.view([size[d] for d in dims]).permute([dims.index(d) for d in "LBHNKD"])


def transport_config(args) -> TransportConfig:
    if args.sim_cpu:
        return TransportConfig()
    return TransportConfig(ucx_tls=args.ucx_tls or None, ucx_net_devices=args.ucx_net_devices or None)


def sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


# -- the prefill process -----------------------------------------------------------------------------------


def prefill_buffers(args, device: torch.device) -> dict[tuple[str, WorkerRank], torch.Tensor]:
    """Every prefill worker's buffer on `device`, filled with its seeded pattern."""
    g = geometry(args)
    bufs: dict[tuple[str, WorkerRank], torch.Tensor] = {}
    for text, rank in worker_keys(args, 0):
        layers, heads = worker_shape(ParallelLayout.parse(text), g, rank)
        buf = torch.empty(buffer_numel(g, layers, heads, args.blocks), dtype=torch.bfloat16, device=device)
        if device.type == "cpu":
            buf.share_memory_()  # before registering: sharing a CPU tensor later would move it
        fill_pattern(buf.view(INT16), seed_of(text, rank))
        bufs[(text, rank)] = buf
    sync(device)
    return bufs


def register_prefill(args, transport: NixlTransport, bufs: dict) -> None:
    g = geometry(args)
    for (text, rank), buf in bufs.items():
        layers, heads = worker_shape(ParallelLayout.parse(text), g, rank)
        mem = synthesize_memory(
            "LBNHC", g, list(layers), len(heads), args.blocks, buf.data_ptr(), buf.device.index or 0
        )
        transport.register(mem, "DRAM" if args.sim_cpu else "VRAM")


def prefill_main(args, cmd_q, resp_q) -> None:
    """Hold the prefill workers' buffers on GPU 0, register them with NIXL, share them on request, and make UCX
    progress (polling notifications with backoff) until told to stop."""
    transport = None
    try:
        device = torch.device("cpu" if args.sim_cpu else "cuda:0")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        bufs = prefill_buffers(args, device)
        metadata_bytes, nixl_error, ucx_env = None, None, {}
        if args.nixl and args.nixl_peer == "process":
            try:
                transport = NixlTransport(f"prefill-{os.getpid()}", transport_config(args)).start()
                register_prefill(args, transport, bufs)
                metadata_bytes, ucx_env = transport.agent_metadata(), dict(transport.ucx_env)
            except Exception:
                nixl_error = traceback.format_exc()
        ptrs = {key: buf.data_ptr() for key, buf in bufs.items()}
        resp_q.put(("ready", {"ptrs": ptrs, "metadata": metadata_bytes, "nixl_error": nixl_error, "ucx_env": ucx_env}))
        notifications = 0
        backoff = Backoff(cap_s=2e-3)
        while True:
            if transport is not None:
                got = sum(len(m) for m in transport.notifications().values())
                notifications += got
                if got:
                    backoff.reset()
            try:
                cmd = cmd_q.get(timeout=backoff.step())
            except queue.Empty:
                continue
            backoff.reset()
            if cmd == "ipc":
                resp_q.put(("ipc", bufs))
            elif cmd == "ipc-handles":
                from kvbridge.transport.cuda_ipc import export_region

                resp_q.put(("ipc-handles", {key: export_region(buf) for key, buf in bufs.items()}))
            elif cmd == "stop":
                resp_q.put(("stopped", {"notifications": notifications}))
                return
    except Exception:
        resp_q.put(("error", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()


# -- the decode side (this process) ------------------------------------------------------------------------


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.g = geometry(args)
        cpu = args.sim_cpu
        self.pdev = torch.device("cpu" if cpu else "cuda:0")
        self.ddev = torch.device("cpu" if cpu else f"cuda:{args.decode_gpu}")
        self.dec_id = 1 if cpu else args.decode_gpu  # the decode regions' device id (NIXL's, for DRAM arbitrary)
        self.dec: dict[tuple[str, WorkerRank], torch.Tensor] = {}
        self.ref: dict[tuple[str, WorkerRank], torch.Tensor] = {}
        self.prefill_ptrs: dict = {}
        self.ipc: dict = {}
        self.transport: NixlTransport | None = None
        self.target: NixlTransport | None = None  # --nixl-peer agent: the prefill agent, in this process
        self.local_prefill: dict = {}  # --nixl-peer agent/self: the prefill buffers, in this process
        self.prepared: dict = {}  # (pair, layout, decode rank, prefill rank) -> PreparedLists
        self.peer = ""
        self.cases: dict[tuple, dict] = {}
        self.log_file = None
        self.nixl_error: str | None = None
        self.nixl_failures = 0

    def log(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, file=sys.stderr, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    # setup

    def allocate(self) -> None:
        g, nb = self.g, self.args.blocks
        for text, rank in worker_keys(self.args, 1):
            layers, heads = worker_shape(ParallelLayout.parse(text), g, rank)
            self.dec[(text, rank)] = torch.empty(
                buffer_numel(g, layers, heads, nb), dtype=torch.bfloat16, device=self.ddev
            )
        for text, rank in worker_keys(self.args, 0):  # the prefill bytes, rebuilt here for the checks
            layers, heads = worker_shape(ParallelLayout.parse(text), g, rank)
            ref = torch.empty(buffer_numel(g, layers, heads, nb), dtype=torch.bfloat16, device=self.ddev)
            fill_pattern(ref.view(INT16), seed_of(text, rank))
            self.ref[(text, rank)] = ref
        top = max(self.request_bytes(t) for t in self.args.tokens)
        self.copy_src = torch.full((top,), 7, dtype=torch.uint8, device=self.pdev)
        self.copy_dst = torch.empty(top, dtype=torch.uint8, device=self.ddev)
        sync(self.pdev, self.ddev)

    def request_bytes(self, tokens: int) -> int:
        return self.g.kv_bytes_per_token() * self.blocks_of(tokens) * self.g.block_size

    def blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.g.block_size)

    def connect_nixl(self, info: dict) -> str | None:
        if info["nixl_error"]:
            return "prefill side: " + info["nixl_error"]
        try:
            self.transport = NixlTransport(f"decode-{os.getpid()}", transport_config(self.args)).start()
            dev = self.dec_id
            for (text, rank), buf in self.dec.items():
                layers, heads = worker_shape(ParallelLayout.parse(text), self.g, rank)
                mem = synthesize_memory(
                    "LBNHC", self.g, list(layers), len(heads), self.args.blocks, buf.data_ptr(), dev
                )
                self.transport.register(mem, "DRAM" if self.args.sim_cpu else "VRAM")
            mode = self.args.nixl_peer
            if mode == "process":
                self.peer = self.transport.add_peer(info["metadata"])
            else:
                self.local_prefill = prefill_buffers(self.args, self.pdev)
                self.prefill_ptrs = {key: buf.data_ptr() for key, buf in self.local_prefill.items()}
                if mode == "agent":
                    self.target = NixlTransport(f"prefill-local-{os.getpid()}", transport_config(self.args)).start()
                    register_prefill(self.args, self.target, self.local_prefill)
                    self.peer = self.transport.add_peer(self.target.agent_metadata())
                else:  # NIXL loopback: the remote side is this agent itself (no metadata to load)
                    register_prefill(self.args, self.transport, self.local_prefill)
                    self.peer = self.transport.name
                    self.transport._peers.add(self.peer)  # the bench's loopback: NixlTransport has no API for it
        except Exception:
            return traceback.format_exc()
        return None

    # one case's pieces

    def memories(self, pair: str, layout: str, side: int, bases: dict) -> dict[WorkerRank, WorkerMemory]:
        text = PAIRS[pair][side]
        out = {}
        for rank in ParallelLayout.parse(text).workers():
            layers, heads = worker_shape(ParallelLayout.parse(text), self.g, rank)
            out[rank] = synthesize_memory(
                layout,
                self.g,
                list(layers),
                len(heads),
                self.args.blocks,
                bases[(text, rank)],
                self.dec_id if side else 0,
            )
        return out

    def request(self, tokens: int, pattern: str) -> tuple[np.ndarray, np.ndarray]:
        n, nb = self.blocks_of(tokens), self.args.blocks
        if 2 * n > nb:
            raise ValueError(f"{tokens} tokens need {n} blocks: --blocks {nb} is under twice that")
        if pattern == "contiguous":
            return np.arange(1, 1 + n), np.arange(2, 2 + n)
        rng = np.random.default_rng(self.args.seed + tokens)
        return rng.permutation(nb)[:n], rng.permutation(nb)[:n]

    def poison(self, pair: str) -> None:
        text = PAIRS[pair][1]
        for rank in ParallelLayout.parse(text).workers():
            self.dec[(text, rank)].view(INT16).fill_(POISON)
        sync(self.ddev)

    def verify(self, pair: str, layout: str, plan: TransferPlan, sb: np.ndarray, db: np.ndarray) -> dict:
        """Compare each decode worker's request pages with the reference prefill bytes, reset them to the poison,
        then count every decode element that is not the poison (bytes written where nothing should be)."""
        g, nb = self.g, self.args.blocks
        ptext, dtext = PAIRS[pair]
        player, dlayer = ParallelLayout.parse(ptext), ParallelLayout.parse(dtext)
        sidx = torch.as_tensor(sb, device=self.ddev)
        didx = torch.as_tensor(db, device=self.ddev)
        mismatched = stray = checked = 0
        for rank in dlayer.workers():
            dl, dh = worker_shape(dlayer, g, rank)
            buf = self.dec[(dtext, rank)].view(INT16)
            dview = logical_view(buf, layout, g, len(dl), len(dh), nb)
            for read in plan.reads_of(rank):
                pw = read.prefill_worker
                pl, ph = worker_shape(player, g, pw)
                rview = logical_view(self.ref[(ptext, pw)].view(INT16), layout, g, len(pl), len(ph), nb)
                first, end = read.layers[0], read.layers[-1] + 1
                assert tuple(read.layers) == tuple(range(first, end))
                h0, h1 = read.kv_heads
                want = rview[first - pl.start : end - pl.start][:, sidx][:, :, h0 - ph.start : h1 - ph.start]
                ls, hs = slice(first - dl.start, end - dl.start), slice(h0 - dh.start, h1 - dh.start)
                got = dview[ls][:, didx][:, :, hs]
                mismatched += int((got != want).sum())
                checked += want.numel()
                dview[ls, didx, hs] = POISON
            stray += int((buf != POISON).sum())
        sync(self.ddev)
        return {"ok": mismatched == 0 and stray == 0, "mismatched": mismatched, "stray": stray, "checked": checked}

    def checker(self, pair: str, layout: str, plan: TransferPlan, sb: np.ndarray, db: np.ndarray):
        return lambda: self.verify(pair, layout, plan, sb, db)

    def measure(self, fn, pair=None, check=None, paired=None) -> dict:
        """Warm up once and check, then time repetitions (as many as fit the time budget) and check again.
        `paired` (the reference copy) runs before each repetition, so both see the same machine state; its
        median is `paired_s`."""
        out: dict = {}
        try:
            if pair:
                self.poison(pair)
            first = fn()
            if check:
                out["check_warmup"] = check()
                self.poison(pair)
            budget = self.args.budget_s / max(first["s"], 1e-6)
            reps = max(self.args.min_reps, min(self.args.reps, int(budget)))
            runs, refs = [], []
            for _ in range(reps):
                if paired:
                    refs.append(paired()["s"])
                runs.append(fn())
            if refs:
                out["paired_s"] = statistics.median(refs)
            if check:
                out["check"] = check()
                out["ok"] = out["check_warmup"]["ok"] and out["check"]["ok"]
            out["s"] = statistics.median(r["s"] for r in runs)
            out["min_s"] = min(r["s"] for r in runs)
            out["times_s"] = [r["s"] for r in runs]
            if "kernel_s" in runs[0]:
                out["kernel_s"] = statistics.median(r["kernel_s"] for r in runs)
                out["batches"] = runs[0].get("batches")
        except Exception:
            out["error"] = traceback.format_exc()
            self.log(f"error: {out['error'].strip().splitlines()[-1]}")
        return out

    def nixl_fn(self, posts: list, prepared: bool = False):
        transport, target = self.transport, self.target

        def post(item):
            if prepared:
                lists, src_idx, dst_idx = item
                return transport.read_prepared(lists, src_idx, dst_idx, b"bench")
            d, lm, rm = item
            return transport.read(self.peer, d, lm, rm, b"bench")

        def run() -> dict:
            t0 = time.perf_counter()
            xfers = [post(item) for item in posts]
            pending = [x for x in xfers if not x.done]
            deadline = t0 + 20
            while pending:
                pending = [x for x in pending if not transport.poll(x)]
                if target is not None:
                    target.notifications()
                if pending and time.perf_counter() > deadline:
                    for x in xfers:
                        transport.release(x)
                    raise TimeoutError(f"{len(pending)} READs not done after 20 s")
            s = time.perf_counter() - t0
            for x in xfers:
                transport.release(x)
            return {"s": s}

        return run

    def copy_fn(self, nbytes: int):
        src, dst = self.copy_src[:nbytes], self.copy_dst[:nbytes]

        def run() -> dict:
            sync(self.pdev, self.ddev)
            t0 = time.perf_counter()
            dst.copy_(src)
            sync(self.pdev, self.ddev)
            return {"s": time.perf_counter() - t0}

        return run

    # the cases

    def case_list(self) -> list[tuple[str, str, int, str]]:
        out = []
        for pair in self.args.pairs:
            ptext, dtext = PAIRS[pair]
            same_tp = ParallelLayout.parse(ptext).tp == ParallelLayout.parse(dtext).tp
            layouts = self.args.layouts or (["LBNHC"] if same_tp else ["LBHNC", "LBNHC"])
            for layout in layouts:
                for tokens in self.args.tokens:
                    for pattern in self.args.patterns:
                        out.append((pair, layout, tokens, pattern))
        return out

    def descriptors(self, pair, layout, sb, db, sources_bases, coalesce=True) -> tuple[dict, float]:
        ptext, dtext = PAIRS[pair]
        plan = make_plan(ParallelLayout.parse(ptext), ParallelLayout.parse(dtext), self.g)
        dst = self.memories(pair, layout, 1, {k: v.data_ptr() for k, v in self.dec.items()})
        src = self.memories(pair, layout, 0, sources_bases)
        t0 = time.perf_counter()
        per = {r: worker_descriptors(plan, r, dst[r], src, sb, db, coalesce) for r in dst}
        build = time.perf_counter() - t0
        posts = [(d, dst[r], src[pw]) for r, by_peer in per.items() for pw, d in by_peer.items()]
        return {"plan": plan, "posts": posts}, build

    def phase_nixl(self) -> None:
        for key in self.case_list():
            pair, layout, tokens, pattern = key
            case = self.cases.setdefault(key, {"pair": pair, "layout": layout, "tokens": tokens, "pattern": pattern})
            sb, db = self.request(tokens, pattern)
            nbytes = self.request_bytes(tokens)
            case.update(blocks=len(sb), bytes=nbytes)
            case["copy"] = self.measure(self.copy_fn(nbytes))
            if self.transport is None:
                off = (
                    {"skipped": "--no-nixl"}
                    if not self.args.nixl
                    else {"error": f"NIXL unavailable: {self.nixl_error}"}
                )
                case["nixl"] = case["nixl-blk"] = off
                continue
            for variant in self.args.nixl_variants:
                if variant == "nixl-prep":
                    case[variant] = self.measure_prepared(pair, layout, sb, db)
                    continue
                if variant == "nixl-contig":
                    case[variant] = self.measure_contiguous(pair, layout, sb, db)
                    continue
                coalesce = variant == "nixl"
                built, build_s = self.descriptors(pair, layout, sb, db, self.prefill_ptrs, coalesce)
                count = sum(len(d) for d, _, _ in built["posts"])
                assert sum(d.nbytes for d, _, _ in built["posts"]) == nbytes
                rec = {"descriptors": count, "reads": len(built["posts"]), "build_s": build_s}
                if count > self.args.max_nixl_descs:
                    rec["skipped"] = f"{count} descriptors > --max-nixl-descs {self.args.max_nixl_descs}"
                elif self.nixl_failures >= 2:
                    rec["skipped"] = "NIXL failed twice in a row before"
                else:
                    check = self.checker(pair, layout, built["plan"], sb, db)
                    rec.update(self.measure(self.nixl_fn(built["posts"]), pair, check))
                    self.nixl_failures = self.nixl_failures + 1 if "error" in rec else 0
                case[variant] = rec
            self.log(short_line(case))
        for lists in self.prepared.values():
            self.transport.unprepare(lists)
        self.prepared.clear()

    def measure_prepared(self, pair: str, layout: str, sb: np.ndarray, db: np.ndarray) -> dict:
        """nixl-prep: each (decode, prefill) worker pair's lists prepared once (timed as prep_s, on first use),
        then per request only the indices (build_s) and make_prepped_xfer + posting + polling (s)."""
        ptext, dtext = PAIRS[pair]
        plan = make_plan(ParallelLayout.parse(ptext), ParallelLayout.parse(dtext), self.g)
        dst = self.memories(pair, layout, 1, {k: v.data_ptr() for k, v in self.dec.items()})
        src = self.memories(pair, layout, 0, self.prefill_ptrs)
        rec: dict = {"prep_s": 0.0, "entries": 0}
        parts = []
        try:
            for r, mem in dst.items():
                for pw, segments in worker_segments(plan, r, mem, src).items():
                    key = (pair, layout, r, pw)
                    if key not in self.prepared:
                        table = PreparedTable(segments, self.args.blocks, self.args.blocks)
                        if table.src_entries > self.args.max_prep_entries:
                            return {"skipped": f"{table.src_entries} entries > --max-prep-entries"}
                        t0 = time.perf_counter()
                        self.prepared[key] = self.transport.prepare(self.peer, table, mem, src[pw])
                        rec["prep_s"] += time.perf_counter() - t0
                        rec["entries"] += table.src_entries + table.dst_entries
                    parts.append(self.prepared[key])
        except Exception:
            rec["error"] = traceback.format_exc()
            self.log(f"nixl-prep {pair} {layout}: {rec['error'].strip().splitlines()[-1]}")
            return rec
        t0 = time.perf_counter()
        posts = [(lists, *lists.table.indices(sb, db)) for lists in parts]
        rec["build_s"] = time.perf_counter() - t0
        rec["descriptors"] = sum(len(p[1]) for p in posts)
        rec["reads"] = len(posts)
        if rec["descriptors"] > self.args.max_nixl_descs:
            rec["skipped"] = f"{rec['descriptors']} descriptors > --max-nixl-descs {self.args.max_nixl_descs}"
            return rec
        check = self.checker(pair, layout, plan, sb, db)
        rec.update(self.measure(self.nixl_fn(posts, prepared=True), pair, check))
        return rec

    def measure_contiguous(self, pair: str, layout: str, sb: np.ndarray, db: np.ndarray) -> dict:
        """nixl-contig, the anchor: each READ of the request (same decode and prefill worker, same bytes) as one
        descriptor over the start of both buffers. Not byte-checked (it moves other bytes than the request's)."""
        built, _ = self.descriptors(pair, layout, sb, db, self.prefill_ptrs)
        posts = []
        for d, lm, rm in built["posts"]:
            one = Descriptors(
                *(np.array([v], dtype=np.int64) for v in (rm.regions[0].addr, lm.regions[0].addr, d.nbytes, 0, 0))
            )
            posts.append((one, lm, rm))
        rec = {"descriptors": len(posts), "reads": len(posts), "checked": False}
        rec.update(self.measure(self.nixl_fn(posts)))
        return rec

    def phase_kernel(self) -> None:
        configs = [gather.CONFIGS[c] for c in self.args.kernels]
        kernels, errors = {}, {}
        for c in configs:
            try:
                if self.args.sim_cpu:
                    kernels[c.name] = CpuGather(c)
                else:
                    kernels[c.name] = gather.PeerGather(self.pdev.index, self.ddev.index, c).start()
            except Exception:
                errors[c.name] = traceback.format_exc()
                self.log(f"kernel {c.name}: {errors[c.name].strip().splitlines()[-1]}")
        bases = {k: t.data_ptr() for k, t in self.ipc.items()}
        for key in self.case_list():
            pair, layout, tokens, pattern = key
            case = self.cases[key]
            sb, db = self.request(tokens, pattern)
            built, build_s = self.descriptors(pair, layout, sb, db, bases, True)
            runs = Descriptors.concat([d for d, _, _ in built["posts"]])
            for c in configs:
                rec: dict = {"descriptors": len(runs), "build_s": build_s, "config": vars(c)}
                if c.name in errors:
                    rec["error"] = errors[c.name]
                else:
                    k = kernels[c.name]
                    packed = k.prepare(runs.src_addr, runs.dst_addr, runs.length)  # checks alignment, once
                    rec["items"], rec["direct"] = packed.n_items, packed.direct

                    def run(k=k, runs=runs) -> dict:
                        return k.transfer(runs.src_addr, runs.dst_addr, runs.length)

                    rec.update(self.measure(run, pair, self.checker(pair, layout, built["plan"], sb, db)))
                case[f"kernel-{c.name}"] = rec
            best = pick_kernel(case)
            if best:
                case["kernel"] = {**case[best], "variant": best}
            self.log(short_line(case))

    def gather_fn(self, kernels: list, sb: np.ndarray, db: np.ndarray, devices: tuple, fresh_ids: bool = False):
        """As the decode worker's IpcReader does it: the ids packed into pinned memory allocated once, one upload
        and the launches on a stream of the kernels' device (the compiled launcher after the first). `fresh_ids`:
        as the first launcher did it, a fresh pinned tensor per request and Triton's JIT entry on the current
        stream (the host's work shows in the GPU time: the GPU waits for it after the start event)."""
        from kvbridge.transport.gpu_gather import pack_ids, padded_pairs

        device = kernels[0].device
        gpu = device.type == "cuda"
        size = 2 * padded_pairs(len(sb))
        if fresh_ids and gpu:

            def run_fresh() -> dict:
                sync(*devices)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(torch.cuda.current_stream(device))
                t0 = time.perf_counter()
                fresh = kernels[0].block_ids(sb, db)
                for k in kernels:
                    k.launch(fresh)
                end.record(torch.cuda.current_stream(device))
                sync(*devices)
                return {"s": time.perf_counter() - t0, "kernel_s": start.elapsed_time(end) / 1e3}

            return run_fresh
        if not gpu:
            ids = torch.from_numpy(np.empty(size, dtype=np.int32))

            def run_cpu() -> dict:
                t0 = time.perf_counter()
                pack_ids(ids.numpy(), sb, db)
                for k in kernels:
                    k.launch(ids)
                return {"s": time.perf_counter() - t0}

            return run_cpu
        stream = torch.cuda.Stream(device)
        pinned = torch.empty(size, dtype=torch.int32, pin_memory=True)
        ids = torch.empty(size, dtype=torch.int32, device=device)

        def run() -> dict:
            sync(*devices)
            here, before = torch.cuda.current_device(), torch.cuda.current_stream(device)
            torch.cuda.set_stream(stream)  # bound before the clock starts, as IpcReader binds its thread once
            try:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record(stream)
                pack_ids(pinned.numpy(), sb, db)
                ids.copy_(pinned, non_blocking=True)
                for k in kernels:
                    k.launch(ids, stream)
                end.record(stream)
                sync(*devices)
                return {"s": time.perf_counter() - t0, "kernel_s": start.elapsed_time(end) / 1e3}
            finally:
                torch.cuda.set_stream(before)
                torch.cuda.set_device(here)

        return run

    def phase_gather(self, sources: dict) -> None:
        """kvbridge.transport.gpu_gather: segments once per peer, then per request two block-id lists and one launch per
        (decode worker, prefill worker); the prefill buffers are `sources` (IPC-opened tensors)."""
        from kvbridge.transport.gpu_gather import GatherKernel

        for key in self.case_list():
            pair, layout, tokens, pattern = key
            case = self.cases.setdefault(key, {"pair": pair, "layout": layout, "tokens": tokens, "pattern": pattern})
            sb, db = self.request(tokens, pattern)
            nbytes = self.request_bytes(tokens)
            case.update(blocks=len(sb), bytes=nbytes)
            if "copy" not in case:
                case["copy"] = self.measure(self.copy_fn(nbytes))
            ptext, dtext = PAIRS[pair]
            plan = make_plan(ParallelLayout.parse(ptext), ParallelLayout.parse(dtext), self.g)
            dst = self.memories(pair, layout, 1, {k: v.data_ptr() for k, v in self.dec.items()})
            src = self.memories(pair, layout, 0, self.prefill_ptrs)
            first = None  # the default variant (the first listed) is the table's "gather": no best-of-N bias
            for warps, program_kib, grouped, fresh in self.gather_variants():
                name = f"gather-w{warps}-p{program_kib}{'' if grouped else '-ungrouped'}{'-fresh' if fresh else ''}"
                rec: dict = {"on": self.args.gather_on, "num_warps": warps, "program_kib": program_kib}
                rec["grouped"] = grouped
                try:
                    t0 = time.perf_counter()
                    kernels, segments = [], 0
                    for r, dmem in dst.items():
                        for pw, seg in worker_segments(plan, r, dmem, src).items():
                            segments += len(seg)
                            kernels.append(
                                GatherKernel(
                                    seg,
                                    src[pw].regions,
                                    [sources[(ptext, pw)]],
                                    dmem.regions,
                                    [self.dec[(dtext, r)]],
                                    num_warps=warps,
                                    program_bytes=program_kib * 1024,
                                    group_runs=grouped,
                                )
                            )
                    rec.update(setup_s=time.perf_counter() - t0, launches=len(kernels), segments=segments)
                    rec["shape"] = {k: v for k, v in kernels[0]._args.items() if k in ("TILE", "BLOCKS", "ROWS")}
                    rec["shape"]["num_warps"] = kernels[0]._args.get("num_warps")
                    rec["programs"] = segments * len(sb)
                    devices = (self.pdev, self.ddev)
                    rec.update(
                        self.measure(
                            self.gather_fn(kernels, sb, db, devices, fresh),
                            pair,
                            self.checker(pair, layout, plan, sb, db),
                            paired=self.copy_fn(nbytes),
                        )
                    )
                except Exception:
                    rec["error"] = traceback.format_exc()
                    self.log(f"gather: {rec['error'].strip().splitlines()[-1]}")
                case[name] = rec
                first = first or rec
            rec = first
            case["gather"] = rec
            if (
                self.args.staged
                and not self.args.sim_cpu
                and layout == "LBNHC"
                and ParallelLayout.parse(ptext).tp == ParallelLayout.parse(dtext).tp
            ):
                case["staged"] = self.measure(
                    self.staged_fn(plan, pair, sb, db, sources), pair, self.checker(pair, layout, plan, sb, db)
                )
            self.log(short_line(case))

    def gather_variants(self) -> list[tuple[int, int, bool, bool]]:
        """(num_warps, KiB per program step, grouped, fresh ids) of every gather kernel variant to time."""
        out = [(w, kib, True, False) for w in self.args.gather_warps for kib in self.args.gather_program_kib]
        if self.args.gather_ungrouped:
            out.append((8, 16, False, False))
        if self.args.gather_fresh_ids:
            out.append((8, self.args.gather_program_kib[0], True, True))
        return out

    def staged_fn(self, plan: TransferPlan, pair: str, sb: np.ndarray, db: np.ndarray, sources: dict):
        """Gather the request's pages into a staging buffer on the prefill GPU, copy it to the decode GPU, scatter
        there: per chunk of layers, three streams, so that the chunks' stages overlap (equal TP, LBNHC only)."""
        g, nb = self.g, self.args.blocks
        ptext, dtext = PAIRS[pair]
        page = g.block_size * g.num_kv_heads * 2 * g.head_size  # int16 elements of one block of one layer
        players = ParallelLayout.parse(ptext)
        sidx = torch.as_tensor(sb, device=self.pdev)
        didx = torch.as_tensor(db, device=self.ddev)
        steps = []  # (source view rows, destination view rows)
        for r in ParallelLayout.parse(dtext).workers():
            dl, _ = worker_shape(ParallelLayout.parse(dtext), g, r)
            dview = self.dec[(dtext, r)].view(INT16).view(len(dl), nb, page)
            for read in plan.reads_of(r):
                pl, _ = worker_shape(players, g, read.prefill_worker)
                sview = sources[(ptext, read.prefill_worker)].view(INT16).view(len(pl), nb, page)
                for first in range(read.layers[0], read.layers[-1] + 1, self.args.staged_layers):
                    end = min(first + self.args.staged_layers, read.layers[-1] + 1)
                    steps.append((sview[first - pl.start : end - pl.start], dview[first - dl.start : end - dl.start]))
        streams = [torch.cuda.Stream(self.pdev), torch.cuda.Stream(self.ddev), torch.cuda.Stream(self.ddev)]
        stage0 = [torch.empty((s.shape[0], len(sb), page), dtype=INT16, device=self.pdev) for s, _ in steps]
        stage1 = [torch.empty_like(t, device=self.ddev) for t in stage0]

        def run() -> dict:
            sync(self.pdev, self.ddev)
            t0 = time.perf_counter()
            for (s, d), a, b in zip(steps, stage0, stage1, strict=True):
                with torch.cuda.stream(streams[0]):
                    torch.index_select(s, 1, sidx, out=a)
                    e0 = torch.cuda.Event()
                    e0.record(streams[0])
                with torch.cuda.stream(streams[1]):
                    streams[1].wait_event(e0)
                    b.copy_(a, non_blocking=True)
                    e1 = torch.cuda.Event()
                    e1.record(streams[1])
                with torch.cuda.stream(streams[2]):
                    streams[2].wait_event(e1)
                    d.index_copy_(1, didx, b)
            sync(self.pdev, self.ddev)
            return {"s": time.perf_counter() - t0}

        return run


class CpuGather:
    """The kernel's stand-in for --sim-cpu: the same work items, copied with memmove."""

    def __init__(self, config: gather.GatherConfig) -> None:
        self.config = config

    def prepare(self, src, dst, length) -> gather.Packed:
        gather.check_aligned(src, dst, length)
        return gather.pack(src, dst, length, self.config.chunk)

    def transfer(self, src, dst, length) -> dict:
        t0 = time.perf_counter()
        parts = gather.batches(len(length), first=64, most=256)  # small batches: the batching is checked too
        for a, b in parts:
            gather.emulate(gather.pack(src[a:b], dst[a:b], length[a:b], self.config.chunk), self.config.chunk)
        s = time.perf_counter() - t0
        return {"s": s, "kernel_s": s, "batches": len(parts)}


def pick_kernel(case: dict) -> str | None:
    """The fastest kernel configuration whose bytes checked out (else the fastest, which the table marks)."""
    timed = [k for k in case if k.startswith("kernel-") and "s" in case[k]]
    good = [k for k in timed if case[k].get("ok")]
    return min(good or timed, key=lambda k: case[k]["s"]) if timed else None


# -- reporting ---------------------------------------------------------------------------------------------


def paired_ratio(rec: dict) -> float:
    """A variant's speed over the reference copy timed alternately with it (1.0: as fast as the copy)."""
    return rec["paired_s"] / rec["s"] if rec.get("paired_s") and rec.get("s") else 0.0


def gbps(case: dict, variant: str) -> float | None:
    rec = case.get(variant) or {}
    return case["bytes"] / rec["s"] / 1e9 if "s" in rec else None


def cell(case: dict, variant: str, count: str = "descriptors") -> str:
    rec = case.get(variant) or {}
    if "s" not in rec:
        return "skip" if "skipped" in rec else "ERR" if "error" in rec else "-"
    bad = "" if rec.get("ok", True) else "!BAD"
    n = rec.get(count) if count else None
    return f"{gbps(case, variant):.0f}{bad}" + (f" ({n})" if n is not None else "")


def short_line(case: dict) -> str:
    return (
        f"{case['pair']} {case['layout']} {case['tokens']} {case['pattern']}: copy {cell(case, 'copy')}"
        f" nixl {cell(case, 'nixl')} nixl-blk {cell(case, 'nixl-blk')} nixl-prep {cell(case, 'nixl-prep')}"
        f" nixl-contig {cell(case, 'nixl-contig')} kernel {cell(case, 'kernel', 'items')}"
        f" gather {cell(case, 'gather', 'programs')} staged {cell(case, 'staged', None)} GB/s"
    )


def table(cases: list[dict]) -> str:
    head = (
        f"{'pair':9}{'layout':6}{'tok':>4} {'blocks':8}{'MiB':>5}{'copy':>5} |{'nixl (descs)':>16}{'ms':>8}"
        f" |{'nixl-blk (descs)':>16}{'ms':>8} |{'kernel (items)':>16}{'ms':>6}{'k-only':>7}"
        f" |{'gather (progs)':>16}{'ms':>6}{'g-only':>7}{'staged':>7} | nixl kernel gather staged /copy"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        ms = {v: (c.get(v) or {}).get("s") for v in ("nixl", "nixl-blk", "kernel", "gather")}
        fmt = {v: f"{s * 1e3:8.2f}" if s else f"{'-':>8}" for v, s in ms.items()}
        copy = gbps(c, "copy")
        variants = ("nixl", "kernel", "gather", "staged")
        ratio = {v: f"{gbps(c, v) / copy:.2f}" if gbps(c, v) and copy else "-" for v in variants}
        if paired_ratio(c.get("gather") or {}):  # against the copy timed alternately with it
            ratio["gather"] = f"{paired_ratio(c['gather']):.2f}"
        ks = (c.get("kernel") or {}).get("kernel_s")
        konly = f"{c['bytes'] / ks / 1e9:7.0f}" if ks else f"{'-':>7}"
        gs = (c.get("gather") or {}).get("kernel_s")
        gonly = f"{c['bytes'] / gs / 1e9:7.0f}" if gs else f"{'-':>7}"
        tok = f"{c['tokens'] // 1024}k" if c["tokens"] % 1024 == 0 else str(c["tokens"])
        lines.append(
            f"{c['pair']:9}{c['layout']:6}{tok:>4} {c['pattern'][:7]:8}{c['bytes'] / 2**20:5.0f}{(copy or 0):5.0f} |"
            f"{cell(c, 'nixl'):>16}{fmt['nixl']} |{cell(c, 'nixl-blk'):>16}{fmt['nixl-blk']} |"
            f"{cell(c, 'kernel', 'items'):>16}{fmt['kernel'][2:]}{konly} |"
            f"{cell(c, 'gather', 'programs'):>16}{fmt['gather'][2:]}{gonly}{cell(c, 'staged', None):>7} |"
            f" {ratio['nixl']:>4} {ratio['kernel']:>6} {ratio['gather']:>6} {ratio['staged']:>6}"
        )
    return "\n".join(lines)


def variants_table(cases: list[dict]) -> str:
    """Each gather kernel shape's ratio to the copy timed alternately with it, per case (not just the best)."""
    names = sorted({k for c in cases for k in c if k.startswith("gather-") and isinstance(c[k], dict)})
    if len(names) < 2:
        return ""
    head = f"{'pair':9}{'layout':6}{'tok':>4} {'pattern':8}" + "".join(f"{n[7:]:>22}" for n in names)
    lines = [head, "-" * len(head)]
    for c in cases:
        cells = []
        for n in names:
            rec = c.get(n) or {}
            r = paired_ratio(rec)
            shape = rec.get("shape") or {}
            tag = f"{shape.get('ROWS', '?')}x{shape.get('BLOCKS', '?')}w{shape.get('num_warps', '?')}"
            bad = "!" if rec.get("ok") is False else ""
            cells.append(f"{f'{r:.3f}{bad} ({tag})' if r else '-':>22}")
        tok = f"{c['tokens'] // 1024}k" if c["tokens"] % 1024 == 0 else str(c["tokens"])
        lines.append(f"{c['pair']:9}{c['layout']:6}{tok:>4} {c['pattern'][:7]:8}" + "".join(cells))
    return "\n".join(lines)


def machine(args) -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def command(cmd: list[str]) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{type(exc).__name__}: {exc}"

    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nixl": version("nixl-cu13") or version("nixl-cu12"),
        "cupy": version("cupy-cuda13x") or version("cupy-cuda12x"),
    }
    if not args.sim_cpu:
        info["nvidia_smi_L"] = command(["nvidia-smi", "-L"])
        info["driver"] = command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["topology"] = command(["nvidia-smi", "topo", "-m"])
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192, 32768])
    p.add_argument("--patterns", nargs="+", default=["contiguous", "scattered"], choices=["contiguous", "scattered"])
    p.add_argument(
        "--layouts", nargs="+", choices=list(NAMED_LAYOUTS), help="default: LBNHC, plus LBHNC where TP sizes differ"
    )
    p.add_argument("--blocks", type=int, default=8192, help="KV blocks per worker (>= 2x a request's blocks)")
    p.add_argument("--layers", type=int, default=28, help="Qwen2.5-7B: 28 layers, 4 KV heads, head size 128")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions at most (after one warm-up)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=1.5, help="time budget per variant, caps the repetitions")
    p.add_argument("--max-nixl-descs", type=int, default=150_000, help="skip NIXL above this many descriptors")
    p.add_argument(
        "--nixl-variants",
        nargs="+",
        default=["nixl", "nixl-blk"],
        choices=["nixl", "nixl-blk", "nixl-prep", "nixl-contig"],
        help="NIXL ways to time (see the docstring)",
    )
    p.add_argument("--max-prep-entries", type=int, default=1 << 21, help="skip nixl-prep above this many per side")
    p.add_argument("--nixl-peer", choices=["process", "agent", "self"], default="process", help="see the docstring")
    p.add_argument("--decode-gpu", type=int, default=1, help="the decode side's GPU (0: one GPU for both)")
    p.add_argument("--kernels", nargs="+", default=list(gather.CONFIGS), choices=list(gather.CONFIGS))
    p.add_argument("--no-nixl", dest="nixl", action="store_false")
    p.add_argument("--no-kernel", dest="kernel", action="store_false", help="skip bench/gpu_peer_gather.py (CuPy)")
    p.add_argument(
        "--no-gather", dest="gather", action="store_false", help="skip kvbridge.transport.gpu_gather (Triton)"
    )
    p.add_argument(
        "--gather-on",
        choices=["prefill", "decode"],
        default="prefill",
        help="open the IPC mapping for (and run kvbridge.transport.gpu_gather on) the prefill GPU (push) or the"
        " decode GPU (pull); decode needs --no-kernel (PyTorch maps a handle once per process)",
    )
    p.add_argument("--gather-warps", nargs="+", type=int, default=[8], help="num_warps of the gather kernel to try")
    p.add_argument(
        "--gather-program-kib",
        nargs="+",
        type=int,
        default=[32],
        help="bytes one gather program moves per step (KiB), to try (kvbridge.transport.gpu_gather.PROGRAM_BYTES)",
    )
    p.add_argument(
        "--gather-fresh-ids",
        action="store_true",
        help="also time the first launcher's way: a fresh pinned id tensor per request, Triton's JIT entry",
    )
    p.add_argument(
        "--gather-ungrouped",
        action="store_true",
        help="also time the kernel with one run per program and 16 KiB steps (the first kernel's shape)",
    )
    p.add_argument("--staged", action="store_true", help="also time gather->copy->scatter through staging buffers")
    p.add_argument("--staged-layers", type=int, default=7, help="layers per pipelined chunk of --staged")
    p.add_argument("--ucx-tls", default="cuda_ipc,cuda_copy,sm,self,tcp", help="'' lets UCX choose")
    p.add_argument("--ucx-net-devices", default="lo", help="'' lets UCX choose")
    p.add_argument("--sim-cpu", action="store_true", help="CPU buffers, DRAM NIXL, memmove kernel: checks the logic")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bench = Bench(args)
    bench.log_file = open(args.out / f"gpu-{stamp}.log", "w")  # noqa: SIM115
    if args.nixl:  # the child inherits these; the transport would set the same
        for key, value in transport_config(args).ucx_env().items():
            os.environ.setdefault(key, value)
    record: dict = {
        "command": [sys.executable, *sys.argv],
        "run_command": os.environ.get("BENCH_RUN_COMMAND"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "machine": machine(args),
        "geometry": vars(bench.g) if hasattr(bench.g, "__dict__") else str(bench.g),
        "errors": [],
    }
    bench.log(f"machine: {json.dumps({k: v for k, v in record['machine'].items() if k != 'topology'})}")

    ctx = torch.multiprocessing.get_context("spawn")
    cmd_q, resp_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_main, args=(args, cmd_q, resp_q), daemon=True)
    proc.start()
    try:
        t0 = time.perf_counter()
        if not args.sim_cpu:
            torch.cuda.set_device(bench.ddev)
        bench.allocate()
        kind, info = resp_q.get(timeout=600)
        if kind != "ready":
            raise RuntimeError(f"prefill process: {info}")
        bench.log(f"setup {time.perf_counter() - t0:.1f} s; prefill UCX env {info['ucx_env']}")
        bench.prefill_ptrs = info["ptrs"]
        if args.nixl:
            t0 = time.perf_counter()
            bench.nixl_error = bench.connect_nixl(info)
            if bench.nixl_error:
                record["errors"].append({"where": "nixl setup", "error": bench.nixl_error})
                bench.log(f"NIXL unavailable: {bench.nixl_error.strip().splitlines()[-1]}")
            else:
                bench.log(f"NIXL connected in {time.perf_counter() - t0:.1f} s; UCX env {bench.transport.ucx_env}")
        else:
            bench.nixl_error = "--no-nixl"
        bench.phase_nixl()
        if bench.transport is not None:  # drop UCX's IPC mappings of the prefill buffers before torch opens them
            bench.transport.close()
            bench.transport = None
        if bench.target is not None:
            bench.target.close()
            bench.target = None
        bench.local_prefill = {}
        if not args.sim_cpu:  # peer access both ways (PyTorch enables the direction a copy needs)
            torch.empty(1, device=bench.pdev).copy_(torch.ones(1, device=bench.ddev))
            torch.empty(1, device=bench.ddev).copy_(torch.ones(1, device=bench.pdev))
        bufs: dict = {}
        if args.kernel or (args.gather and args.gather_on == "prefill"):
            cmd_q.put("ipc")
            kind, bufs = resp_q.get(timeout=120)
            if kind != "ipc":
                raise RuntimeError(f"prefill process: {bufs}")
        if args.kernel:
            bench.ipc = bufs
            bench.phase_kernel()
            bench.ipc = {}
        if args.gather:
            if args.gather_on == "decode" and not args.sim_cpu:
                from kvbridge.transport.cuda_ipc import open_region

                cmd_q.put("ipc-handles")
                kind, handles = resp_q.get(timeout=120)
                if kind != "ipc-handles":
                    raise RuntimeError(f"prefill process: {handles}")
                sources = {k: open_region(h, bench.ddev.index) for k, h in handles.items()}
            else:
                sources = bufs
            bench.phase_gather(sources)
            del sources
        del bufs
        if not args.sim_cpu:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
    except Exception:
        record["errors"].append({"where": "main", "error": traceback.format_exc()})
        bench.log(traceback.format_exc())
    finally:
        if bench.transport is not None:
            bench.transport.close()
        if bench.target is not None:
            bench.target.close()
        cmd_q.put("stop")
        try:
            kind, info = resp_q.get(timeout=30)
            record["prefill_exit"] = {"kind": kind, "info": info}
        except queue.Empty:
            record["prefill_exit"] = "no answer"
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    cases = list(bench.cases.values())
    record["cases"] = cases
    path = args.out / f"gpu-{stamp}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    text = table(cases)
    variants = variants_table(cases)
    if variants:
        text += "\n\ngather kernel shapes, ratio to the copy timed alternately (ROWSxBLOCKS per program, num_warps):\n"
        text += variants
    (args.out / f"gpu-{stamp}.txt").write_text(text + "\n")
    ok = all(c[v].get("ok", True) for c in cases for v in c if isinstance(c.get(v), dict))
    print("\nGB/s = request bytes / median time, from descriptors in hand to bytes in place (k-only, g-only: on the")
    print("GPU alone, CUDA events); /copy = GB/s over the torch copy's (gather: over the copy timed alternately with")
    print("it, the first variant listed: every variant is in the shapes table); !BAD = byte check failed; skip = too")
    print("many descs\n")
    print(text)
    print(f"\nall checks passed: {ok}; errors: {len(record['errors'])}; json: {path}")
    for e in record["errors"]:
        print(f"ERROR in {e['where']}: {e['error'].strip().splitlines()[-1]}")
    return 0 if ok and not record["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
