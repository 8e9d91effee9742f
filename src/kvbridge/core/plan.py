"""Which decode worker reads which (layers, KV heads) from which prefill worker.

A plan depends only on the two layouts and the geometry, never on a request, so both sides compute the
same plan on their own: the decode side to post reads, the prefill side to know how many readers will
notify it (possibly none, for a replica nobody reads from).

Rules (checked by the property tests):
- every (layer, KV head) a decode worker holds is read exactly once, from a prefill worker that holds it;
- when the prefill side replicates a head (tp > KV heads), the decode workers needing it are spread over
  the replicas rather than piled on the first one;
- when a head has fewer decode readers than prefill replicas (MLA's one latent head held by every prefill TP
  rank, read by a decode TP of 1), each reader's layers are cut into parts read from different replicas, so
  every replica serves an equal share of the layers (±1) and no (layer, block) is read twice.
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


def _sources(
    holders: range, reader: int, readers: int, pp: int, stage: range, layers: range
) -> list[tuple[int, range]]:
    """(prefill tp rank, layers) to read one head's `layers` (within prefill stage `stage`) from.

    `reader` is this decode worker's index among the `readers` decode TP ranks holding the head. With at least as
    many readers as `holders`, each reader takes one holder, rotated by decode stage; with fewer, the stage's
    layers taken reader by reader (reader r's layer i is unit r * len(stage) + i) are cut into len(holders)
    equal parts, part k read from holders[k]: two readers of one layer are len(stage) units apart, more than a
    part, so they use different holders.
    """
    if readers >= len(holders):
        return [(holders[(reader + pp) % len(holders)], layers)]
    total = readers * len(stage)
    out: list[tuple[int, range]] = []
    for layer in layers:
        part = (reader * len(stage) + layer - stage.start) * len(holders) // total
        rank = holders[part]
        if out and out[-1][0] == rank:
            out[-1] = (rank, range(out[-1][1].start, layer + 1))
        else:
            out.append((rank, range(layer, layer + 1)))
    return out


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
        reader = dw.tp % decode_replicas
        for stage in range(prefill.pp):
            stage_layers = prefill.stage_layers(num_layers, stage)
            layers = _intersect(layers_d, stage_layers)
            if not layers:
                continue
            runs: list[tuple[int, range, int, int]] = []  # (prefill tp rank, layers, first head, end head)
            for head in heads_d:
                holders = prefill.holders_of_head(num_heads, head)
                for rank, part in _sources(holders, reader, decode_replicas, dw.pp, stage_layers, layers):
                    last = runs[-1] if runs else None
                    if last is not None and last[0] == rank and last[1] == part and last[3] == head:
                        runs[-1] = (rank, part, last[2], head + 1)
                    else:
                        runs.append((rank, part, head, head + 1))
            for rank, part, first, end in runs:
                reads.append(Read(dw, WorkerRank(stage, rank), tuple(part), (first, end)))
    return TransferPlan(prefill, decode, geometry, tuple(reads))
