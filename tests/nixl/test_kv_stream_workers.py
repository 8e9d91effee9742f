"""kvbridge's KV channel between a real keyed PrefillWorker and DecodeWorker (real NIXL agents, real side channel,
loopback). The decode is made to see the prefill as another host (its host id), which is what picks the channel:
loads arrive exact, the prefill frees each request on the decode's Notify, and the decode never loads the prefill's
NIXL agent. A reader without a granted claim, the token, or the key gets no byte of KV."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime import peers as peers_module
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.transport import kv_stream as ks
from kvbridge.wire import stream_messages as sm
from kvbridge.wire.params import PrefillDone
from support.kv_channel_client import stream_read, stream_request

pytestmark = pytest.mark.nixl

KEY = b"kv-stream-test-deployment-key-32"
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
BLOCKS = 64
SHAPE = (2, BLOCKS, 2, GEOMETRY.block_size, 2 * GEOMETRY.head_size)  # LBHNC
READ = 12


class Pair:
    def __init__(self, **extra) -> None:
        self.config = BridgeConfig(
            side_channel_port=free_base_port(1), lease_s=30, kv_stream_chunk_bytes=1 << 16, **extra
        )
        layout = ParallelLayout()
        gen = torch.Generator().manual_seed(27)
        self.src_kv = torch.randn(SHAPE, generator=gen)
        self.dst_kv = torch.full(SHAPE, float("nan"))
        memory = lambda kv: synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, BLOCKS, kv.data_ptr())  # noqa: E731
        self.prefill = PrefillWorker(
            WorkerIdentity("prefill", layout, 0, WorkerRank(0, 0), GEOMETRY), memory(self.src_kv), self.config, key=KEY
        ).start()
        self.decode = DecodeWorker(
            WorkerIdentity("decode", layout, 0, WorkerRank(0, 0), GEOMETRY), memory(self.dst_kv), self.config, key=KEY
        ).start()
        self.rng = np.random.default_rng(27)
        self.n = 0

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def hold(self) -> tuple[str, str, list[int]]:
        self.n += 1
        request_id, token = f"req-{self.n}", os.urandom(16).hex()
        src = [int(b) for b in self.rng.permutation(BLOCKS)[:READ]]
        self.prefill.hold(request_id, (tuple(src),), token=token, prompt_hash="h")
        return request_id, token, src

    def load(self) -> tuple[bool, list[int], list[int]]:
        """One request moved: (loaded, source blocks, destination blocks)."""
        request_id, token, src = self.hold()
        dst = [int(b) for b in self.rng.permutation(BLOCKS)[:READ]]
        self.dst_kv[:, dst] = float("nan")
        source = PrefillDone(
            remote_engine_id="prefill",
            remote_request_id=request_id,
            remote_block_ids=src,
            remote_host="127.0.0.1",
            remote_port=self.config.side_channel_port,
            remote_layout="pp=1,tp=1",
            remote_token=token,
            remote_prompt_hash="h",
        )
        self.decode.load(LoadJob(f"d-{request_id}", source, (tuple(dst),), (tuple(src),)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, failed, _ = self.decode.results(wait_s=0.05)
            if f"d-{request_id}" in failed:
                return False, src, dst
            if f"d-{request_id}" in done:
                return True, src, dst
        raise AssertionError(f"{request_id} never finished")

    def exact(self, src: list[int], dst: list[int]) -> bool:
        return torch.equal(self.dst_kv[:, dst], self.src_kv[:, src])

    def wait_held(self, n: int, timeout_s: float = 10.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.prefill.lease_counts()["held"] != n and time.monotonic() < deadline:
            self.prefill.finished()
            time.sleep(0.01)
        return self.prefill.lease_counts()["held"]


@pytest.fixture
def another_host(monkeypatch):
    """The decode sees every prefill worker as on another host (what the side channel's host id says)."""
    monkeypatch.setattr(peers_module, "host_id", lambda: "another-host")


@pytest.fixture
def pair(another_host):
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_loads_from_another_host_cross_the_kv_channel_exact(pair):
    for _ in range(8):
        loaded, src, dst = pair.load()
        assert loaded and pair.exact(src, dst)
    assert pair.wait_held(0) == 0, "the decode's Notify freed every request"
    engine = pair.decode.peers.all_engines()[0]
    assert engine.stream and engine.peers[WorkerRank(0, 0)].stream_port == pair.prefill.stream.port
    assert pair.decode.nixl.transport.peers == {} or not pair.decode.nixl.transport.peers, "no NIXL agent loaded"
    assert pair.prefill.stream.counts["parts"] >= 8 and pair.decode.stream.bytes > 0


def test_the_same_host_still_reads_over_nixl():
    """The control of the path choice: without the other host id the same pair reads through NIXL (shared memory)."""
    p = Pair()
    try:
        loaded, src, dst = p.load()
        assert loaded and p.exact(src, dst)
        engine = p.decode.peers.all_engines()[0]
        assert not engine.stream and p.prefill.stream.counts["parts"] == 0
    finally:
        p.close()


def _stream_read(port: int, key: bytes, request: sm.StreamRead) -> tuple[list, Exception | None]:
    return stream_read("127.0.0.1", port, key, request)


def _request(pair: Pair, request_id: str, token: str, src: list[int], engine_id: str = "decode") -> sm.StreamRead:
    region = pair.prefill.memory.regions[0]
    return stream_request(region.addr, region.nbytes, BLOCKS, request_id, token, src, engine_id)


def _claim(pair: Pair, request_id: str, token: str, src: list[int]) -> None:
    from kvbridge.core.leases import groups_digest

    with pair.prefill._lock:
        refused = pair.prefill._leases.claim(
            request_id, token, "h", (tuple(src),), "decode", 20.0, pair.prefill.clock(), groups_digest((tuple(src),))
        )
    assert not refused, refused


def test_a_key_holder_without_a_granted_claim_or_the_token_gets_no_kv(pair):
    request_id, token, src = pair.hold()
    port = pair.prefill.stream.port
    frames, err = _stream_read(port, KEY, _request(pair, request_id, token, src))  # held, not claimed
    assert err is None and [f[0] for f in frames] == [ks.KIND_MESSAGE]
    assert sm.decode(frames[0][2]) == sm.StreamEnd(request_id=request_id, error="not_claimed")
    _claim(pair, request_id, token, src)
    for wrong in (
        _request(pair, request_id, "0" * 32, src),  # wrong token
        _request(pair, request_id, token, src, engine_id="another-reader"),  # not the claiming reader
        _request(pair, request_id, token, [b for b in range(BLOCKS) if b not in src][:READ]),  # other blocks
    ):
        frames, err = _stream_read(port, KEY, wrong)
        assert [f[0] for f in frames] == [ks.KIND_MESSAGE] and sm.decode(frames[0][2]).error == "not_claimed"
    # the control: the claiming reader with the token gets the blocks, byte for byte
    frames, err = _stream_read(port, KEY, _request(pair, request_id, token, src))
    data = b"".join(f[2] for f in frames if f[0] == ks.KIND_DATA)
    want = pair.src_kv[:, src].contiguous().numpy().tobytes()
    assert err is None and data == want and sm.decode(frames[-1][2]).chunks == len(frames) - 1


def test_runs_outside_the_registered_kv_are_refused(pair):
    request_id, token, src = pair.hold()
    _claim(pair, request_id, token, src)
    region = pair.prefill.memory.regions[0]
    request = _request(pair, request_id, token, src)
    group = request.groups[0]
    outside = sm.StreamGroup(
        block_ids=group.block_ids, src_addr=(region.addr + region.nbytes,), block_stride=(64,), length=(64,)
    )
    frames, _err = _stream_read(
        pair.prefill.stream.port, KEY, sm.StreamRead(**{**_fields(request), "groups": (outside,)})
    )
    assert [f[0] for f in frames] == [ks.KIND_MESSAGE] and sm.decode(frames[0][2]).error.startswith("outside")


def test_a_claimed_block_with_forged_runs_reads_no_other_block(pair):
    """A claim on some blocks, and runs forged so that they reach other blocks (shifted address, stretched stride,
    a length over several blocks): refused before a byte is read. Control: the honest runs get exactly the claimed
    blocks."""
    request_id, token, src = pair.hold()
    _claim(pair, request_id, token, src)
    region = pair.prefill.memory.regions[0]
    layer_bytes = region.nbytes // 2
    block_bytes = layer_bytes // BLOCKS
    other = next(b for b in range(BLOCKS) if b not in src)
    request = _request(pair, request_id, token, src)
    honest = request.groups[0]
    shift = (other - src[0]) * block_bytes
    forged = (
        (tuple(a + shift for a in honest.src_addr), honest.block_stride, honest.length),  # another block's address
        (honest.src_addr, tuple(2 * s for s in honest.block_stride), honest.length),  # a stretched stride
        (honest.src_addr, honest.block_stride, tuple(2 * n for n in honest.length)),  # two blocks per run
        ((region.addr + block_bytes // 2,), (block_bytes,), (block_bytes,)),  # a run across a block's end
    )
    for addr, stride, length in forged:
        group = sm.StreamGroup(block_ids=honest.block_ids, src_addr=addr, block_stride=stride, length=length)
        frames, err = _stream_read(
            pair.prefill.stream.port, KEY, sm.StreamRead(**{**_fields(request), "groups": (group,)})
        )
        assert err is None and [f[0] for f in frames] == [ks.KIND_MESSAGE], (addr, stride, length)
        assert sm.decode(frames[0][2]).error.startswith("outside"), sm.decode(frames[0][2])
    frames, err = _stream_read(pair.prefill.stream.port, KEY, request)
    data = b"".join(f[2] for f in frames if f[0] == ks.KIND_DATA)
    assert err is None and data == pair.src_kv[:, src].contiguous().numpy().tobytes()


def test_without_the_key_the_channel_sends_nothing_but_its_handshake(pair):
    request_id, token, src = pair.hold()
    _claim(pair, request_id, token, src)
    frames, err = _stream_read(
        pair.prefill.stream.port, b"not-the-deployment-key-32-bytes!", _request(pair, request_id, token, src)
    )
    assert frames == [] and isinstance(err, ks.StreamAuthError)
    # a raw client that never proves the key: 4 + 1 + 32 + 32 bytes and then the connection is closed
    sock = socket.create_connection(("127.0.0.1", pair.prefill.stream.port), timeout=5)
    sock.sendall(
        ks.HELLO.pack(ks.MAGIC, 1, bytes(ks.KEY_ID_BYTES), bytes(32))
        + bytes(32)
        + sm.encode(_request(pair, request_id, token, src))
    )
    got = b""
    while chunk := sock.recv(1 << 16):
        got += chunk
    assert len(got) == ks.ANSWER.size
    deadline = time.monotonic() + 5  # the server's threads count as they close
    while pair.prefill.stream.counts["unauthenticated"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.prefill.stream.counts["unauthenticated"] >= 2 and pair.prefill.stream.counts["parts"] == 0


def _fields(request):
    return {f: getattr(request, f) for f in request.__struct_fields__}
