"""Prefill and decode workers for the real-NIXL tests and the CPU benchmark.

Each worker holds its KV in one torch CPU buffer laid out as a named vLLM layout, described by
`kvbridge.core.memory.synthesize_memory`, and owns its own NIXL agent. A process may host several workers.
Processes talk to the test over a multiprocessing Pipe (the ZMQ side channel is not used here):

    prefill: -> ("ready", {rank: PeerInfo}), then answers "notifs" with every notification so far, until
             "stop"; between commands it polls its agents with backoff (that is its UCX progress).
    decode:  <- {prefill rank: PeerInfo}, -> ("done", {rank: DecodeResult}), then waits for "stop".

Contents are checked against a full-model reference KV `[layers, blocks, heads, tokens, 2*head_size]` built
from a seed, which both sides compute on their own: each worker's part is a slice of it by layers and heads.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.core.descriptors import worker_descriptors
from kvbridge.core.memory import NAMED_LAYOUTS, WorkerMemory, synthesize_memory
from kvbridge.core.plan import TransferPlan, make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_config import TransportConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Scenario:
    """One prefill/decode layout pair and one request."""

    name: str
    geometry: KVGeometry
    prefill: ParallelLayout
    decode: ParallelLayout
    prefill_layout: str = "LBHNC"
    decode_layout: str = "LBHNC"
    prefill_blocks: int = 24
    decode_blocks: int = 20
    request_blocks: int = 7
    seed: int = 0
    contiguous: bool = False
    config: TransportConfig = field(default_factory=TransportConfig)

    def plan(self) -> TransferPlan:
        return make_plan(self.prefill, self.decode, self.geometry)

    def request(self) -> tuple[np.ndarray, np.ndarray]:
        """The request's block ids on the prefill and on the decode side (random, non-contiguous)."""
        n = self.request_blocks
        if self.contiguous:
            return np.arange(1, 1 + n), np.arange(2, 2 + n)
        rng = np.random.default_rng(self.seed)
        return rng.permutation(self.prefill_blocks)[:n], rng.permutation(self.decode_blocks)[:n]

    def notification(self, decode_rank: WorkerRank) -> bytes:
        return f"{self.name}:{decode_rank}".encode()


@dataclass(frozen=True)
class PeerInfo:
    """What a prefill worker hands the decode side (the side channel's job in the real connector)."""

    metadata: bytes
    memory: WorkerMemory
    ucx_env: dict[str, str]
    pid: int


@dataclass(frozen=True)
class DecodeResult:
    mismatched_bytes: int
    nbytes: int
    num_descriptors: int
    seconds: float
    error: str = ""


