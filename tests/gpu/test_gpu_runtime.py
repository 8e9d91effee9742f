"""The worker runtimes on GPUs, CUDA IPC path: real processes, NIXL agents, side channel, the Triton kernel.

Prefill on cuda:0, decode on cuda:1, or both on cuda:0 with one GPU (two processes still share the memory through
CUDA IPC). Skipped without a CUDA GPU (CI has none); run on the device machine with the command in
docs/benchmarks/device-runs.md. The same scenarios run on CPU through NIXL in test_transfer_processes.py.
"""

from dataclasses import replace

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.topology import KVGeometry, ParallelLayout
from kvbridge.testing.transfer_scenario import Scenario, release_problems, run_transfer

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU"),
]
DECODE_DEVICE = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"

GEOMETRY = KVGeometry(num_layers=6, num_kv_heads=4, head_size=64, dtype="float32", block_size=16)


def scenario(prefill: str, decode: str, **kw) -> Scenario:
    return Scenario(
        ParallelLayout.parse(prefill),
        ParallelLayout.parse(decode),
        GEOMETRY,
        num_blocks=64,
        request_blocks=20,
        seed=3,
        prefill_device="cuda:0",
        decode_device=DECODE_DEVICE,
        config=BridgeConfig(lease_s=30.0, transfer_timeout_s=30.0),
        layer_tensors=True,
        **kw,
    )


def assert_loaded_and_released(s: Scenario, result: dict) -> None:
    """Every decode worker loaded every request exactly through CUDA IPC, and every prefill worker freed every
    request because its readers said so (none at lease expiry)."""
    for worker in result["decode"]:
        assert worker["path"] == "cuda-ipc", worker
        assert worker["ok"] and worker["exact"] and worker["untouched_clean"], worker
        assert len(worker["gpu_times_s"]) == s.repeats
    assert release_problems(s, result) == []


@pytest.mark.parametrize(("prefill", "decode"), [("pp=2", "tp=2"), ("tp=2", "pp=2"), ("pp=1", "pp=1")])
def test_cuda_ipc_loads_are_exact_and_release_every_prefill_worker(prefill, decode):
    s = scenario(prefill, decode, repeats=3)
    assert_loaded_and_released(s, run_transfer(s, timeout_s=120))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_workers_spread_over_gpus_read_each_other_through_ipc():
    """One GPU per worker, crossed (prefill pp0 on cuda:0 and pp1 on cuda:1, decode tp0 on cuda:1 and tp1 on
    cuda:0): every decode worker reads one peer on its own GPU and one over NVLink."""
    s = replace(scenario("pp=2", "tp=2", repeats=2), prefill_device="cuda:0,cuda:1", decode_device="cuda:1,cuda:0")
    assert_loaded_and_released(s, run_transfer(s, timeout_s=120))


def test_concurrent_ipc_loads_are_exact_and_release_every_prefill_worker():
    """Three loads in flight at once per decode worker (kernels queued behind each other, claims meanwhile)."""
    s = scenario("pp=2", "tp=2", repeats=7, concurrent=3)
    assert_loaded_and_released(s, run_transfer(s, timeout_s=120))


def test_a_refused_claim_fails_the_ipc_load_and_frees_the_prefill_request():
    """The claim (another prompt's hash) is refused while the load's kernels run: the load fails once they are
    done, the decode's other blocks are untouched, and the decode side's abort frees the request on every prefill
    worker at once."""
    s = scenario("pp=2", "tp=2", wrong="prompt_hash")
    result = run_transfer(s, timeout_s=120)
    for worker in result["decode"]:
        assert worker["path"] == "cuda-ipc", worker
        assert worker["failed"] and not worker["ok"], worker
        assert worker["untouched_clean"], worker
    assert release_problems(s, result, by="abort") == []


STAGED_VRAM = BridgeConfig(
    lease_s=30.0,
    transfer_timeout_s=60.0,
    gpu_peer_copy="nixl",  # NIXL even on one host: the staged path is NIXL's
    nixl_staging_bytes=1 << 20,
    nixl_staging_chunk_bytes=1 << 16,  # a request takes several chunks: the pipeline and slot reuse run
    nixl_staging="always",
)


@pytest.mark.parametrize(("prefill", "decode"), [("pp=1", "pp=1"), ("pp=2", "tp=2"), ("tp=2", "tp=1")])
def test_staged_nixl_loads_in_gpu_memory_are_exact_and_give_every_slot_back(prefill, decode):
    """The staged NIXL path with KV in GPU memory: each prefill worker gathers on its GPU into its VRAM staging
    buffer (`transport.device_copy`), each decode worker READs the chunks into its own and scatters them on its GPU.
    Every byte checked, every request freed by its readers' notifications, every staging slot back."""
    s = replace(scenario(prefill, decode, repeats=2), config=STAGED_VRAM)
    result = run_transfer(s, timeout_s=180)
    for worker in result["decode"]:
        assert worker["path"] == "nixl", worker
        assert worker["ok"] and not worker["failed"], worker
        assert worker["exact"] and worker["untouched_clean"], worker
        assert worker["staged_parts"] >= 1 and worker["staged_fallbacks"] == 0, worker
    assert release_problems(s, result) == []
    for report in result["prefill"]:
        staging = report["staging"]
        assert staging["gathered_bytes"] > 0, report
        assert staging["sessions"] == 0 and staging["free_slots"] == staging["num_slots"], report


@pytest.mark.timeout(90)
def test_a_flush_read_from_gpu_memory_completes_and_writes_no_kv():
    """The fence's flush READ (`NixlTransport.post_flush`, before a failed load's blocks go back or an endpoint
    closes) from a peer's GPU memory into the reader's host scratch buffer: it completes, reads the peer's bytes
    and writes none of the reader's GPU memory."""
    import os
    import time

    from kvbridge.core.memory import Region, WorkerMemory
    from kvbridge.transport.backoff import Backoff
    from kvbridge.transport.nixl import FLUSH_BYTES, NixlTransport
    from kvbridge.transport.nixl_config import TransportConfig

    src = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros((1 << 20,), dtype=torch.uint8, device=DECODE_DEVICE)

    def memory(t):
        return WorkerMemory(regions=(Region(t.data_ptr(), t.numel(), t.device.index),), layers=())

    config = TransportConfig(ucx_tls=None)
    with (
        NixlTransport(f"flush-gpu-p-{os.getpid()}", config) as p,
        NixlTransport(f"flush-gpu-d-{os.getpid()}", config) as d,
    ):
        p.register(memory(src), "VRAM")
        d.register(memory(dst), "VRAM")
        name = d.add_peer(p.agent_metadata())
        flush = d.post_flush(name, memory(src).regions[0], "VRAM")
        backoff, deadline = Backoff(), time.monotonic() + 30
        while not d.poll(flush):
            p.notifications()
            assert time.monotonic() < deadline, "the flush READ from GPU memory never completed"
            backoff.sleep()
        d.release(flush)
        torch.cuda.synchronize()
        assert bytes(d._scratch[:FLUSH_BYTES]) == b"\x07" * FLUSH_BYTES
        assert int(dst.count_nonzero()) == 0
