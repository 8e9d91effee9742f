"""What a decode worker reports about its loads: `TransferStats` (counters since the last `results()` call) and
`PHASES`, the names of a load's timeline in it."""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("handshake", "claim", "queue", "post", "wire", "report", "hop", "total")
"""A load's timeline in `TransferStats.phases` (`Load.durations`): queued -> handshake done and claim sent ->
claim granted -> taken by its path (queue) -> READs posted or kernels queued (post: the host's work) -> data
landed (wire) -> reported to vLLM; `hop` is claim sent -> data landed, `total` queued -> reported. A CUDA IPC
load also has `checks` (its block ids checked, in its post) and `post_launch` (the post after the checks: events,
id upload, kernel launches); one launched while its claim was on the wire has `claim` last: what the claim took
beyond its kernels (`Load.marks`)."""


@dataclass
class TransferStats:
    """Counters since the last `results()` call."""

    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    descriptors: int = 0
    seconds: list[float] = field(default_factory=list)  # per load: from the job to the reported completion
    post_seconds: list[float] = field(default_factory=list)  # per load: from the job to the READs posted/kernels queued
    gpu_seconds: list[float] = field(default_factory=list)  # per CUDA IPC load: the kernels' time on the GPU
    phases: dict[str, list[float]] = field(default_factory=dict)  # per load that landed: seconds by PHASES name
    claim_retries: int = 0  # claims answered as not held (at once, or once their wait passed) and sent again
