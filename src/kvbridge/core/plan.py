"""Which decode worker reads which (layers, KV heads) from which prefill worker.

A plan depends only on the two layouts and the geometry, never on a request, so both sides compute the
same plan on their own: the decode side to post reads, the prefill side to know how many readers will
notify it (possibly none, for a replica nobody reads from).

Rules (checked by the property tests):
- every (layer, KV head) a decode worker holds is read exactly once, from a prefill worker that holds it;
- when the prefill side replicates a head (tp > KV heads), the decode workers needing it are spread over
  the replicas rather than piled on the first one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank


@dataclass(frozen=True)
class Read:
    """One decode worker reads `layers` x `kv_heads` (global ids, end exclusive) from one prefill worker."""

    decode_worker: WorkerRank
    prefill_worker: WorkerRank
    layers: tuple[int, ...]
    kv_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


@dataclass(frozen=True)
class TransferPlan:
    prefill: ParallelLayout
    decode: ParallelLayout
    geometry: KVGeometry
    reads: tuple[Read, ...]

    def reads_of(self, decode_worker: WorkerRank) -> tuple[Read, ...]:
        """What one decode worker reads, prefill stage-major."""
        return tuple(r for r in self.reads if r.decode_worker == decode_worker)

    def readers_of(self, prefill_worker: WorkerRank) -> tuple[WorkerRank, ...]:
        """Decode workers that read from `prefill_worker` (each notifies it once per request)."""
        return tuple(sorted({r.decode_worker for r in self.reads if r.prefill_worker == prefill_worker}))

    def peers_of(self, decode_worker: WorkerRank) -> tuple[WorkerRank, ...]:
        """Prefill workers that `decode_worker` reads from."""
        return tuple(sorted({r.prefill_worker for r in self.reads_of(decode_worker)}))

    def __iter__(self) -> Iterator[Read]:
        return iter(self.reads)


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def make_plan(prefill: ParallelLayout, decode: ParallelLayout, geometry: KVGeometry) -> TransferPlan:
    """The plan for every decode worker of one decode engine reading from one prefill engine."""
    prefill.check(geometry)
    decode.check(geometry)
    num_layers, num_heads = geometry.num_layers, geometry.num_kv_heads
    decode_replicas = decode.head_replicas(num_heads)
    reads: list[Read] = []
    for dw in decode.workers():
        layers_d = decode.stage_layers(num_layers, dw.pp)
        heads_d = decode.kv_heads(num_heads, dw.tp)
        # Which copy of a replicated prefill head this worker takes: decode replicas of one head take
        # different prefill replicas, and so do different decode stages.
        spread = dw.tp % decode_replicas + dw.pp
        for stage in range(prefill.pp):
            layers = _intersect(layers_d, prefill.stage_layers(num_layers, stage))
            if not layers:
                continue
            runs: list[tuple[int, int, int]] = []  # (prefill tp rank, first head, end head)
            for head in heads_d:
                holders = prefill.holders_of_head(num_heads, head)
                rank = holders[spread % len(holders)]
                if runs and runs[-1][0] == rank and runs[-1][2] == head:
                    runs[-1] = (rank, runs[-1][1], head + 1)
                else:
                    runs.append((rank, head, head + 1))
            for rank, first, end in runs:
                reads.append(Read(dw, WorkerRank(stage, rank), tuple(layers), (first, end)))
    return TransferPlan(prefill, decode, geometry, tuple(reads))
