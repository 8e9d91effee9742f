"""A staged READ released unfinished: its slots are reused only after a flush READ from the same agent is done.

NIXL's release does not stop UCX's GET (bench/ucx_cut_stress.py: READs released unfinished were written after their
release once the link was back), so a staging slot given back at once could receive the old READ's bytes while it
holds another part's chunk, and scatter them into that part's KV blocks. A unit test of `StagedReads._poll` with a
recording fake transport; the oracle: no slot back in the free list before a flush READ was posted and done. A
variant without the fence (the code before) is caught.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import Descriptors
from kvbridge.core.errors import KVBridgeError
from kvbridge.core.memory import Region
from kvbridge.runtime.nixl_reader import NixlReader
from kvbridge.runtime.staged_reads import StagedReads
from kvbridge.transport.nixl_descriptors import Transfer

AGENT = "prefill-tp0"


class Fake:
    """The READ never ends; a flush READ ends after `flush_polls` polls (never, if None). `events` in order."""

    def __init__(self, flush_polls: int | None) -> None:
        self.events: list[str] = []
        self.peers = {AGENT}
        self.flush_polls = flush_polls
        self.polls = 0

    def read(self, agent, descs, local, remote, note) -> Transfer:
        self.events.append("read")
        return Transfer(agent, descs.nbytes, 1, note, time.monotonic())

    def post_flush(self, agent, region, mem_type="DRAM") -> Transfer:
        self.events.append("flush")
        return Transfer(agent, 64, 1, b"", time.monotonic())

    def poll(self, transfer: Transfer) -> bool:
        if transfer.nbytes != 64:
            return False  # the cut link: the READ never ends
        self.polls += 1
        if self.flush_polls is not None and self.polls >= self.flush_polls:
            transfer.state = "DONE"
            self.events.append("flush-done")
            return True
        return False

    def release(self, transfer: Transfer) -> None:
        transfer.state = "RELEASED"
        self.events.append("released-flush" if transfer.nbytes == 64 else "released-read")


def staged(fake: Fake, timeout_s: float = 5.0) -> StagedReads:
    reads = StagedReads.__new__(StagedReads)
    reads.config = BridgeConfig(transfer_timeout_s=timeout_s)
    reads.identity = "decode"
    reads.reader = NixlReader(fake, "decode", "DRAM")
    reads._lock = threading.Lock()
    reads._free, reads.retired = [], []
    return reads


def cut_part(reads: StagedReads) -> SimpleNamespace:
    """A part with two slots whose READ is stopped (cancelled) while the link is cut; returns the part."""
    peer = SimpleNamespace(agent=AGENT, memory=SimpleNamespace(regions=[Region(0x1000, 1 << 20)]))
    part = SimpleNamespace(
        peer=peer, rank=0, load=SimpleNamespace(deadline=time.monotonic() + 60), cancelled=True, reads=0
    )
    part.slots, part.unfenced = [0, 1], False
    descs = Descriptors(*(np.array([v], dtype=np.int64) for v in (0x1000, 0x2000, 4096, 0, 0)))
    try:
        reads._poll(part, descs, (), (), b"")
    except KVBridgeError:
        pass
    else:
        raise AssertionError("a cancelled READ must fail its part")
    reads._give_back(part)
    return part


def slots_back_before_flush(fake: Fake, reads: StagedReads) -> bool:
    """What the oracle finds wrong: slots in the free list with no flush READ done after the released READ."""
    return bool(reads._free) and "flush-done" not in fake.events[fake.events.index("released-read") :]


def test_a_staged_read_released_unfinished_gives_its_slots_back_after_a_flush_read():
    fake = Fake(flush_polls=3)
    reads = staged(fake)
    part = cut_part(reads)
    assert fake.events[:3] == ["read", "released-read", "flush"], fake.events
    assert "flush-done" in fake.events and not part.unfenced
    assert reads._free == [0, 1] and not slots_back_before_flush(fake, reads)


def test_slots_whose_flush_read_never_completes_are_retired_and_the_part_marked_unfenced():
    fake = Fake(flush_polls=None)
    reads = staged(fake, timeout_s=0.05)
    part = cut_part(reads)
    assert part.unfenced and reads._free == [] and reads.retired == [0, 1]
    assert fake.events[-1] == "released-flush"


class NoFence(StagedReads):
    """The code before: a released READ's slots go back at once."""

    def _fence(self, part) -> None:
        return None


def test_the_oracle_notices_slots_given_back_while_a_released_read_may_write():
    fake = Fake(flush_polls=3)
    reads = staged(fake)
    reads.__class__ = NoFence
    cut_part(reads)
    assert slots_back_before_flush(fake, reads), fake.events
