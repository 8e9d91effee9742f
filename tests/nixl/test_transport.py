"""The NIXL transport: unit checks without NIXL, then real READs between real processes on loopback.

Every process started here is stopped in a fixture's teardown (stop message, then terminate, then kill by
PID), also when a test fails. Everything stays on 127.0.0.1: UCX_NET_DEVICES=lo.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from kvbridge.core.descriptors import Descriptors, worker_descriptors
from kvbridge.core.errors import TransferError, TransferTimeout
from kvbridge.core.memory import Region, WorkerMemory, region_table, synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.transport import nixl_descriptors
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl import FLUSH_BYTES, NixlTransport
from kvbridge.transport.nixl_config import TransportConfig, apply_ucx_env
from kvbridge.transport.nixl_descriptors import descriptor_arrays
from support import fork_server
from support.nixl_peer import (
    DecodeSide,
    Scenario,
    expected_notifications,
    make_decode,
    make_prefill,
    reference_kv,
)

CTX = fork_server.context()
STARTUP_S = 60.0  # a peer imports torch and creates its agents; generous for a loaded 2-core machine


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    """Keep UCX on loopback, for this process and for every process it spawns."""
    cfg = TransportConfig()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", cfg.ucx_tls)


class Peers:
    """Spawned processes, each with a Pipe; `close()` stops them all, whatever state they are in."""

    def __init__(self) -> None:
        self.procs: list[tuple[mp.Process, object]] = []

    def spawn(self, target, *args):
        parent, child = CTX.Pipe()
        proc = fork_server.start(target, child, *args)
        child.close()
        self.procs.append((proc, parent))
        return proc, parent

    def close(self) -> None:
        for proc, conn in self.procs:
            try:
                if proc.is_alive():
                    conn.send("stop")
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for proc, _ in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc, conn in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(3)
            if proc.is_alive():
                os.kill(proc.pid, 9)
                proc.join(3)
            conn.close()


@pytest.fixture
def peers():
    p = Peers()
    try:
        yield p
    finally:
        p.close()


def recv(conn, expect: str, timeout_s: float = STARTUP_S):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {expect!r} from peer within {timeout_s} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise AssertionError(f"peer failed:\n{payload}")
    assert kind == expect, (kind, payload)
    return payload


def collect_notifications(conns, want: dict[WorkerRank, list[bytes]], timeout_s: float = 20.0):
    """Ask the prefill processes for their notifications until every prefill worker has what it must."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=1e-3, cap_s=20e-3)
    while True:
        got: dict[WorkerRank, dict[str, list[bytes]]] = {}
        for conn in conns:
            conn.send("notifs")
            got.update(recv(conn, "notifs", timeout_s))
        flat = {r: sorted(m for msgs in got.get(r, {}).values() for m in msgs) for r in want}
        if flat == want or time.monotonic() > deadline:
            return got, flat
        backoff.sleep()


def start_prefill(peers: Peers, scn: Scenario, ranks, per_process: bool = False):
    """Prefill workers in one process (or one process each); returns ({rank: PeerInfo}, conns)."""
    from support.nixl_peer import prefill_main

    groups = [[r] for r in ranks] if per_process else [list(ranks)]
    conns = [peers.spawn(prefill_main, scn, g)[1] for g in groups]
    info = {}
    for conn in conns:
        info.update(recv(conn, "ready"))
    return info, conns


# -- without NIXL ----------------------------------------------------------------------------------


def test_config_defaults_and_validation():
    cfg = TransportConfig()
    assert cfg.backend == "UCX" and not cfg.progress_thread
    assert cfg.ucx_env() == {"UCX_TLS": "self,sm,cma,tcp", "UCX_NET_DEVICES": "lo"}
    assert TransportConfig(ucx_tls=None, ucx_net_devices=None).ucx_env() == {}
    with pytest.raises(ValueError):
        TransportConfig(backend="")
    with pytest.raises(ValueError):
        TransportConfig(num_threads=-1)


def test_ucx_env_is_applied_only_where_unset(monkeypatch):
    monkeypatch.delenv("UCX_TLS")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    effective = apply_ucx_env(TransportConfig())
    assert effective == {"UCX_TLS": "self,sm,cma,tcp", "UCX_NET_DEVICES": "eth7"}
    assert os.environ["UCX_NET_DEVICES"] == "eth7"


