"""`NixlTransport.renew` is a fence: a READ queued on a stopped peer writes nothing once the agent is renewed, even
after the peer runs again; removing the peer alone (NIXL 1.5.1 closes its endpoint in UCX's flush mode) lets it
land. Real NIXL, the peer in a process of its own, UCX over tcp (where a READ needs its target to progress).

Oracle: the reader's buffer is zero before and holds no byte of the peer's after it resumes and the reader
progresses. Negative control: the same READ with `remove_peer` only, whose bytes land. (The renewed peer, once it
runs again, is aborted by UCX as its queued answer fails: docs/failures.md, "A silent prefill".)"""

from __future__ import annotations

import time
import weakref

import numpy as np
import pytest

from kvbridge.core.descriptors import Descriptors
from kvbridge.core.memory import Region, WorkerMemory
from kvbridge.runtime.host import has_nvidia_gpu
from kvbridge.transport.nixl import NixlTransport
from support.nixl_target import NixlTarget

pytestmark = pytest.mark.nixl

NBYTES = 1 << 20
FILL = 42


def one_read(src: Region, dst: Region, nbytes: int) -> Descriptors:
    def one(value: int) -> np.ndarray:
        return np.array([value], dtype=np.int64)

    return Descriptors(one(src.addr), one(dst.addr), one(nbytes), one(0), one(0))


@pytest.fixture
def tcp_only(monkeypatch):
    """UCX over tcp alone for host memory (cma would copy from a stopped process: no READ would wait on it); where
    a GPU is present NIXL refuses a UCX_TLS without a CUDA transport, so cuda_copy is named too."""
    monkeypatch.setenv("UCX_TLS", "self,tcp,cuda_copy" if has_nvidia_gpu() else "self,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.mark.parametrize("fence", ["renew", "remove_peer"])
def test_a_read_queued_on_a_stopped_peer_lands_only_without_a_renewal(tcp_only, fence):
    buffer = np.zeros(NBYTES, dtype=np.uint8)
    local = WorkerMemory((Region(buffer.ctypes.data, NBYTES),), ())
    with NixlTarget(NBYTES, FILL) as target, NixlTransport("nixl-reader") as reader:
        reader.register(local)
        peer = reader.add_peer(target.metadata)
        remote = WorkerMemory((target.region,), ())
        warm = reader.read(peer, one_read(target.region, local.regions[0], 64), local, remote, b"")
        reader.wait(warm, 10.0)
        reader.release(warm)
        buffer[:] = 0
        target.stop()
        stalled = reader.read(peer, one_read(target.region, local.regions[0], NBYTES), local, remote, b"")
        time.sleep(0.3)
        assert not reader.poll(stalled) and not buffer.any()  # queued on the stopped peer
        generation = reader.generation
        if fence == "renew":
            old = weakref.ref(reader._agent.agent)  # NIXL's bound agent: its UCX worker and endpoints
            reader.renew(drop={peer})
            assert old() is None, "the old agent outlived the renewal"
            assert reader.generation == generation + 1 and peer not in reader.peers
        else:
            reader.remove_peer(peer)
        target.resume()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not (buffer == FILL).all():  # a landing READ's bytes come in pieces
            reader.notifications()  # progress the reader's agent: where late data would land
            time.sleep(0.01)
        landed = int((buffer == FILL).sum())
    print(f"{fence}: {landed} of {NBYTES} bytes landed after the READ was given up")
    assert landed == (0 if fence == "renew" else NBYTES)


def test_a_renewed_agent_reads_again_from_the_peers_it_kept(tcp_only):
    buffer = np.zeros(NBYTES, dtype=np.uint8)
    local = WorkerMemory((Region(buffer.ctypes.data, NBYTES),), ())
    with NixlTarget(NBYTES, FILL) as target, NixlTransport("nixl-reader") as reader:
        reader.register(local)
        peer = reader.add_peer(target.metadata)
        reader.renew()
        assert reader.peers == {peer} and reader.name == "nixl-reader-g1"
        transfer = reader.read(
            peer, one_read(target.region, local.regions[0], NBYTES), local, WorkerMemory((target.region,), ()), b""
        )
        reader.wait(transfer, 10.0)
        reader.release(transfer)
    assert (buffer == FILL).all()
