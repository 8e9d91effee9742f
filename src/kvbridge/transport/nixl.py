"""The one module that talks to NIXL: an agent, its registered KV memory, its peers, and READ transfers.

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

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvbridge.core.descriptors import Descriptors, PreparedTable
from kvbridge.core.errors import KVBridgeError, TransferError, TransferTimeout
from kvbridge.core.memory import Region, WorkerMemory

logger = logging.getLogger(__name__)

MemType = Literal["DRAM", "VRAM"]

FLUSH_BYTES = 64
"""What a flush READ (`NixlTransport.post_flush`) reads: a few bytes into a scratch buffer of the reader's own."""


@dataclass(frozen=True)
class TransportConfig:
    """How the NIXL agent is created; the only place where NIXL and UCX settings live."""

    backend: str = "UCX"
    """NIXL backend plugin to create. UCX moves DRAM and VRAM within and across nodes."""

    ucx_tls: str | None = "self,sm,cma,tcp"
    """UCX_TLS, applied only if the environment does not set it. `tcp` is needed because UCX endpoints in
    peer error-handling mode (what detects a dead peer) need a transport with active messages and failure
    detection; `cma` copies host memory between processes with one syscall. None leaves UCX to choose."""

    ucx_net_devices: str | None = "lo"
    """UCX_NET_DEVICES, applied only if the environment does not set it. `lo` keeps every socket on loopback;
    set the NIC (e.g. "mlx5_0:1,eth0") for transfers across nodes. None leaves UCX to choose."""

    progress_thread: bool = False
    """Start NIXL's progress thread. It spins a core even when idle, so off by default: the owner then makes
    progress by polling (see the module docstring). Turn on only where a core can be spared."""

    backend_params: tuple[tuple[str, str], ...] = ()
    """Extra init parameters for the backend, e.g. (("ucx_error_handling_mode", "none"),), which lets
    UCX_TLS=self,sm,cma work without tcp at the price of no dead-peer detection."""

    num_threads: int = 0
    """Worker threads inside the backend (0: the backend's default). More threads only help with many NICs."""

    prepared_lists: bool = False
    """Readers prepare each peer's descriptor lists once (NIXL's `prep_xfer_dlist`, every run of every block) and
    name a request's runs by index (`make_prepped_xfer`), instead of building and checking descriptor lists per
    request (`initialize_xfer`). Requests whose blocks coalesce well still take the per-request path. Off by
    default until measured on a GPU (docs/benchmarks/nixl-descriptors.md)."""

    def __post_init__(self) -> None:
        if not self.backend:
            raise ValueError("backend must be a NIXL plugin name, got an empty string")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    def ucx_env(self) -> dict[str, str]:
        """The UCX variables this config asks for (before the environment's own values take precedence)."""
        wanted = {"UCX_TLS": self.ucx_tls, "UCX_NET_DEVICES": self.ucx_net_devices}
        return {k: v for k, v in wanted.items() if v is not None}


def apply_ucx_env(config: TransportConfig) -> dict[str, str]:
    """Set the config's UCX variables where the user has not, and return the values in effect.

    UCX reads its environment when a backend's context is created, so this runs right before the agent is.
    A user's explicit UCX_* setting always wins: it is how operators tune UCX without touching code.
    """
    for key, value in config.ucx_env().items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ}


class Backoff:
    """Sleeps between polls: short at first (transfers finish in micro- to milliseconds), doubling up to a
    cap, so waiting on an idle peer costs almost no CPU. `reset()` after something happened."""

    def __init__(self, first_s: float = 50e-6, cap_s: float = 5e-3) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = first_s

    def step(self) -> float:
        """The delay to wait now (for callers that wait on something else, e.g. a pipe); doubles the next."""
        delay = self.delay_s
        self.delay_s = min(self.cap_s, self.delay_s * 2)
        return delay

    def sleep(self) -> None:
        time.sleep(self.step())

    def reset(self) -> None:
        self.delay_s = self.first_s


