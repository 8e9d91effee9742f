"""The KV channel's messages (`transport.kv_stream` carries them in sealed frames): tagged msgspec structs.

A decode worker asks a prefill worker for its part of a request it has claimed (`StreamRead`); the prefill worker
answers with the part's chunks as data frames (frame index = chunk number), then `StreamEnd`. Schema evolution
follows `wire.messages` (new fields get defaults, tags never change, `STREAM_VERSION` for what an older peer cannot
read).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.core.errors import ProtocolError
from kvbridge.wire.messages import MAX_STAGE_SEGMENTS, Address, Id, NonNegative, Positive, Secret, Worker

STREAM_VERSION = 1


class StreamGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One KV-cache group's part: runs `length[k]` bytes at `src_addr[k] + b * block_stride[k]` for every block b
    of `block_ids`, in that order (segment-major, `core.staging.StageLayout`)."""

    block_ids: Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=1 << 16)] = ()
    src_addr: Annotated[tuple[Address, ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)] = ()
    block_stride: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)], ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)
    ] = ()
    length: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)], ...], msgspec.Meta(max_length=MAX_STAGE_SEGMENTS)
    ] = ()


class StreamRead(msgspec.Struct, frozen=True, kw_only=True, tag="stream_read"):
    """Decode worker -> prefill worker, after a granted claim: send my part of `request_id` (every group's runs, in
    group order, cut into chunks of at most `chunk_bytes`, at least 64 KiB: the claim is re-checked per chunk).
    `first` and `step`: only chunks first, first + step, ... (a part split over several connections). Checked against
    the claim (token, reader, blocks) and the worker's registered memory before a byte is gathered."""

    version: int = STREAM_VERSION
    request_id: Id
    engine_id: Id
    worker: Worker
    token: Secret = ""
    groups: Annotated[tuple[StreamGroup, ...], msgspec.Meta(max_length=64)] = ()
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1 << 16)] = 1 << 16
    first: NonNegative = 0
    step: Positive = 1


class StreamEnd(msgspec.Struct, frozen=True, kw_only=True, tag="stream_end"):
    """Prefill worker -> decode worker: the part was sent (`chunks` data frames), or why not (`error`)."""

    request_id: str = ""
    chunks: NonNegative = 0
    error: str = ""


StreamMessage = StreamRead | StreamEnd

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamMessage)


def encode(message: StreamMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | bytearray | memoryview) -> StreamMessage:
    try:
        return _decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"kv stream: undecodable message: {exc}") from None
