"""A slow transport gives slow loads, not failed ones.

A load's deadline is `transfer_timeout_s` plus the bytes in flight at the decode worker when it is queued (its
own and those queued before it) at a floor rate, capped; the claim pins the request on the prefill side for what
is left of it. The runtime tests put a decode worker and a prefill worker in this process (two NIXL agents over
UCX on loopback, as tests/nixl/test_liveness.py) and slow the decode side's transport down: each READ reports done
only some time after it was posted, as over UCX's software emulation of a GPU path (0.2-0.5 GB/s on one GPU).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import MAX_READ_S
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.emulation import emulation_reason
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.runtime.read_budget import ReadBudget, block_bytes
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire.params import PrefillDone

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
BLOCKS = 16
TIMEOUT_S = 0.5  # transfer_timeout_s of the runtime tests
SLOW_S = 1.5  # how long each READ of the slowed transport takes: three times the fixed deadline


def memory_of(buffer: torch.Tensor):
    return synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, BLOCKS, buffer.data_ptr())


def job(request_id: str, port: int, blocks: tuple[int, ...] = (1, 2), local: tuple[int, ...] = (3, 4)) -> LoadJob:
    source = PrefillDone(
        remote_engine_id="prefill",
        remote_request_id=request_id,
        remote_block_ids=list(blocks),
        remote_host="127.0.0.1",
        remote_port=port,
        remote_layout="pp=1,tp=1",
        remote_token=f"token-{request_id}",
        remote_prompt_hash="h",
    )
    return LoadJob(f"decode-{request_id}", source, (local,), (blocks,))


# -- the budget itself (no NIXL) ----------------------------------------------------------------------


def test_a_loads_budget_grows_with_the_bytes_in_flight_and_is_capped():
    config = BridgeConfig(transfer_timeout_s=25.0)
    budget = ReadBudget(config, bytes_per_block=1_000_000, floor_bytes_per_s=1e8, max_extra_s=300.0)
    first, second = job("a", 5600, (1, 2, 3, 4), (1, 2, 3, 4)), job("b", 5600, (5, 6), (5, 6))
    assert budget.begin(first) == pytest.approx(25.0 + 4e6 / 1e8)
    assert budget.begin(second) == pytest.approx(25.0 + 6e6 / 1e8)  # queued behind the first one's bytes
    budget.end(first)
    budget.end(first)  # twice: ignored
    assert budget.in_flight == 2_000_000
    budget.end(second)
    assert budget.in_flight == 0
    huge = job("c", 5600, tuple(range(100_000)), tuple(range(100_000)))
    assert budget.begin(huge) == pytest.approx(25.0 + 300.0)  # a stuck load still fails in bounded time
    budget.end(huge)
    long = ReadBudget(BridgeConfig(transfer_timeout_s=590.0), 1_000_000, 1e8, 300.0)
    assert long.begin(huge) == MAX_READ_S  # never past the longest pin a prefill worker grants
    refused = LoadJob("r", None, ((1,),), ((1,),), refused="no")
    assert budget.begin(refused) == 25.0 and budget.in_flight == 0  # never read: not counted


def test_an_8k_token_request_of_a_7b_model_gets_time_for_the_emulated_gpu_path():
    """Qwen2.5-7B (28 layers, 4 KV heads of 128, bf16, 16-token blocks): 448 MiB per 8k-token request; at the
    0.2 GB/s floor of UCX's emulation measured on one GPU it takes 2.3 s, four in flight 9.4 s."""
    g = KVGeometry(num_layers=28, num_kv_heads=4, head_size=128, dtype="bfloat16", block_size=16)
    per_block = block_bytes(synthesize_memory("LBHNC", g, list(range(28)), 4, 8, 0))
    assert per_block * 512 == 448 << 20
    budget = ReadBudget(BridgeConfig(transfer_timeout_s=25.0), per_block)
    seconds = [budget.begin(job(f"r{i}", 5600, tuple(range(512)), tuple(range(512)))) for i in range(4)]
    assert seconds[0] > 25.0 + (448 << 20) / 0.2e9  # floor below the slowest rate measured
    assert seconds[3] > 25.0 + 4 * (448 << 20) / 0.2e9


def test_what_says_ucx_can_only_emulate_gpu_memory_before_a_read():
    assert "names no GPU transport" in emulation_reason("VRAM", "self,sm,cma,tcp")
    assert emulation_reason("VRAM", "cuda_ipc,cuda_copy,sm,self,tcp") == ""
    assert emulation_reason("VRAM", "rc,tcp") == ""  # GPUDirect RDMA may carry it
    assert emulation_reason("VRAM", None) == "" and emulation_reason("VRAM", "") == ""  # UCX's own choice
    assert emulation_reason("VRAM", "^cuda_ipc") == ""  # all but: not judged before a READ
    assert emulation_reason("DRAM", "tcp") == ""


