"""kvbridge's statistics in vLLM's KVConnectorStats form: what the workers record, merged and reduced."""

import pytest

pytest.importorskip("vllm", reason="needs vLLM")  # only vLLM may be missing: a broken kvbridge import fails

from kvbridge.runtime.transfer_stats import TransferStats
from kvbridge.vllm import stats


def test_worker_stats_merge_and_reduce():
    a, b = stats.KVBridgeStats(), stats.KVBridgeStats()
    a.record(
        TransferStats(transfers=2, bytes=4_000_000, descriptors=8, seconds=[2e-3, 4e-3], post_seconds=[1e-3, 3e-3])
    )
    b.record(TransferStats(transfers=1, failures=1, bytes=2_000_000, seconds=[6e-3], post_seconds=[2e-3]))
    b.record_expired(1)
    a.record_leases(aborted=1, refused=2)
    out = a.aggregate(b).reduce()
    assert out["transfers"] == 3 and out["failures"] == 1 and out["descriptors"] == 8 and out["expired_leases"] == 1
    assert out["aborted_leases"] == 1 and out["refused_messages"] == 2
    assert out["bytes_MB"] == 6.0
    assert out["avg_transfer_ms"] == 4.0 and out["p90_transfer_ms"] == 4.0
    assert out["avg_post_ms"] == 2.0
    assert out["throughput_GBps"] == 0.5
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()
    zeros = (
        "transfers",
        "failures",
        "descriptors",
        "expired_leases",
        "aborted_leases",
        "refused_messages",
        "claim_retries",
    )
    assert a.reduce() == {**dict.fromkeys(zeros, 0), "bytes_MB": 0.0}


def test_load_and_hold_timelines_merge_per_phase():
    a, b = stats.KVBridgeStats(), stats.KVBridgeStats()
    a.record(TransferStats(transfers=1, phases={"claim": [1e-3], "wire": [2e-3], "hop": [3e-3]}, claim_retries=1))
    b.record(TransferStats(transfers=1, phases={"claim": [3e-3], "wire": [4e-3], "hop": [7e-3]}))
    b.record_holds([(1e-3, 2e-3, 3e-3)])
    assert not b.is_empty()
    out = a.aggregate(b).reduce()
    assert out["avg_load_claim_ms"] == 2.0 and out["avg_load_wire_ms"] == 3.0 and out["avg_load_hop_ms"] == 5.0
    assert out["avg_hold_hold_ms"] == 1.0 and out["avg_hold_claim_ms"] == 2.0 and out["avg_hold_release_ms"] == 3.0
    assert out["claim_retries"] == 1
    only_holds = stats.KVBridgeStats()
    only_holds.record_holds([(0.0, 0.0, 1.0)])
    assert not only_holds.is_empty()  # a prefill-only step's timelines are not dropped
