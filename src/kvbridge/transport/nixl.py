"""The NIXL agent, `NixlTransport`: its registered KV memory, its peers, READ transfers and notifications.

With `nixl_prepared` (a peer's prepared descriptor lists, part of the same class) this is the only code that talks
to NIXL. How the agent is created is `nixl_config`; the descriptor arrays it is handed and the `Transfer` it hands
back are `nixl_descriptors`; how callers wait is `backoff`.

The decode side reads (pulls) a request's KV from each prefill worker it needs; NIXL delivers the read's
notification to that prefill worker once the bytes are in place, so the prefill side learns when it may
free its blocks without a message of its own.

Progress is explicit. NIXL's progress thread spins a core even when idle (its delay is hard-coded to 0),
which on a 2-core machine starves the model, so it is off by default and each transport's owner makes
UCX progress:
- the reader by calling `poll()` on its transfers (with CMA the copy itself happens inside `read()`, in
  the calling thread);
- the target by calling `notifications()`, with backoff, for as long as it waits for readers: a reader's
  first READ from an agent stays "PROC" until that agent progresses too (UCX connection setup needs both
  sides; measured: it waits as long as the target does not poll), and notifications arrive only when polled.
Nothing here spins: callers poll with `Backoff`, which sleeps longer the longer nothing happens.

A transport belongs to one thread (NIXL's agent is created without internal locking).
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from kvbridge.core.descriptors import Descriptors
from kvbridge.core.errors import KVBridgeError, TransferError, TransferTimeout
from kvbridge.core.memory import Region, WorkerMemory
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl_config import TransportConfig, apply_ucx_env
from kvbridge.transport.nixl_descriptors import MemType, Transfer, descriptor_arrays, nixl_error, regions_of
from kvbridge.transport.nixl_prepared import PreparedLists, PreparedListsMixin

logger = logging.getLogger(__name__)

FLUSH_BYTES = 64
"""What a flush READ (`NixlTransport.post_flush`) reads: a few bytes into a scratch buffer of the reader's own."""