# -- the runtime, with a slowed transport -------------------------------------------------------------


@pytest.fixture
def workers():
    port = free_base_port(1)
    config = BridgeConfig(side_channel_port=port, transfer_timeout_s=TIMEOUT_S, lease_s=1.0)
    layout = ParallelLayout()
    prefill_kv = torch.randn(1 << 14)
    decode_kv = torch.zeros(1 << 14)
    prefill = PrefillWorker(
        WorkerIdentity("prefill", layout, 0, WorkerRank(0, 0), GEOMETRY), memory_of(prefill_kv), config
    ).start()
    decode = DecodeWorker(
        WorkerIdentity("decode", layout, 0, WorkerRank(0, 0), GEOMETRY), memory_of(decode_kv), config
    ).start()
    transport = decode.nixl.transport
    real_poll = transport.poll

    def slow_poll(transfer) -> bool:  # done only SLOW_S after it was posted: a slow link, bytes intact
        return real_poll(transfer) and time.monotonic() - transfer.posted_at >= SLOW_S

    transport.poll = slow_poll
    try:
        yield prefill, decode, port, (prefill_kv, decode_kv)
    finally:
        decode.close()
        prefill.close()


def run_load(prefill: PrefillWorker, decode: DecodeWorker, port: int, request_id: str) -> tuple[bool, float]:
    prefill.hold(request_id, ((1, 2),), token=f"token-{request_id}", prompt_hash="h")
    j = job(request_id, port)
    t0 = time.monotonic()
    decode.load(j)
    while time.monotonic() < t0 + 30:
        done, failed, _ = decode.results(wait_s=0.01)
        if j.request_id in done or j.request_id in failed:
            return j.request_id in done, time.monotonic() - t0
    raise AssertionError("the load was never reported")


def blocks_equal(buffers) -> bool:
    prefill_kv, decode_kv = buffers
    src, dst = memory_of(prefill_kv), memory_of(decode_kv)
    per_block = src.layers[0].block_stride // 4  # float32 elements of one block of one layer
    for layer in range(2):
        s0 = (src.layers[layer].addr - prefill_kv.data_ptr()) // 4
        d0 = (dst.layers[layer].addr - decode_kv.data_ptr()) // 4
        for sb, db in ((1, 3), (2, 4)):
            a = prefill_kv[s0 + sb * per_block : s0 + (sb + 1) * per_block]
            b = decode_kv[d0 + db * per_block : d0 + (db + 1) * per_block]
            if not torch.equal(a, b):
                return False
    return True


def test_a_load_that_would_miss_a_fixed_deadline_succeeds_within_its_own(workers, caplog):
    prefill, decode, port, buffers = workers
    nbytes = 2 * block_bytes(decode.memory)
    decode.budget.floor_bytes_per_s = nbytes / 2.0  # its bytes add 2 s: 2.5 s in all, against SLOW_S
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        ok, seconds = run_load(prefill, decode, port, "slow-ok")
    assert ok, caplog.text
    assert SLOW_S <= seconds < TIMEOUT_S + 2.0 + 1.0, seconds  # slower than the fixed deadline, within its own
    assert blocks_equal(buffers)
    assert decode.budget.in_flight == 0
    finished, expired = prefill.finished(wait_s=2.0)  # freed by the reader's notification: the claim pinned it
    assert "slow-ok" in finished and expired == 0  # past lease_s (1 s), yet no lease expired under the read


def test_negative_control_the_same_load_under_a_fixed_deadline_fails(workers, caplog):
    prefill, decode, port, _ = workers
    decode.budget.floor_bytes_per_s = 0.0  # no bytes term: a fixed transfer_timeout_s
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        ok, seconds = run_load(prefill, decode, port, "slow-fixed")
    assert not ok
    assert TIMEOUT_S <= seconds < SLOW_S, seconds
    assert "not done after 0.5 s" in caplog.text
    assert decode.budget.in_flight == 0


def test_loads_outstanding_counts_a_load_from_its_queueing_to_its_report(workers):
    """What a kv_both worker's idle step reads to pick which side waits (tests/unit/test_idle_step_wait.py): true
    while a load to report is queued or in flight, false again once it is reported; a release job (nothing to
    report) never counts."""
    prefill, decode, port, _ = workers
    assert not decode.loads_outstanding()
    decode.load(LoadJob("gone", job("gone", port).source, (), (), report=False))
    assert not decode.loads_outstanding(), "a release reports nothing"
    prefill.hold("r", ((1, 2),), token="token-r", prompt_hash="h")
    decode.load(job("r", port))
    assert decode.loads_outstanding()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and decode.loads_outstanding():
        decode.results(wait_s=0.01)
    assert not decode.loads_outstanding(), "reported: no longer outstanding"
