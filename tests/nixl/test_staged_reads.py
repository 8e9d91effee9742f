"""The staged NIXL path between real processes: byte-exact loads through the staging buffers, slots given back.

The prefill worker gathers each reader's scattered runs into its registered staging buffer, the decode worker READs
the chunks and scatters them (`runtime.staging`, `runtime.staged_reads`); every decode worker checks every byte
against the seeded reference and that no byte outside the request's blocks was written, and every prefill worker
frees the request once (by the readers' notifications, which ride on the last chunk's READ) with every staging slot
back in its pool.
"""

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.topology import KVGeometry, ParallelLayout
from kvbridge.testing.transfer_scenario import Scenario, release_problems, run_transfer

pytestmark = pytest.mark.usefixtures("transfers_forked")  # worker processes from support.fork_server

STAGED = BridgeConfig(
    lease_s=30.0,
    handshake_timeout_s=5.0,
    transfer_timeout_s=60.0,
    nixl_staging_bytes=1 << 20,
    nixl_staging_chunk_bytes=1 << 16,  # small chunks: a request takes several, so the pipeline and slot reuse run
    nixl_staging="always",
)


def scenario(prefill: str, decode: str, heads: int = 4, **kw) -> Scenario:
    return Scenario(
        ParallelLayout.parse(prefill),
        ParallelLayout.parse(decode),
        KVGeometry(num_layers=4, num_kv_heads=heads, head_size=32, dtype="float32", block_size=16),
        num_blocks=64,
        request_blocks=21,
        seed=7,
        config=kw.pop("config", STAGED),
        **kw,
    )


@pytest.mark.nixl
@pytest.mark.parametrize(
    ("prefill", "decode", "heads"),
    [
        ("pp=2,tp=1", "pp=1,tp=2", 4),
        pytest.param("pp=1,tp=1", "pp=1,tp=1", 4, marks=pytest.mark.matrix),
        pytest.param("pp=1,tp=4", "pp=1,tp=1", 4, marks=pytest.mark.matrix),
    ],
)
def test_staged_loads_are_byte_exact(prefill, decode, heads):
    s = scenario(prefill, decode, heads)
    result = run_transfer(s, timeout_s=90)
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"], worker
        assert worker["exact"] and worker["untouched_clean"], worker
        assert worker["staged_parts"] >= 1, worker  # it did go through staging
    assert release_problems(s, result) == []
    for report in result["prefill"]:
        staging = report["staging"]
        assert staging["sessions"] == 0 and staging["free_slots"] == staging["num_slots"], report
        assert staging["buffer_bytes"] == 1 << 20, report


@pytest.mark.nixl
def test_loads_beyond_the_slots_read_directly_and_stay_exact():
    """Each side has room for one staged part at a time (two slots) while two decode workers keep two loads each in
    flight: the parts that find no slot (here or on the prefill side, "busy") are read directly. Every load is still
    exact, every request freed once, every slot back."""
    tight = BridgeConfig(
        lease_s=30.0,
        handshake_timeout_s=5.0,
        transfer_timeout_s=60.0,
        nixl_staging_bytes=2 << 16,
        nixl_staging_chunk_bytes=1 << 16,
        nixl_staging="always",
    )
    s = scenario("pp=1,tp=1", "pp=1,tp=2", config=tight, repeats=4, concurrent=2)
    result = run_transfer(s, timeout_s=120)
    for worker in result["decode"]:
        assert worker["ok"] and not worker["failed"] and worker["exact"] and worker["untouched_clean"], worker
        assert len(worker["transfer_times_s"]) == 4
    assert release_problems(s, result) == []
    staging = result["prefill"][0]["staging"]
    assert staging["sessions"] == 0 and staging["free_slots"] == staging["num_slots"] == 2, staging
    print("staged parts, fallbacks:", [(w["staged_parts"], w["staged_fallbacks"]) for w in result["decode"]])