def test_constructor_does_nothing_but_store():
    t = NixlTransport("quiet", TransportConfig(progress_thread=True))
    assert not t.started and t.peers == frozenset()
    with pytest.raises(TransferError, match="not started"):
        t.agent_metadata()
    t.close()  # closing what never started is fine
    with pytest.raises(ValueError):
        NixlTransport("")


def _descs(src, dst, length, src_region, dst_region) -> Descriptors:
    a = [np.asarray(x, dtype=np.int64) for x in (src, dst, length, src_region, dst_region)]
    return Descriptors(*a)


def test_descriptor_arrays_take_device_id_from_the_region_not_a_rank():
    local = (Region(0x1000, 0x1000, device_id=3), Region(0x8000, 0x100, device_id=5))
    remote = (Region(0x20000, 0x1000, device_id=7),)
    d = _descs([0x20000, 0x20100], [0x1010, 0x8000], [0x10, 0x20], [0, 0], [0, 1])
    loc, rem = descriptor_arrays(d, local, remote)
    assert loc.dtype == np.uint64 and loc.shape == (2, 3)
    assert loc.tolist() == [[0x1010, 0x10, 3], [0x8000, 0x20, 5]]
    assert rem.tolist() == [[0x20000, 0x10, 7], [0x20100, 0x20, 7]]


@pytest.mark.parametrize(
    ("d", "match"),
    [
        (_descs([0x20000], [0x1FF0], [0x20], [0], [0]), "local descriptor 0 .* outside"),
        (_descs([0x20FF0], [0x1000], [0x20], [0], [0]), "remote descriptor 0 .* outside"),
        (_descs([0x20000], [0x1000], [0x20], [1], [0]), "remote descriptor names region 1"),
    ],
)
def test_descriptor_arrays_refuse_bytes_outside_their_region(d, match):
    with pytest.raises(TransferError, match=match):
        descriptor_arrays(d, (Region(0x1000, 0x1000),), (Region(0x20000, 0x1000),))


def test_a_workers_region_table_is_made_once_and_bare_regions_are_checked_afresh():
    """A worker's memory keeps its regions' bounds (one table for life, read-only, the same arrays as made afresh);
    bare regions are checked against their bounds at every READ: a list changed in place, or a new tuple where a
    dropped one was (its id comes back at once in CPython), never meets an older table's bounds."""
    memory = synthesize_memory("LBHNC", KVGeometry(2, 2, 8, "float16", 4), [0, 1], 2, 8, 1 << 20)
    assert memory.region_table is memory.region_table
    assert all((a == b).all() for a, b in zip(memory.region_table, region_table(memory.regions), strict=True))
    with pytest.raises(ValueError):  # shared by every READ: never written
        memory.region_table[1][0] = 0
    base = memory.regions[0].addr
    d = _descs([0x20000], [base + 0x10], [0x10], [0], [0])
    remote = (Region(0x20000, 0x1000),)
    assert [a.tolist() for a in descriptor_arrays(d, memory, remote)] == [
        a.tolist() for a in descriptor_arrays(d, memory.regions, remote)
    ]
    for _ in range(50):
        wide = (Region(0x100, 0x100), Region(0x1000, 0x1000))
        descriptor_arrays(_descs([0x20000], [0x1800], [0x10], [0], [1]), wide, remote)
        del wide
        with pytest.raises(TransferError, match=r"local descriptor 0 .* outside"):
            descriptor_arrays(
                _descs([0x20000], [0x1800], [0x10], [0], [1]), (Region(0x100, 0x100), Region(0x1000, 0x100)), remote
            )
    listed = [Region(0x1000, 0x1000)]
    d = _descs([0x20000], [0x1800], [0x10], [0], [0])
    nixl_descriptors.side_array("local", d.dst_addr, d.length, d.dst_region, listed)
    listed[0] = Region(0x1000, 0x100)
    with pytest.raises(TransferError, match=r"local descriptor 0 .* outside"):
        nixl_descriptors.side_array("local", d.dst_addr, d.length, d.dst_region, listed)


def test_backoff_doubles_to_its_cap_and_resets():
    b = Backoff(first_s=1e-4, cap_s=3e-4)
    assert [b.step() for _ in range(4)] == [1e-4, 2e-4, 3e-4, 3e-4]
    b.reset()
    assert b.step() == 1e-4


# -- real NIXL, one process ------------------------------------------------------------------------

GEOM = KVGeometry(num_layers=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=16)


