"""A decode worker's unit of work: the job the engine queues, and the load that carries it through both read paths.

`LoadJob` is what the connector hands the decode worker; `Load` is what the worker, the NIXL path
(`nixl_reads`) and the CUDA IPC path (`ipc_reads`) write on it as it goes: its engine, its READs or kernel
events, its sizes and times, and the error once it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.core.errors import RequestParamsError
from kvbridge.core.token_runs import TokenSpan
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.peers import Engine
from kvbridge.transport.nixl_descriptors import Transfer
from kvbridge.wire.params import PrefillDone


@dataclass(frozen=True)
class LoadJob:
    """Read a prefill request's blocks into this engine's: per KV-cache group g, `remote_blocks[g][i]` into
    `local_blocks[g][i]` (`core.groups.pair_lists`; a one-group model has one list on each side). `report` False:
    only tell the prefill side to free (the request is gone here, e.g. aborted before it was scheduled).
    `refused`: fail at once, reading nothing (the scheduler refused the params under kv_load_failure_policy=fail).
    `span`: the prefill's blocks hold `remote_block_size` tokens, not the decode's block size: the span's tokens
    are copied (`core.token_runs`) rather than block pairs (one group only)."""

    request_id: str
    source: PrefillDone | None
    local_blocks: tuple[tuple[int, ...], ...]
    remote_blocks: tuple[tuple[int, ...], ...]
    report: bool = True
    refused: str = ""
    span: TokenSpan | None = None
    remote_block_size: int = 0

    def __post_init__(self) -> None:
        """Only the shape the scheduler side builds (lists of unequal length, which params may bring, fail the load
        when its descriptors are made, as any bad block ids do)."""
        if not all(isinstance(group, tuple) for group in (*self.local_blocks, *self.remote_blocks)):
            raise TypeError("LoadJob block lists hold one tuple of block ids per KV-cache group")
        if len(self.local_blocks) != len(self.remote_blocks):
            raise ValueError(
                f"{len(self.local_blocks)} local and {len(self.remote_blocks)} remote KV-cache groups in one job"
            )
        if self.span is not None and len(self.local_blocks) > 1:
            raise ValueError("a token span is copied for one KV-cache group only")

    @property
    def reads(self) -> bool:
        """Whether this job is read and reported: it has a prefill location, was not refused and is still wanted
        here (otherwise it is refused at once, or only frees the prefill side's blocks)."""
        return self.report and self.source is not None and not self.refused

    @property
    def num_blocks(self) -> int:
        """Local blocks the job writes, over all groups."""
        return sum(map(len, self.local_blocks))

    def one_group(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(remote, local) block lists of a job of at most one group (paths that copy one group only: token spans,
        prepared lists, staging, CUDA IPC); RequestParamsError for several."""
        if len(self.local_blocks) > 1:
            raise RequestParamsError(f"a job of {len(self.local_blocks)} KV-cache groups on a one-group path")
        return (self.remote_blocks[0], self.local_blocks[0]) if self.local_blocks else ((), ())


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
    # Its timeline (monotonic seconds; 0: not reached): queued (the worker learns of it) -> connected (its
    # engine's handshake done) -> claim_sent -> claimed (granted by every worker read, after claim_retries
    # refusals as not held) -> started (its path took it: the transfer thread, or the claiming thread on the CUDA
    # IPC path) -> posted (READs posted or kernels queued; with CMA, READs of host memory copy inside the post) ->
    # landed (its data is in its blocks) -> reported (handed to vLLM). On the CUDA IPC path its block ids are
    # checked from checks_began to checked, in its post. With claims on, its kernels are launched while its claim
    # is on the wire (`launched_in_claim`): its timeline is then queued -> connected -> claim_sent -> started ->
    # posted -> kernels_landed -> landed, the claim answered by `landed`.
    connected: float = 0.0
    claim_sent: float = 0.0
    claimed: float = 0.0
    claim_retries: int = 0
    started: float = 0.0
    checks_began: float = 0.0
    checked: float = 0.0
    launched: float = 0.0
    posted: float = 0.0
    landed: float = 0.0

    def phases(self, now: float) -> str:
        """Where its time went, for the log of a slow or failed load: "handshake 0.01 ms, claim 0.20 ms (0 retries),
        queue 0.01 ms, post 0.10 ms, wire 1.20 ms"."""
        out, last = [], self.queued
        for name, t in self.marks():
            if not t:
                return ", ".join([*out, f"{name} {1000 * (now - last):.2f} ms (not done)"])
            out.append(
                f"{name} {1000 * (t - last):.2f} ms" + (f" ({self.claim_retries} retries)" if name == "claim" else "")
            )
            last = t
        return ", ".join(out)

    def marks(self) -> list[tuple[str, float]]:
        """The end of each phase, in order (a load without a claim has none: its claim phase is empty; with one,
        `handshake` ends once the claim is sent, on every path, so that `claim` never holds the claim's building
        and is never more than `hop`). A CUDA IPC load launched during its claim: handshake, queue, post, wire (its
        kernels), then `claim`: what its claim took beyond its kernels (0 when the claim was answered first)."""
        handshake = self.claim_sent or self.connected  # with the claim built and sent: `claim` is its wait only
        if self.launched_in_claim:
            return [
                ("handshake", handshake),
                ("queue", self.started),
                ("post", self.posted),
                ("wire", self.kernels_landed),
                ("claim", self.landed),
            ]
        claimed = self.claimed or (self.connected if not self.claim_sent else 0.0)
        return [
            ("handshake", handshake),
            ("claim", claimed),
            ("queue", self.started),
            ("post", self.posted),
            ("wire", self.landed),
        ]

    def durations(self, reported: float) -> dict[str, float]:
        """Seconds of each phase of a load that landed, and `hop` (claim sent -> landed: the KV hop) and `total`
        (queued -> reported). A CUDA IPC load also has `checks` (its block ids checked, in its post) and
        `post_launch` (the post after the checks: events, id upload, kernel launches)."""
        out, last = {}, self.queued
        for name, t in self.marks():
            out[name] = max(0.0, t - last)
            last = t
        out["report"] = max(0.0, reported - self.landed)
        out["hop"] = max(0.0, self.landed - (self.claim_sent or self.connected))
        out["total"] = max(0.0, reported - self.queued)
        if self.checked and self.launched:  # the CUDA IPC path
            out["checks"] = max(0.0, self.checked - self.checks_began)
            out["post_launch"] = max(0.0, self.launched - max(self.started, self.checked))
        return out

    # CUDA IPC path: its block ids as checked arrays, the kernels' events (the GPU time is
    # start_event.elapsed_time(event))
    block_arrays: tuple | None = None
    event: Any = None
    start_event: Any = None
    gpu_s: float | None = None  # the kernels' time on the GPU, once they finished (None: unknown)
    # A load whose kernels went out while its claim was on the wire: reported once both are done
    # (`IpcReads.claim_done`); its kernels finished at `kernels_landed`, its claim was answered by `landed`.
    launched_in_claim: bool = False
    claim_open: bool = False
    kernels_done: bool = False
    kernels_landed: float = 0.0
    error: str = ""  # set once it failed; it is reported when nothing can still write its blocks
    unfinished: frozenset[str] = frozenset()  # NIXL agents whose READs of it were still running when it failed
