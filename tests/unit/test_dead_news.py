"""How a decode instance's workers learn together that a prefill engine is gone or unreachable: each worker's
news (`KVBridgeWorkerMetadata`, aggregated by vLLM over the workers) reaches the scheduler-side connector, which
puts it in the next step's metadata for every worker (`KVBridgeMetadata.dead`)."""

from __future__ import annotations

from types import SimpleNamespace

from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMetadata

A = ("engine-a", "10.0.0.1", 5600, 0)
B = ("engine-b", "10.0.0.2", 5600, 0)


def test_the_workers_news_aggregates_over_workers():
    one, two = KVBridgeWorkerMetadata({A: "unreachable"}), KVBridgeWorkerMetadata({B: "gone"})
    assert one.aggregate(two).dead == {A: "unreachable", B: "gone"}
    assert one.aggregate(object()).dead == {A: "unreachable"}  # another connector's: not ours to merge


class FakeScheduler:
    def __init__(self) -> None:
        self._meta = KVBridgeMetadata()

    def tell_workers_dead(self, dead: dict) -> None:
        self._meta.dead.update(dead)

    def build_connector_meta(self) -> KVBridgeMetadata:
        meta, self._meta = self._meta, KVBridgeMetadata()
        return meta


def test_the_scheduler_passes_the_news_to_every_worker_once():
    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    connector._scheduler, connector._worker = FakeScheduler(), None
    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVBridgeWorkerMetadata({A: "x"})))
    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))  # a step without news
    step = SimpleNamespace(total_num_scheduled_tokens=0)
    assert connector.build_connector_meta(step).dead == {A: "x"}
    assert connector.build_connector_meta(step).dead == {}, "told once"


def test_a_worker_sends_news_only_when_it_has_some():
    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    news = [{A: "unreachable"}, {}]
    connector._scheduler, connector._worker = None, SimpleNamespace(take_dead_news=lambda: news.pop(0))
    assert connector.build_connector_worker_meta().dead == {A: "unreachable"}
    assert connector.build_connector_worker_meta() is None
