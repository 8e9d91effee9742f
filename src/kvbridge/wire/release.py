"""Free a prefill request's blocks from outside the decode instance: the proxy's path when a decode leg fails or
never happens (client gone, decode 5xx) after its prefill leg succeeded.

The request's `kv_transfer_params` say where its prefill workers listen and carry its token; an `Abort` with that
token to every worker of the engine frees the blocks at once instead of at the lease's end. With a deployment
key the params must be signed by it (so a client cannot point the release anywhere) and the messages are sealed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvbridge.core.errors import RequestParamsError
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.keys import KeyRing
from kvbridge.wire.params import parse_prefill_done
from kvbridge.wire.side_channel import side_channel_port
from kvbridge.wire.side_channel_client import SideChannelClient

logger = logging.getLogger(__name__)

RELEASER = "kvbridge-release"
"""The engine id releases are sent under (no decode engine is called that)."""


def release_prefill(
    params: Mapping[str, Any], key: bytes | KeyRing | None, timeout_s: float = 2.0, reason: str = ""
) -> int:
    """Send an Abort for the request `params` name to each of its prefill workers; the number that took it.

    Never raises: a release is an optimisation (the lease frees the blocks anyway), so bad params or an
    unreachable worker only log a warning and count as not taken."""
    try:
        done = parse_prefill_done(dict(params))
        if key is not None and not done.verify(key):
            raise RequestParamsError("kv_transfer_params: kvbridge_sig does not match the params")
        layout = done.layout
        targets = [
            (done.remote_host, side_channel_port(done.remote_port, layout, done.remote_dp_rank, rank))
            for rank in layout.workers()
        ]
        identities = [(done.remote_engine_id, done.remote_dp_rank, rank.pp, rank.tp) for rank in layout.workers()]
    except (RequestParamsError, ValueError) as exc:
        logger.warning("kvbridge: not releasing a prefill request: %s", exc)
        return 0
    message = wire.Abort(
        request_id=done.remote_request_id,
        engine_id=RELEASER,
        worker=wire.Worker(),
        reason=reason,
        token=done.remote_token,
    )
    client = SideChannelClient(timeout_s=timeout_s, retries=0, sealer=Sealer(key) if key is not None else None)
    try:
        answers = client.exchange_all(targets, message, identities)
    finally:
        client.close()
    taken = sum(isinstance(a, wire.Ack) for a in answers)
    if taken < len(targets):
        logger.warning(
            "kvbridge: release of %s reached %d of %d prefill workers", done.remote_request_id, taken, len(targets)
        )
    return taken
