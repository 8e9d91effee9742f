"""A recording fake of `NixlTransport` for unit tests of `runtime.nixl_reads.NixlReads` (the drain and flush
ordering tests), and a NixlReads and a load built on it: the test decides when NIXL accepts a release, when a READ's
DMA ends and whether a post fails."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import Descriptors
from kvbridge.core.errors import TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.nixl_reader import NixlReader
from kvbridge.runtime.nixl_reads import NixlReads
from kvbridge.transport.nixl_descriptors import Transfer
from kvbridge.wire import messages as wire

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
RANKS = (WorkerRank(0, 0), WorkerRank(0, 1))  # a prefill engine of tp=2: one READ from each worker


class FakeTransport:
    """What NixlReads calls on NixlTransport, with the test deciding the outcomes. `events` logs, in order:
    ("post", i), ("post-failed", i), ("release-refused", i), ("released", i), ("release-in-flight", i), ("flush", i),
    ("removed", agent), ("renewed", agents), ("restarted", ())."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(prepared_lists=False)
        self.name = "decode-reader"
        self.ucx_env: dict[str, str] = {}
        self.events: list[tuple[str, int]] = []
        self.transfers: list[Transfer] = []
        self.dma_done: set[int] = set()  # READs whose DMA has ended (the test sets this)
        self.refuse_release: dict[int, int] = {}  # READ -> how many more releases NIXL refuses
        self.fail_post: dict[int, bool] = {}  # READ -> fails to post (True: and NIXL keeps its request)
        self.held: set[int] = set()  # READs NIXL took: posted, or failed to post and kept
        self.peers: set[str] = set()  # no agent loaded: a failed load is not fenced (test_nixl_reads_flush is)

    def read(self, agent, descriptors, local, remote, notification) -> Transfer:
        i = len(self.transfers)
        transfer = Transfer(agent, descriptors.nbytes, len(descriptors), notification, time.monotonic())
        self.transfers.append(transfer)
        if i in self.fail_post:
            self.events.append(("post-failed", i))
            error = TransferError(f"NIXL refused to post READ {i}")
            if self.fail_post[i]:  # as NixlTransport._discard: the request could not be released
                error.transfer = transfer
                self.held.add(i)
            else:
                transfer.state = "RELEASED"
            raise error
        self.events.append(("post", i))
        self.held.add(i)
        return transfer

    def poll(self, transfer: Transfer) -> bool:
        i = self.transfers.index(transfer)
        if i in self.dma_done and transfer.state == "PROC":
            transfer.state = "DONE"
        return transfer.state != "PROC"

    def post_flush(self, agent, region, mem_type="DRAM") -> Transfer:
        """A flush READ: ("flush", i); its DMA ends when the test says so, as any READ's."""
        i = len(self.transfers)
        transfer = Transfer(agent, 64, 1, b"", time.monotonic())
        self.transfers.append(transfer)
        self.events.append(("flush", i))
        self.held.add(i)
        return transfer

    def remove_peer(self, agent) -> None:
        self.peers.discard(agent)
        self.events.append(("removed", agent))

    def restart(self) -> None:
        self.events.append(("restarted", ()))

    def retire(self, drop=frozenset()) -> None:
        """As `NixlTransport.retire`: every READ is released and its DMA ends (the old agent is gone)."""
        self.peers -= set(drop)
        self.dma_done.update(range(len(self.transfers)))
        for transfer in self.transfers:
            transfer.state = "RELEASED"
        self.events.append(("renewed", tuple(sorted(drop))))

    def release(self, transfer: Transfer) -> None:
        i = self.transfers.index(transfer)
        if transfer.state == "RELEASED":
            return
        if self.refuse_release.get(i, 0) > 0:
            self.refuse_release[i] -= 1
            self.events.append(("release-refused", i))
            raise TransferError(f"NIXL refused to release READ {i}")
        if i not in self.dma_done:  # NIXL cannot cancel a READ whose DMA runs (the real backend may refuse)
            self.events.append(("release-refused", i))
            raise TransferError(f"READ {i} is still in flight")
        transfer.state = "RELEASED"
        self.events.append(("released", i))


def make_reads(fake: FakeTransport, reports: list, cls: type[NixlReads] = NixlReads) -> NixlReads:
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    identity = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    peers = SimpleNamespace(drop=lambda engine, error: None)

    def loaded(load: Load) -> None:
        reports.append(("loaded", len(fake.events)))

    def failed(load: Load, error: str) -> None:
        reports.append(("failed", len(fake.events)))

    reader = NixlReader(fake, identity, "DRAM")  # the fake in place of a NixlTransport
    tell = lambda *a: None  # noqa: E731
    return cls(identity, memory, BridgeConfig(), "DRAM", peers, loaded=loaded, failed=failed, tell=tell, reader=reader)


def make_load(reads: NixlReads, ranks=RANKS, timeout_s: float = 60.0) -> Load:
    one = np.array([0], dtype=np.int64)
    descs = {rank: Descriptors(one, one, np.array([64], dtype=np.int64), one, one) for rank in ranks}
    reads._descriptors = lambda load, engine: descs  # the plan's descriptors are not what this tests
    peers = {rank: SimpleNamespace(agent=f"prefill-tp{rank.tp}", memory=reads.memory) for rank in ranks}
    engine = SimpleNamespace(key=("p", "127.0.0.1", 1), peers=peers, layout=ParallelLayout(tp=len(ranks)))
    job = LoadJob("req", None, ((3,),), ((1,),))
    now = time.monotonic()
    return Load(job, now, now + timeout_s, engine=engine)


def note() -> wire.Notify:
    return wire.Notify(request_id="req", engine_id="d", worker=wire.Worker(), expected=1, token="t")
