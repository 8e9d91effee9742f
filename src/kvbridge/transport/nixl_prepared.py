"""Prepared descriptor lists (`TransportConfig.prepared_lists`): a peer's descriptor lists prepared with NIXL once
(`prep_xfer_dlist`), and READs that name a request's runs by index into them (`make_prepped_xfer`).

`PreparedListsMixin` is part of `nixl.NixlTransport` (it uses the transport's agent, peers and `_post`), kept
here so that each file holds one concept; the transport releases a peer's lists with the peer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.core.descriptors import PreparedTable
from kvbridge.core.errors import TransferError
from kvbridge.core.memory import Region, WorkerMemory
from kvbridge.transport.nixl_descriptors import MemType, Transfer, nixl_error, regions_of, side_array

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PreparedLists:
    """A peer's prepared descriptor lists (`NixlTransport.prepare`): both sides of a PreparedTable, by index."""

    peer: str
    table: PreparedTable
    _local: Any = field(default=None, repr=False)
    _remote: Any = field(default=None, repr=False)

    @property
    def released(self) -> bool:
        return self._local is None and self._remote is None


class PreparedListsMixin:
    """`NixlTransport`'s prepared descriptor lists: `prepare`, `read_prepared`, `unprepare`."""

    name: str
    _peers: set[str]
    _prepared: dict[str, list[PreparedLists]]

    if TYPE_CHECKING:

        def _require(self) -> Any: ...

        def _peer_agent(self, peer: str) -> Any: ...

        def _post(self, transfer: Transfer, xfer: Any) -> Transfer: ...

        def _mem_type_of(self, regions: Sequence[Region], used: np.ndarray) -> MemType: ...

    def prepare(
        self,
        peer: str,
        table: PreparedTable,
        local: WorkerMemory | Sequence[Region],
        remote: WorkerMemory | Sequence[Region],
        remote_mem_type: MemType | None = None,
    ) -> PreparedLists:
        """Prepare both sides of `table` with NIXL once (the destination side in our memory, the source side in
        `peer`'s), for `read_prepared`. Every entry is checked against its region here, so requests are not.
        TransferError if NIXL refuses; the caller may then keep to `read`. Released with the peer, or `unprepare`."""
        agent = self._peer_agent(peer)
        local_regions, remote_regions = regions_of(local), regions_of(remote)
        d_addr, d_len, d_region = table.dst_side()
        s_addr, s_len, s_region = table.src_side()
        local_arr = side_array("local", d_addr, d_len, d_region, local_regions)
        remote_arr = side_array("remote", s_addr, s_len, s_region, remote_regions)
        mem_type = self._mem_type_of(local_regions, table.segments.dst_region)
        prepared = PreparedLists(peer, table)
        try:
            prepared._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_arr, mem_type)
            prepared._remote = agent.prep_xfer_dlist(peer, remote_arr, remote_mem_type or mem_type)
        except Exception as exc:
            self._release_prepared(prepared)
            what = f"preparing {len(local_arr)} + {len(remote_arr)} descriptors for {peer!r}"
            raise nixl_error(what, exc) from exc
        self._prepared.setdefault(peer, []).append(prepared)
        return prepared

    def read_prepared(
        self, prepared: PreparedLists, src_idx: np.ndarray, dst_idx: np.ndarray, notification: bytes
    ) -> Transfer:
        """Post a READ of the prepared entries `src_idx` (the peer's side) into `dst_idx` (ours), as `read` does;
        the indices come from `prepared.table.indices`."""
        agent = self._require()
        peer = prepared.peer
        if prepared.released or peer not in self._peers:
            raise TransferError(f"prepared lists for {peer!r} were released (the peer was removed)")
        if len(src_idx) != len(dst_idx):
            raise TransferError(f"{len(src_idx)} source and {len(dst_idx)} destination indices do not pair up")
        n = len(src_idx)
        pairs = n // len(prepared.table.segments)
        transfer = Transfer(peer, prepared.table.nbytes(pairs), n, notification, time.monotonic())
        if n == 0:
            try:
                agent.send_notif(peer, notification)
            except Exception as exc:
                raise nixl_error(f"notifying {peer!r}", exc) from exc
            transfer.state = "DONE"
            return transfer
        try:
            xfer = agent.make_prepped_xfer(
                "READ",
                prepared._local,
                np.ascontiguousarray(dst_idx, dtype=np.int32),
                prepared._remote,
                np.ascontiguousarray(src_idx, dtype=np.int32),
                notification,
            )
        except Exception as exc:
            raise nixl_error(f"creating a prepared READ of {n} descriptors from {peer!r}", exc) from exc
        return self._post(transfer, xfer)

    def unprepare(self, prepared: PreparedLists) -> None:
        """Release one peer's prepared lists (no READ made from them may be in flight). Never raises."""
        kept = self._prepared.get(prepared.peer, [])
        if prepared in kept:
            kept.remove(prepared)
        self._release_prepared(prepared)

    def _unprepare_peer(self, peer: str) -> None:
        for prepared in self._prepared.pop(peer, []):
            self._release_prepared(prepared)

    def _release_prepared(self, prepared: PreparedLists) -> None:
        for attr in ("_local", "_remote"):
            handle = getattr(prepared, attr)
            setattr(prepared, attr, None)
            if handle is None:
                continue
            try:
                handle.release()
            except Exception as exc:
                logger.warning("%s: releasing prepared lists for %s failed: %s", self.name, prepared.peer, exc)