@dataclass(eq=False)
class Transfer:
    """A posted READ: poll it with `NixlTransport.poll` until done, then `release` it."""

    peer: str
    nbytes: int
    num_descriptors: int
    notification: bytes
    posted_at: float
    state: Literal["PROC", "DONE", "RELEASED"] = "PROC"
    _xfer: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state != "PROC"


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


def _region_table(regions: Sequence[Region]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    addr = np.array([r.addr for r in regions], dtype=np.int64)
    end = addr + np.array([r.nbytes for r in regions], dtype=np.int64)
    dev = np.array([r.device_id for r in regions], dtype=np.int64)
    return addr, end, dev


def _side_array(side: str, addrs: np.ndarray, length: np.ndarray, idx: np.ndarray, regions: Sequence[Region]):
    if not regions:
        raise TransferError(f"{side} side has no memory regions")
    start, end, dev = _region_table(regions)
    if idx.size and (idx.min() < 0 or idx.max() >= len(regions)):
        bad = int(idx[(idx < 0) | (idx >= len(regions))][0])
        raise TransferError(f"{side} descriptor names region {bad}, but there are {len(regions)} regions")
    outside = (addrs < start[idx]) | (addrs + length > end[idx])
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise TransferError(
            f"{side} descriptor {i} [{int(addrs[i]):#x}, +{int(length[i])}) lies outside its region "
            f"{int(idx[i])} [{int(start[idx[i]]):#x}, {int(end[idx[i]]):#x})"
        )
    return np.stack([addrs, length, dev[idx]], axis=1).astype(np.uint64)


def descriptor_arrays(
    descriptors: Descriptors, local: Sequence[Region], remote: Sequence[Region]
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL's Nx3 (addr, len, device id) arrays for a READ: the local (decode) side is `dst`, the remote
    (prefill) side is `src`. Each descriptor's device id is that of the region it points into, never a rank:
    a worker's rank and its device need not match (CUDA_VISIBLE_DEVICES, several engines per node)."""
    length = descriptors.length.astype(np.int64)
    local_arr = _side_array("local", descriptors.dst_addr.astype(np.int64), length, descriptors.dst_region, local)
    remote_arr = _side_array("remote", descriptors.src_addr.astype(np.int64), length, descriptors.src_region, remote)
    return local_arr, remote_arr


def _nixl_error(what: str, exc: BaseException) -> TransferError:
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")


class NixlTransport:
    """One NIXL agent: registers a worker's KV memory, knows its peers, posts READs and reports notifications.

    The constructor only stores values; `start()` creates the agent, `close()` releases everything. Use it
    as a context manager to get both.
    """

    def __init__(self, name: str, config: TransportConfig | None = None) -> None:
        if not name:
            raise ValueError("a transport needs a non-empty agent name (unique among its peers)")
        self.name = name
        self.config = config or TransportConfig()
        self.ucx_env: dict[str, str] = {}
        self._agent: Any = None
        self._registered: dict[tuple[int, int, int], MemType] = {}
        self._reg_dlists: list[Any] = []
        self._peers: set[str] = set()
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
            raise _nixl_error(what, exc) from exc
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
        self._scratch = None
        self._peers.clear()
        self._transfers.clear()
        self._inbox.clear()
        self._agent = None

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
            raise _nixl_error(f"registering {len(new)} {mem_type} regions", exc) from exc
        for r in new:
            self._registered[(r.addr, r.nbytes, r.device_id)] = mem_type

    def agent_metadata(self) -> bytes:
        """What a peer needs to read from us (connection info and registered memory), for the side channel."""
        try:
            return bytes(self._require().get_agent_metadata())
        except KVBridgeError:
            raise
        except Exception as exc:
            raise _nixl_error("getting agent metadata", exc) from exc

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its agent name (NIXL 1.5.1 returns bytes; we return str)."""
        agent = self._require()
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _nixl_error("loading a peer's agent metadata", exc) from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it. Unknown names are ignored, so this is safe in cleanup."""
        if name not in self._peers:
            return
        self._peers.discard(name)
        self._unprepare_peer(name)
        try:
            self._require().remove_remote_agent(name)
        except Exception as exc:
            raise _nixl_error(f"removing peer {name!r}", exc) from exc

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
        agent = self._require()
        if peer not in self._peers:
            raise TransferError(f"peer {peer!r} is unknown to {self.name!r} (call add_peer first)")
        local_regions = local.regions if isinstance(local, WorkerMemory) else tuple(local)
        remote_regions = remote.regions if isinstance(remote, WorkerMemory) else tuple(remote)
        transfer = Transfer(peer, descriptors.nbytes, len(descriptors), notification, time.monotonic())
        if len(descriptors) == 0:
            try:
                agent.send_notif(peer, notification)
            except Exception as exc:
                raise _nixl_error(f"notifying {peer!r}", exc) from exc
            transfer.state = "DONE"
            return transfer
        local_arr, remote_arr = descriptor_arrays(descriptors, local_regions, remote_regions)
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
            raise _nixl_error(what, exc) from exc
        return self._post(transfer, xfer)

    def _post(self, transfer: Transfer, xfer: Any) -> Transfer:
        agent = self._require()
        peer = transfer.peer
        transfer._xfer = xfer
        self._transfers.add(transfer)
        try:
            status = agent.transfer(xfer)
        except Exception as exc:
            error = _nixl_error(f"posting a READ from {peer!r}", exc)
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
        agent = self._require()
        if peer not in self._peers:
            raise TransferError(f"peer {peer!r} is unknown to {self.name!r} (call add_peer first)")
        if self._scratch is None:
            scratch = np.zeros(FLUSH_BYTES, dtype=np.uint8)
            rows = np.array([(scratch.ctypes.data, scratch.nbytes, 0)], dtype=np.uint64)
            try:
                self._reg_dlists.append(agent.register_memory(rows, "DRAM"))
            except Exception as exc:
                raise _nixl_error("registering the flush READs' scratch buffer", exc) from exc
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
            raise _nixl_error(f"creating a flush READ from {peer!r}", exc) from exc
        return self._post(transfer, xfer)

    # -- prepared descriptor lists ------------------------------------------------------------------

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
        agent = self._require()
        if peer not in self._peers:
            raise TransferError(f"peer {peer!r} is unknown to {self.name!r} (call add_peer first)")
        local_regions = local.regions if isinstance(local, WorkerMemory) else tuple(local)
        remote_regions = remote.regions if isinstance(remote, WorkerMemory) else tuple(remote)
        d_addr, d_len, d_region = table.dst_side()
        s_addr, s_len, s_region = table.src_side()
        local_arr = _side_array("local", d_addr, d_len, d_region, local_regions)
        remote_arr = _side_array("remote", s_addr, s_len, s_region, remote_regions)
        mem_type = self._mem_type_of(local_regions, table.segments.dst_region)
        prepared = PreparedLists(peer, table)
        try:
            prepared._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_arr, mem_type)
            prepared._remote = agent.prep_xfer_dlist(peer, remote_arr, remote_mem_type or mem_type)
        except Exception as exc:
            self._release_prepared(prepared)
            what = f"preparing {len(local_arr)} + {len(remote_arr)} descriptors for {peer!r}"
            raise _nixl_error(what, exc) from exc
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
                raise _nixl_error(f"notifying {peer!r}", exc) from exc
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
            raise _nixl_error(f"creating a prepared READ of {n} descriptors from {peer!r}", exc) from exc
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

    def _mem_type_of(self, regions: Sequence[Region], used: np.ndarray) -> MemType:
        types = set()
        for i in np.unique(used):
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
            raise _nixl_error(f"READ from {transfer.peer!r} failed", exc) from exc
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
                raise _nixl_error(f"releasing a READ from {transfer.peer!r}", exc) from exc
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
                    raise _nixl_error("getting notifications", exc) from exc
                logger.warning("%s: progressing UCX failed: %s", self.name, exc)
                return
            for key, msgs in notifs.items():
                name = key.decode() if isinstance(key, bytes) else str(key)
                self._inbox.setdefault(name, []).extend(msgs)
