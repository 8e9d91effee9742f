"""Whole transfers between real worker processes: side-channel handshakes, NIXL READs, notifications.

One process per worker on both sides; every decode worker checks every byte it holds against the seeded
reference, bytes of other blocks stay untouched, and every prefill worker (read or not) frees every request it
held exactly once, the way the scenario expects (`release_problems`). Requests carry a token and a prompt hash.
"""

import copy
import zlib

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.topology import KVGeometry, ParallelLayout
from kvbridge.testing.transfer_scenario import Scenario, release_problems, run_transfer

pytestmark = pytest.mark.usefixtures("transfers_forked")  # worker processes from support.fork_server


def seed_of(*names: str) -> int:
    """A seed per parameter set, the same on every run (str hash() changes with PYTHONHASHSEED)."""
    return zlib.crc32(" -> ".join(names).encode()) % 1000


MATRIX = pytest.mark.matrix  # more layout pairs of a check whose headline pair make test runs (make e2e runs these)
PAIRS = [
    ("pp=2,tp=1", "pp=1,tp=2", 4),  # the pair vLLM's NixlConnector fails on
    pytest.param("pp=1,tp=2", "pp=2,tp=1", 4, marks=MATRIX),  # decode-side PP
    pytest.param("pp=2,tp=1", "pp=2,tp=1", 4, marks=MATRIX),  # PP on both sides
    pytest.param("pp=1,tp=1", "pp=2,tp=2", 4, marks=MATRIX),
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
        seed=seed_of(prefill, decode),
    )
    result = run_transfer(scenario, timeout_s=90)
    assert len(result["decode"]) == scenario.decode.workers_per_engine
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"], worker
        assert worker["exact"], f"{worker['decode_worker']} holds wrong bytes"
        assert worker["untouched_clean"], f"{worker['decode_worker']} wrote outside the request's blocks"
    # Every prefill worker, read or not, freed the request once because every reader said so (a READ's
    # notification or the side channel), not at lease expiry.
    assert release_problems(scenario, result) == []


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
@pytest.mark.parametrize("concurrent", [pytest.param(1, marks=MATRIX), 3])
def test_per_layer_allocations_and_several_requests(concurrent):
    """KV in one allocation per layer (as vLLM allocates on GPU: a region each), four requests one after another
    or up to three in flight at once, each claimed before it is read (verify_requests, the default)."""
    scenario = pp2_to_tp2(seed=5, repeats=4, layer_tensors=True, concurrent=concurrent)
    result = run_transfer(scenario, timeout_s=90)
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"] and worker["exact"] and worker["untouched_clean"], worker
        assert len(worker["transfer_times_s"]) == 4
    assert release_problems(scenario, result) == []


@pytest.mark.nixl
def test_the_release_check_notices_a_request_never_freed():
    """Negative control: the prefill workers also hold a request that nobody loads, and its lease (30 s) outlasts
    the wait: `release_problems` must name it on every prefill worker, while the loaded request was freed. The
    same real result with a release removed, or repeated, must be caught too."""
    scenario = pp2_to_tp2(seed=11, unread=1)
    result = run_transfer(scenario, timeout_s=60, release_wait_s=2.0)
    for worker in result["decode"]:
        assert worker["ok"] and worker["exact"], worker
    assert [r["released"] for r in result["prefill"]] == [["prefill-req-0"]] * 2
    problems = release_problems(scenario, result)
    for rank in ("pp0/tp0", "pp1/tp0"):
        assert f"prefill worker {rank}: never freed: ['prefill-unread-0']" in problems, problems

    missing = copy.deepcopy(result)  # the same real result, the loaded request's release lost on one worker
    missing["prefill"][1]["released"] = []
    want = "prefill worker pp1/tp0: never freed: ['prefill-req-0', 'prefill-unread-0']"
    assert want in release_problems(scenario, missing)
    twice = copy.deepcopy(result)  # or reported twice
    twice["prefill"][0]["released"] *= 2
    assert "prefill worker pp0/tp0: freed more than once: ['prefill-req-0']" in release_problems(scenario, twice)


# A claim the prefill can only answer as not held (nothing held, or a wrong token) is retried for claim_window_s
# (10 s by default) before the load fails: 1 s here, the refusal being the same however long it is retried.
REFUSED = BridgeConfig(lease_s=30.0, handshake_timeout_s=5.0, transfer_timeout_s=60.0, claim_window_s=1.0)
SHORT_LEASE = BridgeConfig(lease_s=4.0, handshake_timeout_s=5.0, transfer_timeout_s=30.0, claim_window_s=1.0)
REFUSALS = {
    # case: (what the prefill holds / the decode side brings, how the prefill frees the request)
    # - unheld: nothing held (it was freed, or expired): nothing to free
    # - prompt_hash: held, but the params name another prompt: the reader's abort (right token) frees it at once
    # - token: held, but the params carry another token: the abort is refused too, only the lease frees it
    "unheld": ({"held": False, "config": REFUSED}, None),
    "prompt_hash": ({"wrong": "prompt_hash", "config": REFUSED}, "abort"),
    "token": ({"wrong": "token", "config": SHORT_LEASE}, "expiry"),
}


@pytest.mark.nixl
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_claim_fails_the_load_and_reads_nothing(case):
    """Every decode worker's claim is refused, the load fails (vLLM then recomputes) and no byte of the request's
    blocks is written. A held request is still freed exactly once: at once by the reader's abort when the token
    is right, else only when its lease expires (nobody without the token can free it)."""
    kw, by = REFUSALS[case]
    scenario = pp2_to_tp2(**kw)
    result = run_transfer(scenario, timeout_s=60)
    assert len(result["decode"]) == 2
    for worker in result["decode"]:
        assert worker["failed"] and not worker["ok"], worker
        assert not worker["request_blocks_written"] and worker["untouched_clean"], worker
    assert release_problems(scenario, result, by=by or "notification") == []
    assert len(result["prefill"]) == 2
    for report in result["prefill"]:
        assert report["released"] == ([] if by is None else ["prefill-req-0"]), report
        if by == "expiry":  # the claims and the aborts (no token) reached it and were refused
            assert report["counts"]["refused"] >= 2 * scenario.decode.workers_per_engine, report
        elif by is None:  # the claims were refused; an abort of a request not held is kept for a hold to come
            assert report["counts"]["refused"] >= scenario.decode.workers_per_engine, report
