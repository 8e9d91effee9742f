"""What authentication costs on the side channel: handshake and claim round trips to a real PrefillWorker (real
NIXL agent, real ZMQ on loopback), with and without a deployment key, interleaved in one run.

    .venv/bin/python bench/auth_cost.py [--rounds 300] [--out bench/results]

Prints and saves medians and p90s per (message, key on/off) and their ratio. The PD TTFT with authentication on
and off is measured by bench/ttft_compare.py's servers; this isolates the side channel.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import blocks_digest
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.side_channel import SideChannelClient, exchange

GEOMETRY = KVGeometry(num_layers=28, num_kv_heads=4, head_size=128, dtype="bfloat16", block_size=16)
KEY = b"bench-deployment-key-0123456789ab"


def worker(key: bytes | None) -> PrefillWorker:
    kv = torch.zeros(1 << 20, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, range(28), 4, 64, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1))
    w = PrefillWorker(WorkerIdentity("p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config, key=key)
    w._kv = kv
    return w.start()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    workers = {"off": worker(None), "on": worker(KEY)}
    memory = synthesize_memory("LBHNC", GEOMETRY, range(28), 4, 64, 1 << 30)
    request = wire.HandshakeRequest.build(
        "d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY, "LBHNC", memory, target=(0, WorkerRank(0, 0))
    )
    clients = {name: SideChannelClient(timeout_s=5, sealer=Sealer(KEY) if name == "on" else None) for name in workers}
    times: dict[str, list[float]] = {f"{m}/{k}": [] for m in ("handshake", "claim") for k in workers}
    try:
        for w in workers.values():
            w.hold("r", (tuple(range(64)),), token="tok", prompt_hash="h")
        for _ in range(args.rounds):
            for name, w in workers.items():  # interleaved: the same machine state for both
                sealer = Sealer(KEY) if name == "on" else None
                t0 = time.perf_counter()
                reply = exchange("127.0.0.1", w.port, request, timeout_s=5, sealer=sealer, identity=("p", 0, 0, 0))
                times[f"handshake/{name}"].append(time.perf_counter() - t0)
                assert isinstance(reply, wire.HandshakeReply), reply
                claim = wire.Claim(
                    request_id="r", block_ids=tuple(range(64)), engine_id="d", worker=wire.Worker(),
                    token="tok", prompt_hash="h", read_timeout_s=10, blocks_digest=blocks_digest(tuple(range(64))),
                )  # fmt: skip
                t0 = time.perf_counter()
                (answer,) = clients[name].exchange_all([("127.0.0.1", w.port)], claim, [("p", 0, 0, 0)])
                times[f"claim/{name}"].append(time.perf_counter() - t0)
                assert isinstance(answer, wire.Ack), answer
    finally:
        for c in clients.values():
            c.close()
        for w in workers.values():
            w.close()
    summary = {}
    for key, values in times.items():
        values.sort()
        summary[key] = {
            "median_us": round(1e6 * statistics.median(values), 1),
            "p90_us": round(1e6 * values[int(0.9 * (len(values) - 1))], 1),
        }
    for m in ("handshake", "claim"):
        summary[f"{m}/ratio_on_off"] = round(summary[f"{m}/on"]["median_us"] / summary[f"{m}/off"]["median_us"], 3)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}",
        "rounds": args.rounds,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"auth-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
