"""The side channel: every prefill worker answers handshakes (and later messages) on its own TCP port.

Three layers, I/O only in the last:
- addresses: `side_channel_port` gives every (dp, pp, tp) prefill worker its own port; the prefill worker
  binds it and the decode side connects to it by the same computation (vLLM's seed bug: ports that ignored
  the pp rank collided across stages, and the two sides computed them differently);
- protocol: `respond(data, handler)` maps one received message to the bytes of its answer, and
  `handshake_handler(reply)` is the handler of a prefill worker; both are pure and tested without sockets;
- ZMQ shell: `side_channel_server.SideChannelServer` (a ROUTER socket served by a daemon thread), which bounds
  its connections with `side_channel_connections.ConnectionBound`; the client side, `exchange` /
  `fetch_handshake` (a DEALER socket per attempt, bounded retries and timeouts) and `SideChannelClient`
  (one thread's DEALER sockets kept per address, several peers asked at once: claims and notifications), is in
  `side_channel_client`.

This module holds the first two layers, and the bounds and names both ends share.

Every wait is a poll with a timeout: nothing spins, and a stopped server's thread ends within one poll.

With a deployment key (`wire.auth.Sealer`) every frame is sealed (encrypted and authenticated): a server drops,
without an answer, anything not sealed with its key for its own identity (`SideChannelServer.identity`) or seen
before, and an answer is accepted only for the request it answers. Sizes are bounded on both ends (a frame a
server takes, an answer a client takes, messages queued per peer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvbridge.core.errors import (
    IncompatiblePeerError,
    KVBridgeError,
    LayoutError,
    ProtocolError,
)
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire
from kvbridge.wire.later import Later

logger = logging.getLogger(__name__)

MAX_PORT = 65535
DEFAULT_HOST = "127.0.0.1"
# The defaults of the bounds below are BridgeConfig's (side_channel_max_frame_bytes and its neighbours), which
# the workers pass in; tests/nixl/test_config_bounds.py checks that both agree.
MAX_REQUEST_BYTES = 256 * 1024
"""Largest frame a side-channel server takes: a handshake request describes one decode worker's memory (a few
hundred bytes a layer); claims and notifications are far smaller."""
MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""Largest answer a client takes (a handshake reply: memory map, NIXL metadata, CUDA IPC handles)."""
QUEUED_PER_PEER = 16
"""Messages ZMQ queues per connection (its default, 1000, times the frame size is what a flood could pin)."""
MAX_CONNECTIONS = 512
"""Connections a side-channel server keeps open at once. Each may pin up to QUEUED_PER_PEER frames of
MAX_REQUEST_BYTES, so this bounds what a connection flood can pin. A decode worker keeps one connection per
control thread (8) to each prefill worker it reads from: 512 serves 64 decode ranks."""
DROP_WARNING_S = 60.0
"""Dropped (unauthenticated, misaddressed, replayed...) frames are logged at most once in this many seconds."""
MAX_CONNECTIONS_PER_ADDRESS = 128
"""Connections one source address keeps open at once (a decode host of 8 GPUs x 8 control threads needs 64)."""

Identity = tuple[str, int, int, int]
"""A prefill worker's identity a sealed request is bound to: (engine id, dp rank, pp rank, tp rank)."""
NO_IDENTITY: Identity = ("", 0, 0, 0)


Handler = Callable[[wire.Message], "wire.Message | Later"]
"""Answers one decoded message, now or `Later`; called on the server's thread. May raise: the peer then gets an
error."""


# --- addresses --------------------------------------------------------------------------------------------


def side_channel_port(base_port: int, layout: ParallelLayout, dp_rank: int, rank: WorkerRank) -> int:
    """The side-channel port of prefill worker `rank` of engine `dp_rank`.

    It is base_port + (dp_rank * pp + rank.pp) * tp + rank.tp, for the prefill engine's layout.
    Every worker of the layout gets its own port, in [base_port, base_port + dp*pp*tp). Raises LayoutError
    for a rank outside the layout, or if the layout's range of ports does not fit below 65536 (checked for
    the whole range, so every worker fails alike).
    """
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not 1 <= base_port <= MAX_PORT:
        raise LayoutError(f"base_port must be in [1, {MAX_PORT}], got {base_port!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < layout.dp:
        raise LayoutError(f"dp rank {dp_rank!r} is outside dp={layout.dp}")
    layout.check_rank(rank)
    workers = layout.dp * layout.workers_per_engine
    if base_port + workers - 1 > MAX_PORT:
        raise LayoutError(
            f"side-channel ports {base_port}..{base_port + workers - 1} of layout {layout} "
            f"({workers} workers) exceed {MAX_PORT}: use a base_port of at most {MAX_PORT - workers + 1}"
        )
    return base_port + (dp_rank * layout.pp + rank.pp) * layout.tp + rank.tp


def side_channel_ports(base_port: int, layout: ParallelLayout) -> dict[tuple[int, WorkerRank], int]:
    """The port of every (dp rank, worker) of `layout`."""
    return {
        (dp, rank): side_channel_port(base_port, layout, dp, rank)
        for dp in range(layout.dp)
        for rank in layout.workers()
    }


def endpoint(host: str, port: int) -> str:
    """The ZMQ TCP endpoint of (host, port); IPv6 literals are bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# --- protocol (pure) --------------------------------------------------------------------------------------


def handshake_handler(reply: wire.HandshakeReply, on_message: Handler | None = None) -> Handler:
    """A prefill worker's handler: handshakes are answered from `reply`, other messages go to `on_message`."""

    def handle(message: wire.Message) -> wire.Message:
        match message:
            case wire.HandshakeRequest():
                return wire.answer_handshake(reply, message)
            case _ if on_message is not None:
                return on_message(message)
            case _:
                return wire.ErrorReply(
                    message=f"this side channel does not handle {type(message).__name__}",
                    reason=wire.Refusal.UNEXPECTED,
                )

    return handle


def respond(data: bytes, handler: Handler) -> bytes | Later:
    """The encoded answer to one received message (or the handler's `Later`); never raises.

    Undecodable bytes get an ErrorReply, or a HandshakeRefused on protocol_version when they carry another
    version. A handler that raises IncompatiblePeerError refuses; any other exception becomes an ErrorReply.
    """
    try:
        message = wire.decode(data)
    except ProtocolError as exc:
        version = wire.peer_version(data)
        if version is not None and version != wire.PROTOCOL_VERSION:
            refusal = IncompatiblePeerError("protocol_version", wire.PROTOCOL_VERSION, version)
            return wire.encode(wire.HandshakeRefused.from_error(refusal))
        return wire.encode(wire.ErrorReply(message=str(exc)))
    try:
        answer = handler(message)
        return answer if isinstance(answer, Later) else wire.encode(answer)
    except IncompatiblePeerError as exc:
        return wire.encode(wire.HandshakeRefused.from_error(exc))
    except KVBridgeError as exc:
        return wire.encode(wire.ErrorReply(message=str(exc)))
    except Exception as exc:
        logger.exception("side-channel handler failed on %s", type(message).__name__)
        return wire.encode(wire.ErrorReply(message=f"internal error on {type(message).__name__}: {exc!r}"))
