"""kvbridge's configuration: one typed struct, read from vLLM's `kv_connector_extra_config` at the edge.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"lease_s": 30}}'

Unknown keys are refused (a typo must not silently fall back to a default).

Security: `auth_key` / `auth_key_file` is the deployment's shared key (never a default). With it every
side-channel message is authenticated and encrypted and the prefill signs the kv_transfer_params it hands out.
Without it the connector starts only with `keyless_exposes_kv_to_local_processes` (`check_auth`), and its side channel
may only listen on loopback (`check_exposure`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

import msgspec

from kvbridge.core.errors import ConfigError
from kvbridge.core.leases import READ_MARGIN_S

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class BridgeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    side_channel_host: str = "127.0.0.1"
    """Address the prefill workers' side channels bind to: for decode instances on other hosts, this host's address
    on their network, with a deployment key (a wildcard such as 0.0.0.0 also needs advertise_host and
    ucx_net_devices)."""

    advertise_host: str | None = None
    """Address put in kv_transfer_params for decode instances to reach this prefill instance.
    Default: side_channel_host, unless that is a wildcard (then VLLM_HOST_IP, which vLLM sets)."""

    side_channel_port: Port = 5600
    """Base port: the worker at (dp, pp, tp) listens on base + (dp*pp_size + pp)*tp_size + tp."""

    lease_s: Seconds = 60.0
    """How long a prefill instance holds a finished request's blocks for decode readers before freeing them."""

    handshake_timeout_s: Seconds = 1.0
    """Decode side: the answer deadline of one side-channel attempt (handshake, claim, notification). A peer that
    refuses the connection (its process is gone) fails the message at once, whatever the deadline; one that stays
    silent (a stopped process, a host or link down) fails it after `(1 + handshake_retries) * handshake_timeout_s`
    (2 s by default), and its engine is then known dead for dead_engine_s."""

    handshake_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 1
    """Further attempts after a side-channel attempt timed out or its connection was reset (not after a refusal)."""

    link_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.5
    """Decode side: how long a connection to a prefill worker may wait on the prefill host's TCP stack: a connect
    not accepted, or bytes sent and not acknowledged, for this long ends the attempt (TCP_USER_TIMEOUT; ZMQ's
    TCP_MAXRT and CONNECT_TIMEOUT on the side channel). Two such in a row (an aborted connection then a connect, or
    two connects: one lost SYN is sent again only after 1 s) make the host unreachable, its link or the host itself
    down. The host's kernel accepts and acknowledges whatever its processes do, so a stopped or busy prefill
    whose kernel answers is not taken for an unreachable one (the answer deadline, handshake_timeout_s, covers
    those); a prefill whose listen queue overflows drops connects as an unreachable host does. A side-channel
    message to an unreachable host then fails in about twice this instead of `(1 + handshake_retries) *
    handshake_timeout_s`; the engine is known dead for dead_engine_s, and the decode worker cuts its KV channel
    loads in flight from it. Not applied to a prefill at an address of the decode's own host (loopback or one of
    its interfaces, given as an IP literal or `localhost`; other names are not resolved and count as another
    host): that host's kernel answers there, and a connect late only because the decode process was starved must
    not make a live prefill dead.
    0: the kernel's defaults (minutes)."""

    transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 25.0
    """A load not complete this long after it was queued fails (and follows kv_load_failure_policy). It is also
    how long the claim pins the request on the prefill side (plus a margin). On a kv_both instance lease_s must
    exceed it by that margin. The decode side adds the load's bytes in flight at a floor rate (0.1 GB/s, at most
    300 s more; `runtime.nixl_reads.ReadBudget`), so that a slow transport gives slow loads, not failed ones."""

    read_liveness_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.5
    """Decode side: NIXL READs in flight on a prefill worker for this long get the worker's side channel asked
    whether its process runs (a `Ping`), again every as long while they run. NIXL gives no progress signal for a
    READ, and a silent prefill (a stopped process, a host or link down) leaves it running until the load's
    deadline; a worker that does not answer within the answer deadline and its retries (`(1 + handshake_retries) *
    handshake_timeout_s`), or whose process is gone, fails every load reading from it, as its deadline would (the
    decode's NIXL agent is renewed before the loads are reported), and its engine is known dead for
    dead_engine_s. A silent prefill then costs at most this plus the answer deadline (2.5 s by default); a slow one
    that answers keeps its loads. READs done sooner cost nothing. 0: never asked (the load's deadline alone ends
    it)."""

    verify_requests: bool = True
    """Before reading, ask each prefill worker whether it still holds the request with these blocks (one
    side-channel round trip per worker): a late or forged request then fails cleanly instead of reading blocks
    that belong to another request."""

    ucx_tls: str | None = "auto"
    """UCX transports (UCX_TLS) unless the environment sets UCX_TLS. "auto": `self,sm,cma,tcp` for KV in host
    memory (tcp is what lets UCX detect a dead peer; plus cuda_copy on a host with NVIDIA GPUs, where NIXL built for
    CUDA refuses a setting without a CUDA transport), UCX's own choice for GPU memory (cuda_ipc, cuda_copy, rc...);
    None: UCX's own choice always."""

    ucx_net_devices: str | None = None
    """UCX network devices (UCX_NET_DEVICES) unless the environment sets it: the NIC(s) NIXL may use, e.g.
    "mlx5_0:1,eth0". None: the interface that holds side_channel_host ("lo" for the loopback default; a decode
    instance reading from other hosts must name its NIC here). "all" lets UCX use every interface."""

    ucx_tcp_exposes_process_memory: bool = False
    """Let NIXL's UCX use tcp beyond loopback (`ucx_net_devices` or the environment's UCX_NET_DEVICES naming an
    Ethernet or IPoIB interface, or "all"), and read KV from prefill engines on other hosts over it. UCX's tcp
    transport emulates READ and WRITE with active messages and checks neither memory registration nor remote keys:
    anyone who reaches its port reads and writes any memory of the process (every user's KV, the weights, the
    deployment key) and crashes it with one READ of an unmapped address, with no key and no handshake. False (the
    default): UCX's network devices are loopback and RDMA devices only (`lo`, or an RDMA driver's device and port such
    as "mlx5_0:1"; not an interface alias such as "eth0:1"), anything else refuses to start naming this field, and KV
    moves between hosts over kvbridge's own channel (`kv_stream_*`: authenticated with the deployment key, AES-GCM
    frames) unless RDMA devices are named. Loopback tcp still serves every local user of the host (docs/security.md,
    "Transport")."""

    kv_stream_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Prefill side: base port of kvbridge's KV channel, on side_channel_host; the worker at (dp, pp, tp) listens on
    base + (dp*pp_size + pp)*tp_size + tp. 0: each worker's port is chosen by the OS and sent to readers in its
    (authenticated) handshake. The channel runs only with a deployment key and KV in host memory."""

    kv_stream_encrypt: bool = True
    """KV channel frames encrypted and authenticated (AES-256-GCM). False: authenticated only (the KV is the
    associated data of AES-GCM): anyone on the path reads the KV, nobody without the key changes, injects or
    replays a byte. Both sides must agree; a reader of the other setting is refused naming both."""

    kv_stream_connections: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    """Decode side: connections one prefill worker's part of a request is spread over (chunk i on connection
    i mod n), so that gathering, sealing, sending, opening and scattering overlap."""

    kv_stream_chunk_bytes: Annotated[int, msgspec.Meta(ge=1 << 16, le=1 << 26)] = 4 << 20
    """Decode side: bytes of KV per data frame (a run longer than this takes a frame of its own size)."""

    kv_stream_stall_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 2.0
    """Decode side: a KV channel read that receives no byte for this long fails its load (the connection is shut,
    so nothing of it lands later), however much of transfer_timeout_s is left: a prefill whose host went silent
    (SIGSTOP, host or link down) mid-transfer costs this, not the load's deadline. It bounds each wait for the next
    byte, not the whole transfer: a slow but live prefill keeps its load going. It must exceed what a live prefill
    takes under load to start answering a part (its claim check, one chunk's gather) or to send a chunk's next
    bytes; 2 s by default, so that a silent prefill fails a load within the 3 s a silent host may cost."""

    kv_stream_max_connections: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 2048
    """Prefill side: KV channel connections one prefill worker keeps open. A decode worker keeps up to 16 idle
    ones per prefill worker between loads (closed after 60 s unused) plus kv_stream_connections per load in flight:
    2048 serves 64 decode ranks. When full, the oldest connection that has not proved the key is cut, else the
    least recently used authenticated idle one (its reader opens a fresh one when it needs it), else the new one."""

    kv_stream_max_connections_per_address: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 512
    """Prefill side: KV channel connections from one source address (a decode host of 8 GPUs keeps up to 128
    idle); beyond it the same eviction as kv_stream_max_connections, among that address's connections."""

    kv_stream_threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Decode side: threads reading KV channel connections (one per connection in use); loads beyond them wait."""

    gpu_peer_copy: Literal["auto", "nixl"] = "auto"
    """How a decode worker reads KV in GPU memory from a prefill worker on the same host. "auto": through CUDA IPC
    with kvbridge's gather kernel (one launch per prefill worker, near the NVLink copy rate however scattered the
    blocks), falling back to NIXL when the handles cannot be opened; "nixl": always NIXL."""

    kv_layout: Literal["NHD", "HND"] | None = None
    """The KV cache layout kvbridge asks vLLM for (`get_required_kvcache_layout`): "HND" keeps each block's heads
    together on GPU, so that a decode worker of another TP size reads one run per block instead of one per token;
    None keeps vLLM's default. Both sides must use the same one (the handshake compares the page format)."""

    auth_key: str | None = None
    """The deployment's shared secret (at least 32 bytes of key material: 64 hex digits, or 32 other bytes), the
    same on every prefill and decode instance. Prefer auth_key_file; never leave a key in a command line that
    others can read."""

    auth_key_file: str | None = None
    """A file holding the deployment's shared secret (surrounding whitespace ignored; at least 32 bytes of key
    material: `openssl rand -hex 32`). This instance sends with it and accepts it."""

    auth_accepted_key_files: tuple[str, ...] = ()
    """Further key files this instance accepts but does not send with: the previous (or next) key while a key is
    rotated instance by instance (`wire.keys`). Each needs the strength of auth_key_file."""

    auth_window_s: Seconds = 30.0
    """Side-channel requests whose time differs from the receiver's clock by more than this are not taken; the
    receiver answers an authentic one with its clock, and the sender then times its requests to it by that clock
    (`wire.auth`): hosts whose clocks differ keep working, and a sender whose request is still refused gets an
    error naming the measured difference."""

    keyless_exposes_kv_to_local_processes: bool = False
    """Run without a deployment key, which exposes the KV to every process of this host: any local process can
    handshake with the side channel, learn the NIXL metadata and memory map, READ and WRITE every request's KV, free
    or pin requests, and crash a worker with malformed metadata; the side channel may only listen on loopback
    (`kvbridge serve`/`demo --keyless-exposes-kv-to-local-processes` set it). Without a key and without this flag the
    connector refuses to start, naming it."""

    max_remote_workers: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 1024
    """Largest prefill layout (dp*pp*tp) a decode instance accepts in kv_transfer_params, checked before anything
    is connected or allocated."""

    check_prompt: bool = True
    """Decode side: load only kv_transfer_params computed for this request's prompt (token count and hash).
    Off only for tests that show what the check prevents: a decode may then load another prompt's KV."""

    check_blocks: bool = True
    """Prefill side: grant a claim only if it names the request's block list in the order its params published it
    (a digest; `core.leases`): params whose blocks were reordered, repeated or replaced are refused, with or
    without a deployment key. Off only for tests that show what loading wrong blocks does to the output."""

    nixl_prepared_lists: bool | None = None
    """Decode side: post READs through NIXL descriptor lists prepared once per prefill worker (`prep_xfer_dlist`,
    then `make_prepped_xfer` with a request's indices) instead of building each request's descriptors. Off until
    measured faster where it matters (docs/benchmarks/nixl-descriptors.md). None: the KVBRIDGE_NIXL_PREPARED_LISTS
    environment variable decides ("1": on), for benches and tests."""

    nixl_staging_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 36)] = 0
    """Memory for the staged NIXL path (host memory, or VRAM on the KV's GPU when the KV is in GPU memory:
    `transport.device_copy`), allocated and registered once per worker: a
    prefill worker gathers a reader's scattered runs into it, a decode worker READs them there in large chunks and
    scatters them into its KV (`core.staging`, `runtime.staging`, `runtime.staged_reads`). Both sides need it; a
    decode worker stages a read only where the cost model expects it to beat posting every run (`nixl_staging`).
    0: off (the direct path only)."""

    nixl_staging_chunk_bytes: Annotated[int, msgspec.Meta(ge=1 << 16, le=1 << 30)] = 8 << 20
    """The staged path's chunk (a slot of the staging buffer): a request's part is gathered, read and scattered
    chunk by chunk, two chunks in flight per prefill worker read."""

    nixl_staging: Literal["auto", "always"] = "auto"
    """Decode side, with staging on both sides: "auto" stages a prefill worker's part of a request when the cost
    model (`core.staging.StageCostModel`: bytes, descriptors) prefers it; "always" stages every part that fits (tests,
    benches)."""

    idle_wait_s: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.005
    """On a step with nothing scheduled, wait up to this long for the connector's next event rather than return at
    once: a decode worker with loads outstanding for one to finish, a prefill worker holding requests for a
    notification, abort or expiry (the event ends the wait at once). vLLM steps continuously while loads are
    pending or blocks are held; that busy loop left other processes' threads (a prefill worker's side channel on
    a shared core) 15 s on the run queue. A request arriving meanwhile waits at most this long. 0: off."""

    hold_feed: bool = True
    """Prefill: send each finished request's hold from the scheduler to the workers on this host at once, over a
    Unix socket only this user can open (`wire.hold_feed`), besides the next step's metadata. With vLLM's async
    scheduling the metadata brings a hold one step late: on a busy prefill engine a decode's claim then waits a
    whole prefill step for it. False: the metadata only."""

    peer_tp: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    """The TP size of the instances on the other side (the prefill instances of a decode, the decode instances of
    a prefill; both of a kv_both). Checked at startup for models whose cache holds state (Mamba), which kvbridge
    moves only between equal TP sizes: another size is refused naming the layout. None: each handshake compares
    the state pages (`state_bytes`), so a peer of another TP size is refused then."""

    # --- bounds on what peers and clients control (safe defaults, each configurable) ------------------------

    side_channel_max_frame_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 26)] = 256 * 1024
    """Prefill side: largest frame a side-channel server takes (ZMQ cuts the connection of a larger one). A decode
    worker's handshake request is a few hundred bytes a layer; claims and notifications are far smaller."""

    side_channel_queued_frames: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 16
    """Prefill side: frames ZMQ queues per side-channel connection, each way (its default, 1000, times the frame
    size is what one flooding connection could pin)."""

    side_channel_max_connections: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 512
    """Prefill side: connections one side-channel server keeps open (each may pin side_channel_queued_frames frames
    of side_channel_max_frame_bytes). A decode worker keeps one per control thread (8): 512 serves 64 decode ranks."""

    side_channel_max_connections_per_address: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 128
    """Prefill side: connections one source address keeps open (a decode host of 8 GPUs x 8 control threads needs
    64); beyond it the oldest that never sent an authenticated frame is cut, so a flood locks out no key holder."""

    auth_max_nonces: Annotated[int, msgspec.Meta(ge=1024, le=1 << 24)] = 1 << 18
    """Prefill side, with a key: nonces of sealed requests remembered within auth_window_s (replays are refused);
    when full, new sealed requests are refused rather than old nonces forgotten (only key holders get this far)."""

    max_early_notes: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 1024
    """Prefill side: requests whose notifications or aborts arrived before their hold that are remembered at once
    (an id nobody holds costs an entry: a forged flood is bounded by this)."""

    early_notes_per_request: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    """Prefill side: notifications kept per such request (one per decode worker that reads it)."""

    early_note_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    """Prefill side: how long a notification waits for its request's hold before it is forgotten."""

    side_channel_max_answer_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 30)] = 16 * 1024 * 1024
    """Decode side: largest side-channel answer taken (a handshake reply: memory map, NIXL metadata, CUDA IPC
    handles); a larger one is cut, so a fake or broken peer cannot make a decode buffer gigabytes."""

    side_channel_sockets_per_thread: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    """Decode side: side-channel sockets a control thread keeps open (one per prefill worker address; the least
    recently used is closed beyond it): params naming many addresses cost at most this many descriptors a thread."""

    max_cached_engines: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    """Decode side: prefill engines kept connected (least recently used out first, once idle); also bounds the
    cached transfer plans and, times four, the engines remembered as dead."""

    dead_engine_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 10.0
    """Decode side: after a handshake to an engine failed, or a claim found its worker gone or silent, loads naming
    it fail at once for this long instead of each waiting out the deadlines; the first load after that connects
    again (0: every load tries again)."""

    claim_window_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 10.0
    """How long a claim of a request not held yet may wait for its hold (a worker without the hold feed, e.g. on
    another host than its engine's scheduler, learns of a hold one or two engine steps after the client got its
    kv_transfer_params, and a busy prefill engine's step can take seconds):
    the prefill worker keeps such a claim for half of one attempt's answer deadline (handshake_timeout_s) and
    answers it when the hold comes, or as not held once that half passed; the decode side sends a claim answered
    not held again for as long as this lasts. Never past the load's deadline. A prefill
    whose process is gone or silent ends the wait sooner (handshake_timeout_s), and so does a request freed there
    (a final refusal); a claim the prefill can only answer as not held (a wrong token, params of an earlier run
    without their issue time, a request freed before its last 4096) waits it out, holding one of
    claims_per_engine."""

    max_waiting_claims: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 1024
    """Prefill side: claims of requests not held yet kept waiting for their holds at once (each costs an entry
    until its hold or claim_window_s: a forged flood is bounded by this); beyond it a claim is refused at once.
    0: never wait (the decode side then retries)."""

    claims_per_engine: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    """Decode side: claims of one prefill engine on control threads at once, so a slow engine cannot take them
    all; the rest wait in that engine's own backlog."""

    max_remote_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 1 << 20
    """Decode side: most block ids kv_transfer_params may list (all groups together), refused before anything is
    checked further."""

    max_seen_params: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 65536
    """Decode side: kv_transfer_params remembered as used, so that a replay is refused (oldest forgotten first,
    each also once it expires)."""

    def check_role(self, producer: bool, consumer: bool) -> None:
        """Refuse settings that contradict each other for this role (ConfigError naming both keys)."""
        if self.nixl_staging_bytes and self.nixl_staging_bytes < 2 * self.nixl_staging_chunk_bytes:
            raise ConfigError(
                f"kv_connector_extra_config: nixl_staging_bytes ({self.nixl_staging_bytes}) must hold two chunks of "
                f"nixl_staging_chunk_bytes ({self.nixl_staging_chunk_bytes})"
            )
        if producer and consumer and self.lease_s < self.transfer_timeout_s + READ_MARGIN_S:
            raise ConfigError(
                f"kv_connector_extra_config: lease_s ({self.lease_s:g}) must exceed transfer_timeout_s "
                f"({self.transfer_timeout_s:g}) by at least {READ_MARGIN_S:g} s"
            )

    def check_exposure(self, has_key: bool) -> bool:
        """Whether the side channel may start: True if it is safe, False if it listens on loopback without a key
        (callers warn once). ConfigError if it would listen beyond loopback without a key."""
        if has_key:
            return True
        if is_loopback(self.side_channel_host):
            return False
        raise ConfigError(
            f"kv_connector_extra_config: side_channel_host {self.side_channel_host!r} is not a loopback address "
            "and no auth_key_file is set: anyone on that network could read every user's KV"
        )

    def check_auth(self, has_key: bool) -> None:
        """Refuse to run without a key unless `keyless_exposes_kv_to_local_processes` says so (ConfigError naming both
        fields), and refuse the flag beside a key (which one would apply?)."""
        if has_key and self.keyless_exposes_kv_to_local_processes:
            raise ConfigError(
                "kv_connector_extra_config: keyless_exposes_kv_to_local_processes is true but an auth key is set: "
                "drop one"
            )
        if not has_key and not self.keyless_exposes_kv_to_local_processes:
            raise ConfigError(
                "kv_connector_extra_config: no auth_key_file is set and keyless_exposes_kv_to_local_processes is "
                "false: set auth_key_file to the deployment key (kvbridge serve makes one), or "
                "keyless_exposes_kv_to_local_processes: true to let any local process handshake, read and write the KV"
            )

    def nixl_crosses_hosts(self, env_devices: str | None = None) -> bool:
        """Whether NIXL reads KV from other hosts: RDMA devices are named (in `ucx_net_devices`, or the
        environment's UCX_NET_DEVICES `env_devices`, which wins), or the operator opted into UCX tcp. Otherwise
        kvbridge's KV channel does."""
        if self.ucx_tcp_exposes_process_memory:
            return True
        devices = env_devices if env_devices is not None else self.ucx_net_devices
        return any(rdma_device(d) for d in _names(devices))

    def ucx_devices(self, default_interface: str | None, env_devices: str | None = None) -> str | None:
        """UCX_NET_DEVICES for NIXL ("all": UCX's own choice), or ConfigError naming the field that would put UCX's
        tcp beyond loopback without `ucx_tcp_exposes_process_memory`. `default_interface`: the interface of
        side_channel_host (None: none holds it); `env_devices`: the environment's UCX_NET_DEVICES (it wins)."""
        devices = self.ucx_net_devices
        if devices is None:
            devices = default_interface if self.ucx_tcp_exposes_process_memory else "lo"
            if devices is None:
                raise ConfigError(
                    f"kv_connector_extra_config: no network interface holds side_channel_host "
                    f'{self.side_channel_host!r}: set ucx_net_devices to the NIC(s) NIXL may use ("all": any)'
                )
        if self.ucx_tcp_exposes_process_memory:
            return devices
        for source, value in (("the environment's UCX_NET_DEVICES", env_devices), ("ucx_net_devices", devices)):
            if value is None:
                continue
            tcp = [d for d in _names(value) if d != "lo" and not rdma_device(d)]
            if tcp:
                raise ConfigError(
                    f"kv_connector_extra_config: {source} {value!r} names {', '.join(tcp)}, where UCX's tcp would "
                    "serve this process's memory to anyone who reaches it (no key, no registration check); name "
                    'RDMA devices ("mlx5_0:1") or lo, or set ucx_tcp_exposes_process_memory to true to accept that'
                )
            break  # the environment's value wins: the configured one is not used
        return devices

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> BridgeConfig:
        if extra and "insecure_no_auth" in extra:
            raise ConfigError(
                "kv_connector_extra_config: insecure_no_auth is now keyless_exposes_kv_to_local_processes "
                "(docs/security.md, Keyless mode)"
            )
        try:
            return msgspec.convert(dict(extra or {}), cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None


RDMA_DRIVERS = (
    "mlx4_",
    "mlx5_",
    "bnxt_re",
    "irdma",
    "i40iw",
    "efa",
    "rxe",
    "siw",
    "qedr",
    "hfi1_",
    "erdma_",
    "hns_",
    "cxgb4_",
    "ocrdma",
    "vmw_pvrdma",
    "mana_",
    "ionic_",
)
"""Name prefixes of RDMA devices (the kernel's RDMA drivers: /sys/class/infiniband/<device>)."""

_RDMA_NAME = re.compile("(?:" + "|".join(re.escape(p) for p in RDMA_DRIVERS) + ")[A-Za-z0-9_]*:[0-9]+")


def rdma_device(name: str) -> bool:
    """Whether a UCX device name is an RDMA device and port ("mlx5_0:1", "bnxt_re0:1", "rxe0:1"): an RDMA
    driver's device name, ":" and a port number. Not a network interface, nor an interface alias ("eth0",
    "eth0:1", "ib0:1": IPoIB is tcp)."""
    return _RDMA_NAME.fullmatch(name) is not None


def _names(devices: str | None) -> list[str]:
    return [d.strip() for d in (devices or "").split(",") if d.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
