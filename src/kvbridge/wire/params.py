"""The `kv_transfer_params` protocol, as vLLM's NixlConnector speaks it, so existing PD proxies work unchanged.

1. The client (or proxy) sends the prompt to a prefill server with `max_tokens=1` and
   `kv_transfer_params: {"do_remote_decode": true}`.
2. The prefill server's response carries `kv_transfer_params` (`PrefillDone` below): where the prompt's KV is
   and how the prefill instance is laid out.
3. The client sends the same prompt to a decode server with those params; it reads the KV and generates.

Fields of the prefill response (all of NixlConnector's that a decode side needs, plus kvbridge's):
    do_remote_prefill   true: the decode side must fetch the prompt's KV
    do_remote_decode    false
    remote_engine_id    the prefill engine's id (one per DP rank)
    remote_request_id   the request id on the prefill engine (the key its blocks are held under)
    remote_block_ids    the prefill engine's block ids of the prompt, in order
    remote_host         side-channel address of the prefill instance
    remote_port         side-channel base port; each worker listens on a port derived from it
    remote_dp_rank      the prefill engine's DP rank (kvbridge)
    remote_layout       the prefill layout, e.g. "pp=2,tp=1" (kvbridge)
    remote_num_tokens   prompt tokens whose KV the prefill computed
    tp_size, pp_size    the prefill layout as NixlConnector reports it
    kvbridge_protocol   kvbridge's wire protocol version (kvbridge)
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec

from kvbridge.core.errors import LayoutError, RequestParamsError
from kvbridge.core.topology import ParallelLayout
from kvbridge.wire.messages import PROTOCOL_VERSION

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class PrefillDone(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill instance returns and a decode instance receives (see the module docstring)."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[NonNegative]
    remote_host: str
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    remote_dp_rank: NonNegative = 0
    remote_layout: str
    remote_num_tokens: NonNegative = 0
    tp_size: int = 1
    pp_size: int = 1
    kvbridge_protocol: int = PROTOCOL_VERSION

    @property
    def layout(self) -> ParallelLayout:
        return _parse_layout(self.remote_layout)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


@functools.lru_cache(maxsize=64)
def _parse_layout(text: str) -> ParallelLayout:
    """Deployments use a handful of layouts; parsing each once keeps the scheduler's per-request cost low."""
    return ParallelLayout.parse(text)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Prefill side: did the client ask us to hand the KV to a decode instance?"""
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """Decode side: did the client bring a prefill instance's KV location?"""
    return bool(params) and bool(params.get("do_remote_prefill"))


def parse_prefill_done(params: dict[str, Any]) -> PrefillDone:
    """Validate a decode request's kv_transfer_params; RequestParamsError names the bad field."""
    raw = dict(params)
    blocks = raw.get("remote_block_ids")
    # NixlConnector sends one list per KV cache group; a model with one group sends [[...]].
    if isinstance(blocks, list | tuple) and len(blocks) == 1 and isinstance(blocks[0], list | tuple):
        raw["remote_block_ids"] = list(blocks[0])
    if "remote_layout" not in raw and "tp_size" in raw:
        raw["remote_layout"] = f"pp={raw.get('pp_size', 1)},tp={raw['tp_size']}"
    try:
        done = msgspec.convert(raw, PrefillDone)
    except msgspec.ValidationError as exc:
        raise RequestParamsError(f"kv_transfer_params: {exc}") from None
    try:
        layout = done.layout
    except LayoutError as exc:
        raise RequestParamsError(f"kv_transfer_params: remote_layout: {exc}") from None
    if done.remote_dp_rank >= layout.dp and layout.dp > 1:
        raise RequestParamsError(
            f"kv_transfer_params: remote_dp_rank {done.remote_dp_rank} is outside the layout's dp={layout.dp}"
        )
    if done.kvbridge_protocol != PROTOCOL_VERSION:
        raise RequestParamsError(
            f"kv_transfer_params: kvbridge_protocol is {done.kvbridge_protocol} but this side speaks {PROTOCOL_VERSION}"
        )
    return done