@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_two_agents_in_one_process_read_notify_and_close():
    """API behaviour without processes: register, metadata, read with notification, empty read, close."""
    scn = Scenario("local", GEOM, ParallelLayout(), ParallelLayout(), request_blocks=5)
    ref = reference_kv(scn)
    rank = WorkerRank(0, 0)
    prefill = make_prefill(scn, rank, ref)
    side = DecodeSide(scn, [rank])
    decode = side.workers[rank]
    assert side.mismatched_bytes(rank) > 0  # the check is not vacuous: before the READ it fails
    with prefill.transport as p, decode.transport as d:
        p.register(prefill.memory)
        p.register(prefill.memory)  # each region once, however often asked
        d.register(decode.memory)
        name = d.add_peer(p.agent_metadata())
        assert name == p.name and isinstance(name, str) and d.peers == {name}
        src, dst = scn.request()
        descs = worker_descriptors(scn.plan(), rank, decode.memory, {rank: prefill.memory}, src, dst)[rank]
        t = d.read(name, descs, decode.memory, prefill.memory, b"req-1")
        notes: dict[str, list[bytes]] = {}
        backoff, deadline = Backoff(), time.monotonic() + 20
        while not (d.poll(t) and notes):  # both sides progress by polling: no progress thread
            for k, v in p.notifications().items():
                notes.setdefault(k, []).extend(v)
            assert time.monotonic() < deadline, "READ or its notification never completed"
            backoff.sleep()
        assert notes == {d.name: [b"req-1"]}
        assert all(isinstance(k, str) for k in notes)
        d.release(t)
        assert side.mismatched_bytes(rank) == 0

        empty = d.read(name, Descriptors.empty(), decode.memory, prefill.memory, b"nothing-to-read")
        assert d.poll(empty)
        d.wait(empty, timeout_s=1)
        while not (got := p.notifications()):
            assert time.monotonic() < deadline
            backoff.sleep()
        assert got == {d.name: [b"nothing-to-read"]}

        with pytest.raises(TransferError, match="unknown"):
            d.read("nobody", descs, decode.memory, prefill.memory, b"x")
        into_unregistered = worker_descriptors(scn.plan(), rank, prefill.memory, {rank: prefill.memory}, src, dst)[rank]
        with pytest.raises(TransferError, match="not registered"):
            d.read(name, into_unregistered, prefill.memory, prefill.memory, b"x")
        d.remove_peer(name)
        d.remove_peer(name)
        assert d.peers == frozenset()
    assert not p.started and not d.started


@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_a_flush_read_completes_without_a_notification_or_a_byte_of_kv_memory():
    """`post_flush` (read before closing an endpoint whose peer may still have answers queued): a 64-byte READ
    into the reader's own scratch buffer, which completes, tells the peer nothing and writes no KV block."""
    scn = Scenario("local", GEOM, ParallelLayout(), ParallelLayout(), request_blocks=5)
    rank = WorkerRank(0, 0)
    prefill = make_prefill(scn, rank, reference_kv(scn))
    side = DecodeSide(scn, [rank])
    decode = side.workers[rank]
    before = side.mismatched_bytes(rank)
    assert before > 0  # a READ into KV memory would change this
    with prefill.transport as p, decode.transport as d:
        p.register(prefill.memory)
        d.register(decode.memory)
        name = d.add_peer(p.agent_metadata())
        backoff, deadline = Backoff(), time.monotonic() + 20
        notes: dict[str, list[bytes]] = {}
        for _ in range(2):  # the second one reuses the registered scratch buffer
            flush = d.post_flush(name, prefill.memory.regions[0])
            assert flush.nbytes == FLUSH_BYTES and flush.notification == b""
            while not d.poll(flush):
                notes.update(p.notifications())
                assert time.monotonic() < deadline, "the flush READ never completed"
                backoff.sleep()
            d.release(flush)
        for _ in range(20):  # a notification, had one been sent, would arrive within these polls
            notes.update(p.notifications())
            d.notifications()
            time.sleep(0.01)
        assert notes == {}
        assert side.mismatched_bytes(rank) == before
        with pytest.raises(TransferError, match="unknown"):
            d.post_flush("nobody", prefill.memory.regions[0])


@pytest.mark.nixl
@pytest.mark.timeout(30)
@pytest.mark.parametrize("thread", [False, True], ids=["progress-thread-off", "progress-thread-on"])
def test_idle_agent_cpu_follows_the_progress_thread_setting(thread):
    """Off (the default) an idle agent costs no CPU; NIXL's own thread spins about a core."""
    with NixlTransport(f"idle-{thread}-{os.getpid()}", TransportConfig(progress_thread=thread)):
        c0 = time.process_time()
        time.sleep(0.5)
        cpu = time.process_time() - c0
    # Lenient bounds: on a loaded 2-core machine the spinning thread gets only a share of a core.
    assert (cpu > 0.03) if thread else (cpu < 0.02), cpu