def reference_kv(scn: Scenario) -> torch.Tensor:
    """The full model's prefill KV: [layers, prefill blocks, heads, tokens, 2*head_size], seeded."""
    g = scn.geometry
    gen = torch.Generator().manual_seed(scn.seed)
    shape = (g.num_layers, scn.prefill_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(TORCH_DTYPES[g.dtype])


def logical_view(buf: torch.Tensor, layout: str, geometry: KVGeometry, layers: int, heads: int, blocks: int):
    """A view of a worker's buffer as [layers, blocks, heads, tokens, K/V, head_size], whatever its layout.

    Built with torch's row-major reshape of the layout's dim order, independently of kvbridge.core.memory.
    """
    order = NAMED_LAYOUTS[layout]
    size = {"L": layers, "K": 2, "B": blocks, "H": heads, "N": geometry.block_size, "D": geometry.head_size}
    dims: list[str] = []
    for d in order:
        if d == "C":
            dims += ["D"] if "K" in order else ["K", "D"]
        else:
            dims.append(d)
    view = buf.view([size[d] for d in dims])
    return view.permute([dims.index(d) for d in "LBHNKD"])


def _kv_split(x: torch.Tensor, head_size: int) -> torch.Tensor:
    return x.unflatten(-1, (2, head_size))


class Worker:
    """One worker's KV buffer, its memory description and its transport."""

    def __init__(self, scn: Scenario, side: str, rank: WorkerRank, layout: str, blocks: int) -> None:
        self.scn, self.side, self.rank, self.layout, self.blocks = scn, side, rank, layout, blocks
        parallel = scn.prefill if side == "prefill" else scn.decode
        g = scn.geometry
        self.layers = parallel.stage_layers(g.num_layers, rank.pp)
        self.heads = parallel.kv_heads(g.num_kv_heads, rank.tp)
        numel = len(self.layers) * blocks * len(self.heads) * g.block_size * 2 * g.head_size
        self.buf = torch.empty(numel, dtype=TORCH_DTYPES[g.dtype])
        self.memory = synthesize_memory(layout, g, list(self.layers), len(self.heads), blocks, self.buf.data_ptr())
        assert self.memory.regions[0].nbytes == self.buf.numel() * self.buf.element_size()
        name = f"{side}-{scn.name}-{rank.pp}-{rank.tp}-{os.getpid()}"
        self.transport = NixlTransport(name, scn.config)

    def view(self, buf: torch.Tensor | None = None):
        g = self.scn.geometry
        buf = self.buf if buf is None else buf
        return logical_view(buf, self.layout, g, len(self.layers), len(self.heads), self.blocks)

    def reference_part(self, ref: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the reference (its layers and heads), [L, B, H, N, K, D]."""
        part = ref[self.layers.start : self.layers.stop, :, self.heads.start : self.heads.stop]
        return _kv_split(part, self.scn.geometry.head_size)

    def start(self) -> Worker:
        self.transport.start()
        self.transport.register(self.memory)
        return self

    def info(self) -> PeerInfo:
        t = self.transport
        return PeerInfo(t.agent_metadata(), self.memory, dict(t.ucx_env), os.getpid())

    def close(self) -> None:
        self.transport.close()


def make_prefill(scn: Scenario, rank: WorkerRank, ref: torch.Tensor) -> Worker:
    w = Worker(scn, "prefill", rank, scn.prefill_layout, scn.prefill_blocks)
    w.view().copy_(w.reference_part(ref))
    return w


def make_decode(scn: Scenario, rank: WorkerRank) -> Worker:
    w = Worker(scn, "decode", rank, scn.decode_layout, scn.decode_blocks)
    # Not zeros: bytes the READ must leave alone are checked too, and stale data must not look right.
    gen = torch.Generator().manual_seed(scn.seed + 1000 + 10 * rank.pp + rank.tp)
    w.buf.copy_(torch.randn(w.buf.numel(), generator=gen).to(w.buf.dtype))
    return w


class DecodeSide:
    """Decode workers of one process: read a request's KV from their prefill peers and check every byte."""

    def __init__(self, scn: Scenario, ranks: Sequence[WorkerRank]) -> None:
        self.scn = scn
        self.plan = scn.plan()
        self.workers = {r: make_decode(scn, r) for r in ranks}
        self.initial = {r: w.buf.clone() for r, w in self.workers.items()}
        self.peers: dict[WorkerRank, dict[WorkerRank, str]] = {}
        self.sources: dict[WorkerRank, WorkerMemory] = {}
        self._ref: torch.Tensor | None = None

    def start(self) -> DecodeSide:
        for w in self.workers.values():
            w.start()
        return self

    def connect(self, prefill: dict[WorkerRank, PeerInfo]) -> None:
        """Load the metadata of every prefill worker each decode worker reads from (once)."""
        for rank, w in self.workers.items():
            self.peers[rank] = {pw: w.transport.add_peer(prefill[pw].metadata) for pw in self.plan.peers_of(rank)}
        self.sources = {pw: info.memory for pw, info in prefill.items()}

    def descriptors(self, src_blocks, dst_blocks) -> dict[WorkerRank, dict]:
        return {
            rank: worker_descriptors(self.plan, rank, w.memory, self.sources, src_blocks, dst_blocks)
            for rank, w in self.workers.items()
        }

    def post(self, descs: dict[WorkerRank, dict], tag: str = "") -> list:
        """Post every worker's READs, one per prefill peer; returns [(worker, Transfer)]."""
        posted = []
        for rank, per_peer in descs.items():
            w = self.workers[rank]
            notif = self.scn.notification(rank) + tag.encode()
            for pw, d in per_peer.items():
                t = w.transport.read(self.peers[rank][pw], d, w.memory, self.sources[pw], notif)
                posted.append((w, t))
        return posted

    @staticmethod
    def wait(posted: list, timeout_s: float = 20.0) -> None:
        """Poll every transfer with backoff until done, then release them."""
        backoff = Backoff()
        deadline = time.monotonic() + timeout_s
        pending = list(posted)
        while pending:
            pending = [(w, t) for w, t in pending if not w.transport.poll(t)]
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} READs not done after {timeout_s} s")
                backoff.sleep()
        for w, t in posted:
            w.transport.release(t)

    def read(self, prefill: dict[WorkerRank, PeerInfo], timeout_s: float = 20.0) -> dict[WorkerRank, DecodeResult]:
        """Connect, read the scenario's request, wait, and check every byte of every decode worker."""
        self.connect(prefill)
        t0 = time.perf_counter()
        descs = self.descriptors(*self.scn.request())
        self.wait(self.post(descs), timeout_s)
        seconds = time.perf_counter() - t0
        return {
            r: DecodeResult(
                self.mismatched_bytes(r),
                sum(d.nbytes for d in per_peer.values()),
                sum(len(d) for d in per_peer.values()),
                seconds,
            )
            for r, per_peer in descs.items()
        }

    def reference(self) -> torch.Tensor:
        if self._ref is None:
            self._ref = reference_kv(self.scn)
        return self._ref

    def expected(self, rank: WorkerRank, src_blocks=None, dst_blocks=None) -> torch.Tensor:
        """What worker `rank`'s whole buffer must hold after the READ: its initial bytes, with the request's
        blocks replaced by the reference's blocks for its layers and heads."""
        w = self.workers[rank]
        if src_blocks is None:
            src_blocks, dst_blocks = self.scn.request()
        out = self.initial[rank].clone()
        w.view(out)[:, torch.as_tensor(dst_blocks)] = w.reference_part(self.reference())[:, torch.as_tensor(src_blocks)]
        return out

    def mismatched_bytes(self, rank: WorkerRank, src_blocks=None, dst_blocks=None) -> int:
        got = self.workers[rank].buf.view(torch.uint8)
        want = self.expected(rank, src_blocks, dst_blocks).view(torch.uint8)
        return int((got != want).sum())

    def progress(self) -> None:
        for w in self.workers.values():
            w.transport.notifications()

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def expected_notifications(scn: Scenario, rank: WorkerRank) -> list[bytes]:
    """What prefill worker `rank` must be told for one request: one notification per decode reader."""
    return sorted(scn.notification(d) for d in scn.plan().readers_of(rank))


def _serve(conn, backoff: Backoff, poll, on_command) -> None:
    """Poll (UCX progress) with backoff, sleeping in conn.poll so commands wake us at once."""
    while True:
        if poll():
            backoff.reset()
        if conn.poll(backoff.step()):
            cmd = conn.recv()
            if cmd == "stop":
                return
            on_command(cmd)
            backoff.reset()


def prefill_main(conn, scn: Scenario, ranks: Sequence[WorkerRank]) -> None:
    """Host prefill workers `ranks`: publish them, then collect notifications until told to stop."""
    workers: list[Worker] = []
    try:
        ref = reference_kv(scn)
        workers = [make_prefill(scn, r, ref) for r in ranks]
        for w in workers:
            w.start()
        conn.send(("ready", {w.rank: w.info() for w in workers}))
        notifs: dict[WorkerRank, dict[str, list[bytes]]] = {w.rank: {} for w in workers}

        def poll() -> bool:
            got = False
            for w in workers:
                for peer, msgs in w.transport.notifications().items():
                    notifs[w.rank].setdefault(peer, []).extend(msgs)
                    got = True
            return got

        def on_command(cmd) -> None:
            if cmd == "notifs":
                conn.send(("notifs", notifs))
            elif cmd == "unchanged":
                ok = all(torch.equal(w.view(), w.reference_part(ref)) for w in workers)
                conn.send(("unchanged", ok))

        _serve(conn, Backoff(cap_s=2e-3), poll, on_command)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        for w in workers:
            w.close()


def decode_main(conn, scn: Scenario, ranks: Sequence[WorkerRank]) -> None:
    """Host decode workers `ranks`: wait for the prefill side's info, read, check, report, then keep the
    agents alive (and progressing) until told to stop."""
    side = None
    try:
        side = DecodeSide(scn, ranks).start()
        conn.send(("started", os.getpid()))
        prefill = conn.recv()
        conn.send(("done", side.read(prefill)))

        def poll() -> bool:
            side.progress()
            return False

        _serve(conn, Backoff(cap_s=5e-3), poll, lambda cmd: None)
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if side is not None:
            side.close()
