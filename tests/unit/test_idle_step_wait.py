"""On an idle step (nothing scheduled) one side of a worker waits up to `idle_wait_s` for its next event, so that
vLLM's continuous stepping does not burn the cores while loads are pending or blocks are held: the decode side
while it has loads outstanding, else the prefill side. A `kv_both` instance has both sides; its prefill side
holding requests nobody reads (a decode gone, a link down) must still wait (measured in docs/failures.md: a tp2
prefill holding three such requests used 1.7 of 2 cores while its decode side had nothing outstanding)."""

from __future__ import annotations

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.runtime.transfer_stats import TransferStats
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.worker_side import WorkerSide

IDLE_S = 0.005


class FakePrefill:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def finished(self, wait_s: float = 0.0):
        self.waits.append(wait_s)
        return set(), 0

    def lease_counts(self) -> dict[str, int]:
        return {"aborted": 0, "refused": 0}

    def take_phases(self) -> dict:
        return {}


class FakeDecode:
    def __init__(self, outstanding: bool) -> None:
        self.outstanding = outstanding
        self.waits: list[float] = []

    def loads_outstanding(self) -> bool:
        return self.outstanding

    def results(self, wait_s: float = 0.0):
        self.waits.append(wait_s)
        return set(), set(), TransferStats()


def worker(prefill, decode) -> WorkerSide:
    side = WorkerSide.__new__(WorkerSide)
    side.config = BridgeConfig(idle_wait_s=IDLE_S)
    side.prefill, side.decode = prefill, decode
    side.stats = KVBridgeStats()
    side._aborted = side._refused = 0
    return side


@pytest.mark.parametrize(
    ("has_prefill", "outstanding", "prefill_wait", "decode_wait"),
    [
        (True, None, IDLE_S, None),  # kv_producer
        (False, True, None, IDLE_S),  # kv_consumer, loads pending
        (False, False, None, 0.0),  # kv_consumer, nothing pending: returns at once (results would not wait anyway)
        (True, True, 0.0, IDLE_S),  # kv_both, loads pending: the decode side waits, the prefill side does not
        (True, False, IDLE_S, 0.0),  # kv_both, no load pending: the prefill side waits (it returns at once if idle)
    ],
)
def test_one_side_waits_on_an_idle_step(has_prefill, outstanding, prefill_wait, decode_wait):
    prefill = FakePrefill() if has_prefill else None
    decode = FakeDecode(outstanding) if outstanding is not None else None
    side = worker(prefill, decode)
    side.transfer_results(wait=True)
    if prefill is not None:
        assert prefill.waits == [prefill_wait]
    if decode is not None:
        assert decode.waits == [decode_wait]


def test_a_busy_step_never_waits():
    prefill, decode = FakePrefill(), FakeDecode(True)
    worker(prefill, decode).transfer_results(wait=False)
    assert prefill.waits == [0.0] and decode.waits == [0.0]