@pytest.mark.nixl
@pytest.mark.timeout(30)
def test_progress_thread_completes_reads_without_target_polling():
    """With the thread on, the target need not poll for a reader's first READ (with it off, it must)."""
    scn = Scenario("thread", GEOM, ParallelLayout(), ParallelLayout(), config=TransportConfig(progress_thread=True))
    rank = WorkerRank(0, 0)
    prefill = make_prefill(scn, rank, reference_kv(scn)).start()
    side = DecodeSide(scn, [rank]).start()
    try:
        d = side.workers[rank].transport
        peer = d.add_peer(prefill.info().metadata)
        src, dst = scn.request()
        descs = worker_descriptors(scn.plan(), rank, side.workers[rank].memory, {rank: prefill.memory}, src, dst)
        d.wait(d.read(peer, descs[rank], side.workers[rank].memory, prefill.memory, b"n"), timeout_s=10)
        assert side.mismatched_bytes(rank) == 0
    finally:
        side.close()
        prefill.close()


# -- real NIXL between processes -------------------------------------------------------------------

SCENARIOS = [
    # pp1tp2 -> pp2tp1: decode stages each read half the layers from both prefill TP ranks.
    Scenario(
        "pp1tp2-pp2tp1-LBNHC",
        GEOM,
        ParallelLayout(pp=1, tp=2),
        ParallelLayout(pp=2, tp=1),
        "LBNHC",
        "LBNHC",
        seed=1,
    ),
    # PP on both sides with different stage splits (5 layers: 3+2) and different physical layouts.
    Scenario(
        "pp2tp2-pp2tp1-LBHNC-LBNHC",
        KVGeometry(5, 2, 32, "float32", 16),
        ParallelLayout(pp=2, tp=2),
        ParallelLayout(pp=2, tp=1, layer_partition=(2, 3)),
        "LBHNC",
        "LBNHC",
        seed=2,
    ),
    # K and V in separate planes (older GPU backends), bf16, one worker each.
    Scenario(
        "pp1tp1-KV_NHD",
        KVGeometry(3, 4, 64, "bfloat16", 8),
        ParallelLayout(),
        ParallelLayout(),
        "KV_NHD",
        "KV_HND",
        seed=3,
    ),
    # tp=4 prefill with 2 KV heads: each head held by two prefill ranks; decode tp=2 spread over replicas.
    Scenario(
        "pp1tp4-pp1tp2-replicated-BLHNC",
        GEOM,
        ParallelLayout(pp=1, tp=4),
        ParallelLayout(pp=1, tp=2),
        "BLHNC",
        "LBHNC",
        seed=4,
    ),
]


@pytest.mark.nixl
@pytest.mark.timeout(90)
@pytest.mark.parametrize("scn", SCENARIOS, ids=lambda s: s.name)
def test_layout_pair_one_process_per_side(peers, scn):
    """All prefill workers in one spawned process, all decode workers here; one agent per worker."""
    side = DecodeSide(scn, scn.decode.workers())  # allocate while the prefill process starts
    info, conns = start_prefill(peers, scn, scn.prefill.workers())
    assert all(i.ucx_env.get("UCX_NET_DEVICES") == "lo" for i in info.values())
    side.start()
    try:
        results = side.read(info)
        want = {r: expected_notifications(scn, r) for r in scn.prefill.workers()}
        got, flat = collect_notifications(conns, want)
    finally:
        side.close()
    for rank, res in results.items():
        assert res.mismatched_bytes == 0, f"decode {rank}: {res}"
        assert res.nbytes > 0
    assert flat == want
    names = {w.transport.name for w in side.workers.values()}
    assert {peer for per in got.values() for peer in per} <= names
    conns[0].send("unchanged")
    assert recv(conns[0], "unchanged")  # a READ never writes to the prefill side


