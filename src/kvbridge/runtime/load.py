"""A decode worker's unit of work: the job the engine queues, and the load that carries it through both read paths.

`LoadJob` is what the connector hands the decode worker; `Load` is what the worker, the NIXL path
(`nixl_reads`) and the CUDA IPC path (`ipc_reads`) write on it as it goes: its engine, its READs or kernel
events, its sizes and times, and the error once it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.core.token_runs import TokenSpan
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.peers import Engine
from kvbridge.transport.nixl import Transfer
from kvbridge.wire.params import PrefillDone


@dataclass(frozen=True)
class LoadJob:
    """Read `remote_blocks` of a prefill request into `local_blocks`. `report` False: only tell the prefill side
    to free (the request is gone here, e.g. aborted before it was scheduled). `refused`: fail at once, reading
    nothing (the scheduler refused the params under kv_load_failure_policy=fail). `span`: the prefill's blocks
    hold `remote_block_size` tokens, not the decode's block size: the span's tokens are copied (`core.token_runs`)
    rather than block pairs."""

    request_id: str
    source: PrefillDone | None
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    report: bool = True
    refused: str = ""
    span: TokenSpan | None = None
    remote_block_size: int = 0


@dataclass
class Load:
    """One job on its way: what it holds at each step."""

    job: LoadJob
    queued: float
    deadline: float
    engine: Engine | None = None
    begun: bool = False  # counted in engine.inflight (reached the transfer thread)
    transfers: list[Transfer] = field(default_factory=list)
    staged: list[Any] = field(default_factory=list)  # staged_reads.StagedPart: parts read through staging
    read_ranks: tuple[WorkerRank, ...] = ()
    nbytes: int = 0
    descriptors: int = 0
    connected: float = 0.0  # its engine's handshake done (monotonic)
    claimed: float = 0.0  # its claim acknowledged by every worker read
    posted: float = 0.0

    def phases(self, now: float) -> str:
        """Where its time went, for the log of a slow or failed load: "handshake 0.01 s, claim 0.00 s, read 1.2 s"."""
        marks = [("handshake", self.connected), ("claim", self.claimed), ("queue", self.posted), ("read", now)]
        out, last = [], self.queued
        for name, t in marks:
            if not t:
                return ", ".join([*out, f"{name} {now - last:.2f} s (not done)"])
            out.append(f"{name} {t - last:.2f} s")
            last = t
        return ", ".join(out)

    # CUDA IPC path: the kernels' events (the GPU time is start_event.elapsed_time(event))
    event: Any = None
    start_event: Any = None
    error: str = ""  # set once it failed; it is reported when nothing can still write its blocks
