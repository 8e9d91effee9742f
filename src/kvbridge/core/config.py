"""kvbridge's configuration: one typed struct, read from vLLM's `kv_connector_extra_config` at the edge.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"lease_s": 30}}'

Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvbridge.core.errors import ConfigError

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class BridgeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    side_channel_host: str = "127.0.0.1"
    """Address the prefill workers' side channels bind to (0.0.0.0 to accept other hosts)."""

    advertise_host: str | None = None
    """Address put in kv_transfer_params for decode instances to reach this prefill instance.
    Default: side_channel_host, unless that is a wildcard (then VLLM_HOST_IP, which vLLM sets)."""

    side_channel_port: Port = 5600
    """Base port: the worker at (dp, pp, tp) listens on base + (dp*pp_size + pp)*tp_size + tp."""

    lease_s: Seconds = 60.0
    """How long a prefill instance holds a finished request's blocks for decode readers before freeing them."""

    handshake_timeout_s: Seconds = 5.0
    """Per attempt, for fetching a prefill worker's handshake over the side channel."""

    handshake_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    """Further attempts after a handshake attempt times out."""

    transfer_timeout_s: Seconds = 60.0
    """A request's reads that have not all completed by then fail (and follow kv_load_failure_policy)."""

    verify_requests: bool = True
    """Before reading, ask each prefill worker whether it still holds the request with these blocks (one
    side-channel round trip per worker): a late or forged request then fails cleanly instead of reading blocks
    that belong to another request."""

    ucx_tls: str | None = "auto"
    """UCX transports (UCX_TLS) unless the environment sets UCX_TLS. "auto": `self,sm,cma,tcp` for KV in host
    memory (tcp is what lets UCX detect a dead peer), UCX's own choice for GPU memory (cuda_ipc, cuda_copy, rc...);
    None: UCX's own choice always."""

    ucx_net_devices: str | None = None
    """UCX network devices (UCX_NET_DEVICES) unless the environment sets it; None lets UCX choose. Tests and
    `kvbridge serve`/`demo` on one machine use "lo" (through the environment)."""

    gpu_peer_copy: Literal["auto", "nixl"] = "auto"
    """How a decode worker reads KV in GPU memory from a prefill worker on the same host. "auto": through CUDA IPC
    with kvbridge's gather kernel (one launch per prefill worker, near the NVLink copy rate however scattered the
    blocks), falling back to NIXL when the handles cannot be opened; "nixl": always NIXL."""

    kv_layout: str | None = None
    """A vLLM KV cache layout to ask for ("NHD" or "HND"); None asks HND only when TP sizes may differ."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> BridgeConfig:
        try:
            return msgspec.convert(dict(extra or {}), cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