@pytest.mark.nixl
@pytest.mark.timeout(90)
def test_prefill_pp2_to_decode_tp2_one_process_per_worker(peers):
    """The issue's case with every worker in its own process: two prefill stages, two decode TP ranks."""
    from support.nixl_peer import decode_main

    scn = Scenario("pp2tp1-pp1tp2-procs", GEOM, ParallelLayout(pp=2, tp=1), ParallelLayout(pp=1, tp=2), seed=5)
    decode_conns = {r: peers.spawn(decode_main, scn, [r])[1] for r in scn.decode.workers()}
    info, prefill_conns = start_prefill(peers, scn, scn.prefill.workers(), per_process=True)
    pids = {i.pid for i in info.values()} | {recv(c, "started") for c in decode_conns.values()}
    assert len(pids) == 4 and os.getpid() not in pids
    for conn in decode_conns.values():
        conn.send(info)
    results = {}
    for conn in decode_conns.values():
        results.update(recv(conn, "done"))
    assert set(results) == set(scn.decode.workers())
    for rank, res in results.items():
        assert res.mismatched_bytes == 0, f"decode {rank}: {res}"
    want = {r: expected_notifications(scn, r) for r in scn.prefill.workers()}
    _, flat = collect_notifications(prefill_conns, want)
    assert flat == want


@pytest.mark.nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("connected", [True, False], ids=["after-a-read", "before-any-read"])
def test_vanished_peer_gives_transfer_error_not_a_hang(peers, connected):
    scn = Scenario("dead", GEOM, ParallelLayout(), ParallelLayout(), seed=6)
    rank = WorkerRank(0, 0)
    decode = make_decode(scn, rank).start()
    try:
        info, _ = start_prefill(peers, scn, [rank])
        proc = peers.procs[0][0]
        d = decode.transport
        peer = d.add_peer(info[rank].metadata)
        src, dst = scn.request()
        descs = worker_descriptors(scn.plan(), rank, decode.memory, {rank: info[rank].memory}, src, dst)[rank]
        if connected:
            d.wait(d.read(peer, descs, decode.memory, info[rank].memory, b"first"), timeout_s=20)
        proc.kill()
        proc.join(10)
        assert not proc.is_alive()
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            d.wait(d.read(peer, descs, decode.memory, info[rank].memory, b"second"), timeout_s=15)
        assert not isinstance(err.value, TransferTimeout), err.value
        assert time.monotonic() - t0 < 15
        d.remove_peer(peer)
    finally:
        decode.close()


def test_worker_memory_is_what_the_transport_registers():
    """The transport registers Regions; a WorkerMemory built by the peer helper has exactly one per worker."""
    scn = Scenario("mem", GEOM, ParallelLayout(pp=2), ParallelLayout(tp=2))
    w = make_decode(scn, WorkerRank(0, 1))
    assert isinstance(w.memory, WorkerMemory) and len(w.memory.regions) == 1
    assert w.memory.regions[0].addr == w.buf.data_ptr()


def test_auto_transports_for_host_memory_add_cuda_copy_on_a_gpu_host(monkeypatch):
    """NIXL built for CUDA refuses a UCX_TLS without a CUDA transport on a host with GPUs, even for KV in host
    memory (seen on the device machine): `auto` adds cuda_copy there, and only there."""
    from kvbridge.core.config import BridgeConfig
    from kvbridge.runtime import prefill_worker

    monkeypatch.setattr(prefill_worker, "has_nvidia_gpu", lambda: False)
    assert prefill_worker.transport_config(BridgeConfig(), "DRAM").ucx_tls == "self,sm,cma,tcp"
    monkeypatch.setattr(prefill_worker, "has_nvidia_gpu", lambda: True)
    assert prefill_worker.transport_config(BridgeConfig(), "DRAM").ucx_tls == "self,sm,cma,tcp,cuda_copy"
    assert prefill_worker.transport_config(BridgeConfig(), "VRAM").ucx_tls is None  # UCX's own choice
    assert prefill_worker.transport_config(BridgeConfig(ucx_tls="tcp"), "DRAM").ucx_tls == "tcp"  # as told


def test_auto_transports_leave_rdma_peers_to_ucx(monkeypatch):
    """Host memory read across hosts over RDMA: `auto` must not pin UCX to shared memory and tcp (then UCX has
    no rc / ud / dc lane to the other host and every load fails); it leaves the choice to UCX. Control: the same
    config without RDMA devices keeps the one-host transports."""
    from kvbridge.core.config import BridgeConfig
    from kvbridge.runtime import prefill_worker

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(prefill_worker, "has_nvidia_gpu", lambda: False)
    assert prefill_worker.transport_config(BridgeConfig(ucx_net_devices="mlx5_0:1"), "DRAM").ucx_tls is None
    assert prefill_worker.transport_config(BridgeConfig(ucx_net_devices="lo"), "DRAM").ucx_tls == "self,sm,cma,tcp"
