"""Telling a decode worker's READs of GPU memory that UCX can only emulate in software (staged through host memory
over tcp): from UCX_TLS before the first READ, or from the rate of the first large one. Said once per prefill engine;
the staged path's cost model follows the verdict (`core.staging.cost_model`)."""

from __future__ import annotations

import logging
import time

from kvbridge.core.identity import WorkerIdentity
from kvbridge.runtime.load import Load
from kvbridge.runtime.peers import Engine
from kvbridge.runtime.read_budget import FLOOR_BYTES_PER_S
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_descriptors import MemType

logger = logging.getLogger(__name__)

SLOW_GPU_BYTES_PER_S = 2e9
"""A READ of GPU memory below this rate is not a GPU transport: UCX is emulating it (logged once per engine)."""

SLOW_CHECK_MIN_BYTES = 32 << 20
"""Loads smaller than this are too short to judge a transport's rate by."""


class EmulationJudge:
    """Which prefill engines' READs into this worker's `mem_type` memory UCX emulates (`emulated`, engine ids)."""

    def __init__(self, identity: WorkerIdentity | str, mem_type: MemType, transport: NixlTransport) -> None:
        self.identity = identity
        self.mem_type = mem_type
        self.transport = transport  # its ucx_env, as start() set it
        self.judged: set[str] = set()  # engine ids whose transport has been judged (one log line each)
        self.emulated: set[str] = set()  # engine ids judged emulated (the staged path's cost model follows)

    def at_handshake(self, engine: Engine) -> None:
        """On an engine's first READs (right after its handshake): GPU memory with no CUDA transport in UCX_TLS
        can only be emulated by UCX (staged through host memory over tcp); say so once."""
        engine_id = engine.key[0]
        if self.mem_type != "VRAM" or engine_id in self.judged:
            return
        reason = emulation_reason(self.mem_type, self.transport.ucx_env.get("UCX_TLS"))
        if reason:
            self.judged.add(engine_id)
            self.emulated.add(engine_id)
            logger.warning(
                "kvbridge decode %s: NIXL from prefill engine %s: %s; loads will be slow (their deadlines allow %g "
                "GB/s), not failed",
                self.identity,
                engine_id,
                reason,
                FLOOR_BYTES_PER_S / 1e9,
            )

    def by_rate(self, load: Load) -> None:
        """On an engine's first READs of GPU memory large enough to tell: a rate no GPU transport has means UCX is
        emulating the path in software (two processes on one GPU get no cuda_ipc lane); say so once."""
        engine = load.engine
        if self.mem_type != "VRAM" or engine is None or engine.key[0] in self.judged or not load.posted:
            return
        if load.nbytes < SLOW_CHECK_MIN_BYTES:
            return
        self.judged.add(engine.key[0])
        seconds = max(time.monotonic() - load.posted, 1e-9)
        rate = load.nbytes / seconds
        if rate >= SLOW_GPU_BYTES_PER_S:
            return
        self.emulated.add(engine.key[0])
        same_host = all(p.same_host for p in engine.peers.values())
        logger.warning(
            "kvbridge decode %s: NIXL READs of GPU memory from prefill engine %s run at %.2f GB/s (%.0f MB in %.2f s)"
            ": UCX is emulating the GPU path in software (%s; UCX_PROTO_INFO=y shows 'software emulation'); loads "
            "stay correct but slow (deadlines allow %g GB/s)%s",
            self.identity,
            engine.key[0],
            rate / 1e9,
            load.nbytes / 1e6,
            seconds,
            "on one host: two processes on one GPU get no cuda_ipc lane" if same_host else "no GPU-capable lane",
            FLOOR_BYTES_PER_S / 1e9,
            "; the CUDA IPC path (gpu_peer_copy='auto', the default) avoids NIXL on one host" if same_host else "",
        )


def emulation_reason(mem_type: MemType, ucx_tls: str | None) -> str:
    """Why UCX can only emulate READs of `mem_type` with transports `ucx_tls` (the UCX_TLS in effect; None or
    empty: UCX's own choice), or "" when nothing says so before a READ has run."""
    if mem_type != "VRAM" or not ucx_tls:
        return ""
    if ucx_tls.startswith("^"):  # "all but these": UCX may still have a GPU lane
        return ""
    names = [t.strip().lower() for t in ucx_tls.split(",") if t.strip()]
    gpu = ("all", "gdr_copy", "rc", "rc_x", "rc_v", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib")
    if not any(t.startswith("cuda") or t in gpu for t in names):
        return f"UCX_TLS={ucx_tls} names no GPU transport: UCX can only emulate GPU memory (staged over tcp)"
    return ""