class NixlTransport(PreparedListsMixin):
    """One NIXL agent: registers a worker's KV memory, knows its peers, posts READs and reports notifications.

    The constructor only stores values; `start()` creates the agent, `close()` releases everything. Use it
    as a context manager to get both.
    """

    def __init__(self, name: str, config: TransportConfig | None = None) -> None:
        if not name:
            raise ValueError("a transport needs a non-empty agent name (unique among its peers)")
        self.name = name
        self.base_name = name
        self.generation = 0  # how many times `renew` replaced the agent (its name then ends in -g<generation>)
        self.config = config or TransportConfig()
        self.ucx_env: dict[str, str] = {}
        self._agent: Any = None
        self._registered: dict[tuple[int, int, int], MemType] = {}
        self._reg_dlists: list[Any] = []
        self._peers: set[str] = set()
        self._metadata: dict[str, bytes] = {}  # peer -> the metadata it was added with (for `renew`)
        self._memories: list[tuple[WorkerMemory, MemType]] = []  # what was registered (for `renew`)
        self._retired: tuple[list, list[bytes]] = ([], [])  # what `restart` registers and loads
        self._transfers: set[Transfer] = set()
        self._prepared: dict[str, list[PreparedLists]] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._scratch: np.ndarray | None = None  # the flush READs' destination, registered on first use

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> NixlTransport:
        """Create the agent and its backend (about a second with UCX). Idempotent."""
        if self._agent is not None:
            return self
        from nixl._api import nixl_agent, nixl_agent_config

        self.ucx_env = apply_ucx_env(self.config)
        conf = nixl_agent_config(
            enable_prog_thread=self.config.progress_thread,
            enable_listen_thread=False,
            backends=[],
        )
        try:
            agent = nixl_agent(self.name, conf)
            params = dict(self.config.backend_params)
            if self.config.num_threads:
                params.setdefault("num_threads", str(self.config.num_threads))
            agent.create_backend(self.config.backend, params)
        except Exception as exc:
            what = f"cannot create NIXL agent {self.name!r} with {self.config.backend}"
            raise nixl_error(what, exc) from exc
        self._agent = agent
        logger.debug("NIXL agent %s started (%s, %s)", self.name, self.config.backend, self.ucx_env)
        return self

    def close(self) -> None:
        """Release transfers, deregister memory, forget peers, drop the agent. Never raises; idempotent.

        Notifications not yet collected are dropped."""
        agent = self._agent
        if agent is None:
            return
        for transfer in list(self._transfers):
            try:
                self.release(transfer)
            except TransferError as exc:
                logger.warning("closing %s: %s", self.name, exc)
                transfer._xfer = None  # its agent is about to go, and its READ with it
                transfer.state = "RELEASED"
        # Let UCX handle endpoint errors still queued (a dead peer): destroying a worker whose failed endpoint
        # still holds pending operations aborts the process (UCX assertion in arbiter.c).
        self._drain(rounds=3)
        for peer in list(self._prepared):
            self._unprepare_peer(peer)
        for dlist in self._reg_dlists:
            try:
                agent.deregister_memory(dlist)
            except Exception as exc:
                logger.warning("closing %s: deregister failed: %s", self.name, exc)
        for peer in list(self._peers):
            try:
                agent.remove_remote_agent(peer)
            except Exception as exc:
                logger.warning("closing %s: removing peer %s failed: %s", self.name, peer, exc)
        self._reg_dlists.clear()
        self._registered.clear()
        self._memories.clear()
        self._scratch = None
        self._peers.clear()
        self._metadata.clear()
        self._transfers.clear()
        self._inbox.clear()
        self._agent = None

    def renew(self, drop: AbstractSet[str] = frozenset()) -> None:
        """Destroy the agent (`retire`) and start another (`restart`). Transfers in flight are released.

        The fence for READs that may still be queued on a peer: nothing the old agent had in flight can land
        once it is gone (its UCX worker is destroyed with its endpoints), while `remove_peer` is not enough:
        NIXL 1.5.1 closes the endpoint in UCX's flush mode, and a READ queued on a stopped peer lands once that
        peer runs again (tests/nixl/test_nixl_renew.py shows both). About 30 ms on CPU (UCX backend creation)."""
        self.retire(drop)
        self.restart()

    def retire(self, drop: AbstractSet[str] = frozenset()) -> None:
        """Close the agent and check that NIXL's own agent (which holds the UCX worker and its endpoints) is gone,
        keeping what `restart` needs: the memory registered and every peer's metadata but `drop`'s. TransferError
        if something still holds NIXL's agent: its endpoints may still deliver."""
        self._retired = (list(self._memories), [m for name, m in self._metadata.items() if name not in drop])
        old = weakref.ref(self._require().agent)  # the bound agent: transfer and list handles hold it too
        self.close()
        if old() is not None:
            gc.collect()
        if old() is not None:
            raise TransferError(f"NIXL agent {self.name!r} is still referenced after close: it was not destroyed")

    def restart(self) -> None:
        """After `retire`: start an agent under a new name (`<name>-g<n>`), register the same memory and load the
        peers kept. On an error the transport is left closed; call again."""
        memories, peers = self._retired
        if self._agent is not None:
            self.close()
        self.generation += 1
        self.name = f"{self.base_name}-g{self.generation}"
        self.start()
        for memory, mem_type in memories:
            self.register(memory, mem_type)
        for metadata in peers:
            self.add_peer(metadata)
        logger.info("NIXL agent %s started in place of the previous one", self.name)

    def __enter__(self) -> NixlTransport:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._agent is not None

    def _require(self) -> Any:
        if self._agent is None:
            raise TransferError(f"transport {self.name!r} is not started (call start())")
        return self._agent

    def _peer_agent(self, peer: str) -> Any:
        """The started agent, once `peer` is known to it (TransferError otherwise)."""
        agent = self._require()
        if peer not in self._peers:
            raise TransferError(f"peer {peer!r} is unknown to {self.name!r} (call add_peer first)")
        return agent

    # -- memory and peers --------------------------------------------------------------------------

    def register(self, memory: WorkerMemory, mem_type: MemType = "DRAM") -> None:
        """Register each of the worker's regions with NIXL, once, under the region's own device id.

        Call before `agent_metadata()`: peers only see memory registered before they load the metadata.
        """
        agent = self._require()
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")
        new = []
        for region in memory.regions:
            key = (region.addr, region.nbytes, region.device_id)
            if key in self._registered:
                if self._registered[key] != mem_type:
                    raise TransferError(f"region {region} is registered as {self._registered[key]}, not {mem_type}")
                continue
            new.append(region)
        if not new:
            return
        rows = np.array([(r.addr, r.nbytes, r.device_id) for r in new], dtype=np.uint64)
        try:
            self._reg_dlists.append(agent.register_memory(rows, mem_type))
        except Exception as exc:
            raise nixl_error(f"registering {len(new)} {mem_type} regions", exc) from exc
        for r in new:
            self._registered[(r.addr, r.nbytes, r.device_id)] = mem_type
        self._memories.append((WorkerMemory(tuple(new), ()), mem_type))

    def agent_metadata(self) -> bytes:
        """What a peer needs to read from us (connection info and registered memory), for the side channel."""
        try:
            return bytes(self._require().get_agent_metadata())
        except KVBridgeError:
            raise
        except Exception as exc:
            raise nixl_error("getting agent metadata", exc) from exc

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its agent name (NIXL 1.5.1 returns bytes; we return str)."""
        agent = self._require()
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as exc:
            raise nixl_error("loading a peer's agent metadata", exc) from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        self._metadata[name] = metadata
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it. Unknown names are ignored, so this is safe in cleanup."""
        if name not in self._peers:
            return
        self._peers.discard(name)
        self._metadata.pop(name, None)
        self._unprepare_peer(name)
        try:
            self._require().remove_remote_agent(name)
        except Exception as exc:
            raise nixl_error(f"removing peer {name!r}", exc) from exc

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # -- transfers ---------------------------------------------------------------------------------

    def read(
        self,
        peer: str,
        descriptors: Descriptors,
        local: WorkerMemory | Sequence[Region],
        remote: WorkerMemory | Sequence[Region],
        notification: bytes,
        remote_mem_type: MemType | None = None,
    ) -> Transfer:
        """Post a READ of `descriptors` from `peer` (their `src` side) into our memory (their `dst` side).

        `notification` reaches the peer when the READ is complete. With no descriptors (nothing to read) the
        notification is sent on its own, so the peer still learns that this reader is done. Raises
        TransferError if NIXL refuses the transfer; a dead peer is usually detected here.
        """
        agent = self._peer_agent(peer)
        local_regions = regions_of(local)
        transfer = Transfer(peer, descriptors.nbytes, len(descriptors), notification, time.monotonic())
        if len(descriptors) == 0:
            try:
                agent.send_notif(peer, notification)
            except Exception as exc:
                raise nixl_error(f"notifying {peer!r}", exc) from exc
            transfer.state = "DONE"
            return transfer
        local_arr, remote_arr = descriptor_arrays(descriptors, local, remote)
        mem_type = self._mem_type_of(local_regions, descriptors.dst_region)
        try:
            xfer = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_arr, mem_type),
                agent.get_xfer_descs(remote_arr, remote_mem_type or mem_type),
                peer,
                notification,
            )
        except Exception as exc:
            what = f"creating a READ of {len(descriptors)} descriptors from {peer!r}"
            raise nixl_error(what, exc) from exc
        return self._post(transfer, xfer)

    def _post(self, transfer: Transfer, xfer: Any) -> Transfer:
        agent = self._require()
        peer = transfer.peer
        transfer._xfer = xfer
        self._transfers.add(transfer)
        try:
            status = agent.transfer(xfer)
        except Exception as exc:
            error = nixl_error(f"posting a READ from {peer!r}", exc)
            self._discard(transfer, error)
            self._drain()  # let UCX process the endpoint failure now (see close())
            raise error from exc
        if status == "ERR":
            error = TransferError(f"NIXL refused to post a READ from {peer!r}")
            self._discard(transfer, error)
            raise error
        if status == "DONE":
            transfer.state = "DONE"
        return transfer

    def post_flush(self, peer: str, remote: Region, remote_mem_type: MemType = "DRAM") -> Transfer:
        """Post a READ of `FLUSH_BYTES` from the start of `remote` (a region `peer` registered) into a scratch
        buffer of ours, without a notification. UCX answers one reader's READs in order, so once it is done the
        peer has nothing queued for us any more. Close an endpoint to a peer that may still have answers queued
        for us (READs released unfinished, e.g. after a link cut) only after this: UCX 1.23 over tcp can crash
        the peer (SIGSEGV in ucp_worker_discard_uct_ep -> uct_tcp_ep_pending_purge -> ucp_request_memory_dereg)
        when its endpoint fails with such answers still queued (bench/ucx_cut_stress.py)."""
        agent = self._peer_agent(peer)
        if self._scratch is None:
            scratch = np.zeros(FLUSH_BYTES, dtype=np.uint8)
            rows = np.array([(scratch.ctypes.data, scratch.nbytes, 0)], dtype=np.uint64)
            try:
                self._reg_dlists.append(agent.register_memory(rows, "DRAM"))
            except Exception as exc:
                raise nixl_error("registering the flush READs' scratch buffer", exc) from exc
            self._scratch = scratch
        n = min(FLUSH_BYTES, remote.nbytes)
        local_arr = np.array([(self._scratch.ctypes.data, n, 0)], dtype=np.uint64)
        remote_arr = np.array([(remote.addr, n, remote.device_id)], dtype=np.uint64)
        transfer = Transfer(peer, n, 1, b"", time.monotonic())
        try:
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local_arr, "DRAM"), agent.get_xfer_descs(remote_arr, remote_mem_type), peer
            )
        except Exception as exc:
            raise nixl_error(f"creating a flush READ from {peer!r}", exc) from exc
        return self._post(transfer, xfer)

    def _mem_type_of(self, regions: Sequence[Region], used: np.ndarray) -> MemType:
        types = set()
        # The regions used (ids checked in range by descriptor_arrays): a set of fewer than 128 ids costs least; for
        # more, a count per region (np.unique costs more at every size: bench/region_check_cost.py)
        ids = set(used.tolist()) if used.size < 128 else np.flatnonzero(np.bincount(used, minlength=len(regions)))
        for i in ids:
            r = regions[int(i)]
            mem = self._registered.get((r.addr, r.nbytes, r.device_id))
            if mem is None:
                raise TransferError(f"local region {r} is not registered with {self.name!r}")
            types.add(mem)
        if len(types) != 1:
            raise TransferError(f"one READ must land in one memory type, got {sorted(types)}")
        return types.pop()

    def poll(self, transfer: Transfer) -> bool:
        """True once the READ is complete; progresses UCX. TransferError if it failed or the peer died."""
        if transfer.done:
            return True
        try:
            status = self._require().check_xfer_state(transfer._xfer)
        except KVBridgeError:
            raise
        except Exception as exc:
            self._drain()
            raise nixl_error(f"READ from {transfer.peer!r} failed", exc) from exc
        if status == "ERR":
            raise TransferError(f"READ of {transfer.nbytes} bytes from {transfer.peer!r} failed")
        if status == "DONE":
            transfer.state = "DONE"
            return True
        return False

    def wait(self, transfer: Transfer, timeout_s: float, backoff: Backoff | None = None) -> None:
        """Poll with backoff until done; TransferTimeout after `timeout_s`. For callers that may block."""
        backoff = backoff or Backoff()
        deadline = time.monotonic() + timeout_s
        while not self.poll(transfer):
            if time.monotonic() > deadline:
                raise TransferTimeout(f"READ from {transfer.peer!r} not done after {timeout_s} s")
            backoff.sleep()

    def release(self, transfer: Transfer) -> None:
        """Free NIXL's request. Releasing an unfinished READ asks NIXL to cancel it; if it cannot, the request
        stays tracked (the memory may still be written) and TransferError is raised."""
        if transfer.state == "RELEASED":
            return
        xfer = transfer._xfer
        if xfer is not None:
            try:
                xfer.release()
            except Exception as exc:
                raise nixl_error(f"releasing a READ from {transfer.peer!r}", exc) from exc
        transfer._xfer = None
        transfer.state = "RELEASED"
        self._transfers.discard(transfer)

    def _discard(self, transfer: Transfer, error: TransferError) -> None:
        """Release a READ that failed to post; if NIXL will not let go of it, `error.transfer` is it (the caller
        must keep its memory until a later release succeeds: a status error does not mean the DMA stopped)."""
        try:
            self.release(transfer)
        except TransferError as exc:
            logger.warning("%s", exc)
            error.transfer = transfer

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by peer agent name; progresses UCX. A target polls this (with backoff) while it
        waits for readers: it is also what lets their connections complete when the progress thread is off."""
        self._require()
        self._drain(raise_errors=True)
        out, self._inbox = self._inbox, {}
        return out

    def _drain(self, rounds: int = 1, raise_errors: bool = False) -> None:
        """Progress UCX by fetching notifications into the inbox (so progress made for other reasons loses
        none)."""
        agent = self._agent
        if agent is None:
            return
        for _ in range(rounds):
            try:
                notifs = agent.get_new_notifs()
            except Exception as exc:
                if raise_errors:
                    raise nixl_error("getting notifications", exc) from exc
                logger.warning("%s: progressing UCX failed: %s", self.name, exc)
                return
            for key, msgs in notifs.items():
                name = key.decode() if isinstance(key, bytes) else str(key)
                self._inbox.setdefault(name, []).extend(msgs)
