"""How a NIXL agent is created: `TransportConfig` (backend, UCX transports and devices, progress thread) and
`apply_ucx_env`, which puts its UCX settings into the environment where the user has not. The agent itself is
`nixl.NixlTransport`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
    progress by polling (see the `nixl` module's docstring). Turn on only where a core can be spared."""

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
