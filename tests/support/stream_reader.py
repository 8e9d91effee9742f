"""A decode worker's KV channel reads (`runtime.stream_reads.StreamReads`) against a real `KvStreamServer`, with
host memory on both sides: `Side` (the blocks), `Reader` (the reads and what they reported), `SilentAfter` (a server
that goes silent mid-load)."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.peers import Engine, Peer
from kvbridge.runtime.stream_reads import StreamReads
from kvbridge.runtime.stream_server import KvStreamServer
from kvbridge.transport.kv_stream import stream_key
from kvbridge.wire.params import PrefillDone

KEY = b"stream-reads-unit-test-key-0123456789"
GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=2, head_size=16, dtype="float32", block_size=4)
BLOCKS = 128
RANK = WorkerRank(0, 0)


class Side:
    def __init__(self, seed: int | None) -> None:
        probe = synthesize_memory("LBHNC", GEOMETRY, list(range(4)), 2, BLOCKS, 0)
        n = probe.regions[0].nbytes
        self.buf = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8) if seed else np.zeros(n, np.uint8)
        self.memory = synthesize_memory("LBHNC", GEOMETRY, list(range(4)), 2, BLOCKS, self.buf.ctypes.data)

    def block(self, b: int) -> np.ndarray:
        per = self.buf.nbytes // (4 * BLOCKS)
        return np.concatenate(
            [self.buf[(layer * BLOCKS + b) * per : (layer * BLOCKS + b + 1) * per] for layer in range(4)]
        )


class Reader:
    def __init__(self, port: int, src: Side, **extra) -> None:
        self.src, self.dst = src, Side(None)
        config = BridgeConfig(kv_stream_chunk_bytes=1 << 16, **extra)
        layout = ParallelLayout()
        self.done: dict[str, str] = {}
        self.unreachable: list[tuple[Engine, str]] = []
        self.event = threading.Event()
        self.reads = StreamReads(
            WorkerIdentity("decode", layout, 0, RANK, GEOMETRY),
            self.dst.memory,
            config,
            KEY,
            loaded=lambda load: self._report(load, ""),
            failed=lambda load, error: self._report(load, error),
            unreachable=lambda engine, why: self.unreachable.append((engine, why)),
        ).start()
        peer = Peer("p", self.src.memory, "e", stream_port=port)
        self.engine = Engine(("p", "127.0.0.1", 1, 0), layout, {RANK: peer}, make_plan(layout, layout, GEOMETRY))
        self.engine.stream = True

    def _report(self, load, error: str) -> None:
        self.done[load.job.request_id] = error
        self.reported_at = time.monotonic()
        self.event.set()

    def load(self, request_id: str, src: list[int], dst: list[int], timeout_s: float = 10.0) -> str:
        self.launch(request_id, src, dst)
        assert self.event.wait(timeout_s)
        return self.done[request_id]

    def launch(
        self, request_id: str, src: list[int], dst: list[int], deadline_s: float = 20.0, host: str = "127.0.0.1"
    ) -> None:
        """Start a load whose deadline is `deadline_s` away, from the prefill at `host`; `event` is set when it is
        reported."""
        source = PrefillDone(
            remote_engine_id="p",
            remote_request_id=request_id,
            remote_block_ids=src,
            remote_host=host,
            remote_port=1,
            remote_layout="pp=1,tp=1",
            remote_token="t",
        )
        now = time.monotonic()
        self.event.clear()
        job = LoadJob(request_id, source, (tuple(dst),), (tuple(src),))
        self.reads.launch(Load(job, now, now + deadline_s, self.engine))


class SilentAfter:
    """A server whose claim check (`still`, before every chunk) blocks on `gate` from its `after`-th call on: it
    sends nothing more while its connections stay open, as a prefill whose host was stopped mid-transfer."""

    def __init__(self, after: int) -> None:
        self.src = Side(5)
        self.after = after
        self.gate = threading.Event()
        self.calls = 0
        self.silent_at = 0.0
        self.server = KvStreamServer(self.src.memory, stream_key(KEY), lambda r: 1e18, still=self._still).start()

    def _still(self, request) -> bool:
        self.calls += 1
        if self.calls >= self.after:
            if not self.silent_at:
                self.silent_at = time.monotonic()
            self.gate.wait(30)
        return True

    def close(self) -> None:
        self.gate.set()
        self.server.close()

    def resume_leaves(self, reader: Reader) -> bool:
        """Let the server send again (into the reader's shut connections, its load reported failed) and say
        whether the reader's blocks stayed as they were."""
        before = reader.dst.buf.copy()
        self.gate.set()
        time.sleep(0.5)
        return bool(np.array_equal(reader.dst.buf, before))
