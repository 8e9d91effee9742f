"""The decode worker's wiring of a CUDA IPC load whose kernels go out while its claim is on the wire: through a real
side channel to a real prefill process, the claim answered (granted or refused) before the kernels finish
reports nothing; the load is reported once the kernels are done, loaded if the claim was granted and failed if it
was refused. A fake GPU reader stands for the kernels (the test finishes them); `IpcReads`' own join is
`tests/unit/test_ipc_launch_in_claim.py`."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.ipc_reads import IpcReads
from kvbridge.serving.launcher import free_base_port
from support.fake_gpu_reader import FakeReader
from support.prefill_process import GEOMETRY, PrefillProcess, kv, memory_of, params_of

pytestmark = pytest.mark.nixl

BLOCKS = [1, 2, 3]


def job(port: int, request_id: str, prompt_hash: str = "h") -> LoadJob:
    source = params_of(port, request_id, BLOCKS, prompt_hash=prompt_hash)
    return LoadJob(f"decode-{request_id}", source, ((4, 5, 6),), (tuple(BLOCKS),))


def reported(decode: DecodeWorker, within_s: float) -> tuple[set[str], set[str]]:
    """(loaded, failed) request ids reported within `within_s` (returns at the first report)."""
    done, failed = set(), set()
    deadline = time.monotonic() + within_s
    while not (done or failed) and time.monotonic() < deadline:
        d, f, _ = decode.results(0.02)
        done |= d
        failed |= f
    return done, failed


@pytest.fixture
def ipc_side():
    """A decode worker whose engine "prefill-a" (a real prefill process, its first load read through NIXL) is
    read by fake kernels from then on; yields (decode, prefill, port, reader, claim answered)."""
    port = free_base_port(1)
    prefill = PrefillProcess(port, "prefill-a", 1)
    buffer = torch.zeros_like(kv(0))  # the decode's KV: registered with NIXL, kept alive to the end
    decode = DecodeWorker(
        WorkerIdentity("decode", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY),
        memory_of(buffer),
        BridgeConfig(side_channel_port=port),
    ).start()
    try:
        prefill.hold("warm", BLOCKS, "token-warm")
        decode.load(job(port, "warm"))
        assert reported(decode, 30) == ({"decode-warm"}, set())
    except BaseException:
        decode.close()
        prefill.close()
        raise
    reader = FakeReader()
    ipc = IpcReads(decode.identity, decode.memory, (), loaded=decode._copied, failed=decode._fail).start(reader)
    answered = threading.Event()
    claim_done = ipc.claim_done

    def spy(load, error: str = "") -> None:
        answered.set()
        claim_done(load, error)

    ipc.claim_done = spy
    decode.ipc = ipc
    (engine,) = decode.peers.all_engines()
    engine.kernels = {rank: SimpleNamespace(block_bytes=64) for rank in engine.peers}
    try:
        yield decode, prefill, port, reader, answered
    finally:
        for end in reader.ends:
            end.done.set()
        decode.close()
        ipc.close()
        prefill.close()
        del buffer


def test_a_granted_claim_reports_the_load_only_once_its_kernels_finish(ipc_side):
    decode, prefill, port, reader, answered = ipc_side
    prefill.hold("r1", BLOCKS, "token-r1")
    decode.load(job(port, "r1"))
    assert reader.launched.wait(10)
    answered.wait(5)  # the claim granted (checked below: a report at the grant must fail the next line first)
    assert reported(decode, 0.3) == (set(), set())  # the kernels may still write the request's blocks
    assert answered.is_set()
    reader.ends[-1].done.set()
    assert reported(decode, 5) == ({"decode-r1"}, set())


def test_a_refused_claim_fails_the_load_only_once_its_kernels_finish(ipc_side):
    decode, prefill, port, reader, answered = ipc_side
    prefill.hold("r2", BLOCKS, "token-r2")
    decode.load(job(port, "r2", prompt_hash="another-prompt"))  # not the hold's prompt: refused (mismatch) at once
    assert reader.launched.wait(10)
    answered.wait(5)
    assert reported(decode, 0.3) == (set(), set())  # refused, but its kernels still run
    assert answered.is_set()
    reader.ends[-1].done.set()
    assert reported(decode, 5) == (set(), {"decode-r2"})
