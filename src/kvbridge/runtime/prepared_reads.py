"""Prepared descriptor lists for a decode worker's READs: per prefill agent, its segments registered once as NIXL
prepared lists, so that a load names its blocks by index (`PreparedRead`) instead of sending every descriptor.
Chosen per load where they pay off (`core.descriptors.prefer_prepared`); off unless configured (`prepared_lists`)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import PreparedTable
from kvbridge.core.errors import KVBridgeError
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.segments import Segments
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_prepared import PreparedLists

logger = logging.getLogger(__name__)


class PreparedRead:
    """One prefill worker's part of a load, named by index in that worker's prepared lists."""

    __slots__ = ("dst_idx", "nbytes", "prepared", "src_idx")

    def __init__(self, prepared: PreparedLists, src_idx: np.ndarray, dst_idx: np.ndarray, nbytes: int) -> None:
        self.prepared, self.src_idx, self.dst_idx, self.nbytes = prepared, src_idx, dst_idx, nbytes

    def __len__(self) -> int:
        return len(self.src_idx)


PREPARED_LISTS_ENV = "KVBRIDGE_NIXL_PREPARED_LISTS"


def prepared_lists(config: BridgeConfig) -> bool:
    """Whether the decode worker's READs use prepared descriptor lists: `config.nixl_prepared_lists` when set,
    else the environment's KVBRIDGE_NIXL_PREPARED_LISTS ("1": on); off by default."""
    if config.nixl_prepared_lists is not None:
        return config.nixl_prepared_lists
    return os.environ.get(PREPARED_LISTS_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def prepare(
    transport: NixlTransport,
    identity: object,
    agent: str,
    segments: Segments,
    remote: WorkerMemory,
    local: WorkerMemory,
) -> PreparedLists | None:
    """`agent`'s prepared lists for `segments` (READs from `remote` into `local`), or None if NIXL or the table's
    size refuses (logged: the reads then take per-request descriptors)."""
    prepared = None
    t0 = time.perf_counter()
    try:
        table = PreparedTable(segments, remote.num_blocks, local.num_blocks)
        prepared = transport.prepare(agent, table, local, remote)
    except (ValueError, KVBridgeError) as exc:
        logger.warning(
            "kvbridge decode %s: no prepared descriptor lists for %s (%s): per-request descriptors",
            identity,
            agent,
            exc,
        )
    else:
        logger.info(
            "kvbridge decode %s: prepared %d + %d descriptors for %s in %.1f ms",
            identity,
            table.src_entries,
            table.dst_entries,
            agent,
            1e3 * (time.perf_counter() - t0),
        )
    return prepared
