"""A reader of kvbridge's KV channel as a test drives it: a StreamRead for a worker's LBHNC KV, and what a client
holding some key gets for it (the frames, and the error that ended the exchange)."""

from __future__ import annotations

import socket

from kvbridge.transport import kv_stream as ks
from kvbridge.wire import messages as wire
from kvbridge.wire import stream_messages as sm
from kvbridge.wire.keys import KeyRing


def stream_request(
    addr: int, nbytes: int, blocks: int, request_id: str, token: str, block_ids: list[int], engine_id: str = "decode"
) -> sm.StreamRead:
    """A read of `block_ids` of a two-layer LBHNC region (`addr`, `nbytes`) of `blocks` blocks per layer."""
    layer_bytes = nbytes // 2
    block_bytes = layer_bytes // blocks
    group = sm.StreamGroup(
        block_ids=tuple(block_ids),
        src_addr=(addr, addr + layer_bytes),
        block_stride=(block_bytes, block_bytes),
        length=(block_bytes, block_bytes),
    )
    return sm.StreamRead(
        request_id=request_id,
        engine_id=engine_id,
        worker=wire.Worker(),
        token=token,
        groups=(group,),
        chunk_bytes=1 << 16,
    )


def stream_read(host: str, port: int, key: bytes, request: sm.StreamRead) -> tuple[list, Exception | None]:
    """What a client with `key` gets for `request`: the frames (kind, index, bytes), and the error that ended it."""
    frames: list = []
    sock = socket.create_connection((host, port), timeout=5)
    try:
        current = KeyRing.of(key).current  # the key a decode worker sends with, named by its id
        conn = ks.client_handshake(sock, current.stream, key_id=current.key_id)
        conn.send(ks.KIND_MESSAGE, 0, sm.encode(request))
        while True:
            kind, index, payload = conn.recv(1 << 24)
            frames.append((kind, index, bytes(payload)))
            if kind == ks.KIND_MESSAGE:
                return frames, None
    except Exception as exc:
        return frames, exc
    finally:
        sock.close()
