"""Whole transfers between real worker processes: side-channel handshakes, NIXL READs, notifications.

One process per worker on both sides; every decode worker checks every byte it holds against the seeded
reference, bytes of other blocks stay untouched, and every prefill worker (read or not) is released.
"""

import pytest

from kvbridge.core.topology import KVGeometry, ParallelLayout
from kvbridge.testing.transfer_scenario import Scenario, run_transfer

PAIRS = [
    ("pp=2,tp=1", "pp=1,tp=2", 4),  # the pair vLLM's NixlConnector fails on
    ("pp=1,tp=2", "pp=2,tp=1", 4),  # decode-side PP
    ("pp=2,tp=1", "pp=2,tp=1", 4),  # PP on both sides
    ("pp=1,tp=1", "pp=2,tp=2", 4),
    ("pp=1,tp=4", "pp=1,tp=1", 2),  # replicated heads on the prefill side: two workers are not read
]


@pytest.mark.nixl
@pytest.mark.parametrize(("prefill", "decode", "heads"), PAIRS)
def test_request_moves_exactly(prefill, decode, heads):
    scenario = Scenario(
        ParallelLayout.parse(prefill),
        ParallelLayout.parse(decode),
        KVGeometry(num_layers=4, num_kv_heads=heads, head_size=32, dtype="float32", block_size=16),
        num_blocks=48,
        request_blocks=9,
        seed=hash((prefill, decode)) % 1000,
    )
    result = run_transfer(scenario, timeout_s=90)
    assert len(result["decode"]) == scenario.decode.workers_per_engine
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"], worker
        assert worker["exact"], f"{worker['decode_worker']} holds wrong bytes"
        assert worker["untouched_clean"], f"{worker['decode_worker']} wrote outside the request's blocks"
    released = {rank: ids for rank, ids, expired, _ in result["prefill_released"]}
    assert set(released) == {str(w) for w in scenario.prefill.workers()}
    assert all(ids == ["prefill-req-0"] for ids in released.values())
    # Freed because every reader said so (a READ's notification or the side channel), not at lease expiry.
    assert all(expired == 0 for _, _, expired, _ in result["prefill_released"]), result["prefill_released"]


def test_each_worker_may_have_its_own_device():
    s = pp2_to_tp2(prefill_device="cuda:0,cuda:1", decode_device="cuda:2,cuda:3")
    assert [s.device("prefill", r) for r in s.prefill.workers()] == ["cuda:0", "cuda:1"]
    assert [s.device("decode", r) for r in s.decode.workers()] == ["cuda:2", "cuda:3"]
    one = pp2_to_tp2(prefill_device="cuda:0", decode_device="cuda:1")  # one device: every worker on it
    assert {one.device("prefill", r) for r in one.prefill.workers()} == {"cuda:0"}
    assert {one.device("decode", r) for r in one.decode.workers()} == {"cuda:1"}


def pp2_to_tp2(**kw) -> Scenario:
    return Scenario(
        ParallelLayout.parse("pp=2,tp=1"),
        ParallelLayout.parse("pp=1,tp=2"),
        KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32", block_size=16),
        num_blocks=48,
        request_blocks=9,
        **kw,
    )


@pytest.mark.nixl
@pytest.mark.parametrize("concurrent", [1, 3])
def test_per_layer_allocations_and_several_requests(concurrent):
    """KV in one allocation per layer (as vLLM allocates on GPU: a region each), four requests one after another
    or up to three in flight at once, each claimed before it is read (verify_requests, the default)."""
    scenario = pp2_to_tp2(seed=5, repeats=4, layer_tensors=True, concurrent=concurrent)
    result = run_transfer(scenario, timeout_s=90)
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"] and worker["exact"] and worker["untouched_clean"], worker
        assert len(worker["transfer_times_s"]) == 4
    want = [f"prefill-req-{i}" for i in range(4)]
    assert sorted((rank, ids, expired) for rank, ids, expired, _ in result["prefill_released"]) == [
        (str(w), want, 0) for w in scenario.prefill.workers()
    ]


@pytest.mark.nixl
def test_a_refused_claim_fails_the_load_and_reads_nothing():
    """The prefill side no longer holds the request (freed, expired): every decode worker's claim is refused, the
    load fails (vLLM then recomputes) and no byte of the request's blocks is written."""
    scenario = pp2_to_tp2(held=False)
    result = run_transfer(scenario, timeout_s=60)
    assert len(result["decode"]) == 2
    for worker in result["decode"]:
        assert worker["failed"] and not worker["ok"], worker
        assert not worker["request_blocks_written"] and worker["untouched_clean"], worker
    assert result["prefill_released"] == []
