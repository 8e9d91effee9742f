"""What authentication costs on the side channel: handshake and claim round trips to a real PrefillWorker (real
NIXL agent, real ZMQ on loopback), with and without a deployment key, interleaved in one run.

    .venv/bin/python bench/auth_cost.py [--rounds 300] [--out bench/results]
    .venv/bin/python bench/auth_cost.py --seal [--out bench/results]

Prints and saves medians and p90s per (message, key on/off) and their ratio. The PD TTFT with authentication on
and off is measured by bench/ttft_compare.py's servers; this isolates the side channel.

`--seal`: the cost of sealing and opening one frame (16 MiB, and a 512-byte frame: a claim or notification),
side by side in one run: the format-2 seal (a SHAKE-256 keystream with HMAC-SHA256, rebuilt here as it was, for
the comparison only), `cryptography`'s ChaCha20-Poly1305 and AES-256-GCM, and `wire.auth.Sealer` as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
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
from kvbridge.wire.side_channel_client import SideChannelClient, exchange

GEOMETRY = KVGeometry(num_layers=28, num_kv_heads=4, head_size=128, dtype="bfloat16", block_size=16)
KEY = b"bench-deployment-key-0123456789ab"


def worker(key: bytes | None) -> PrefillWorker:
    kv = torch.zeros(1 << 20, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, range(28), 4, 64, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1))
    w = PrefillWorker(WorkerIdentity("p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config, key=key)
    w._kv = kv
    return w.start()


def old_seal_open(body: bytes) -> bytes:
    """The format-2 seal and open (encrypt-then-MAC: SHAKE-256 keystream XOR, HMAC-SHA256), for comparison."""
    enc, mac_key, nonce = hashlib.sha256(b"e" + KEY).digest(), hashlib.sha256(b"m" + KEY).digest(), os.urandom(16)

    def crypt(data: bytes) -> bytes:
        stream = hashlib.shake_256(enc + b"Q" + nonce).digest(len(data))
        return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")

    sealed = b"KVB2Q" + nonce + crypt(body)
    frame = sealed + hmac.new(mac_key, sealed, hashlib.sha256).digest()
    assert hmac.compare_digest(frame[-32:], hmac.new(mac_key, frame[:-32], hashlib.sha256).digest())
    return crypt(frame[21:-32])


def seal_costs(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    aead_key = os.urandom(32)
    header = os.urandom(53)

    def aead(cls):
        cipher = cls(aead_key)

        def seal_open(body: bytes) -> bytes:
            nonce = os.urandom(12)
            return cipher.decrypt(nonce, cipher.encrypt(nonce, body, header), header)

        return seal_open

    client, server = Sealer(KEY, clock=lambda: 1000.0), Sealer(KEY, clock=lambda: 1000.0, max_nonces=1 << 24)

    def sealer(body: bytes) -> bytes:
        frame, _ = client.seal_request(body, 5600)
        return server.open_request(frame, 5600)[0]

    ways = {
        "format2_shake_hmac": old_seal_open,
        "chacha20poly1305": aead(ChaCha20Poly1305),
        "aes256gcm": aead(AESGCM),
        "sealer_aes256gcm": sealer,
    }
    summary: dict[str, dict[str, float]] = {}
    for size, rounds in ((16 << 20, 7), (512, 3000)):
        body = os.urandom(size)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, way in ways.items():  # interleaved: the same machine state for each
                t0 = time.perf_counter()
                assert way(body) == body
                times[name].append(time.perf_counter() - t0)
        label = "16MiB" if size > 4096 else f"{size}B"
        for name, values in times.items():
            summary.setdefault(name, {})[f"{label}_median_us"] = round(1e6 * statistics.median(values), 1)
        for name in ways:
            old = summary["format2_shake_hmac"][f"{label}_median_us"]
            summary[name][f"{label}_ratio_to_format2"] = round(summary[name][f"{label}_median_us"] / old, 3)
    return save(args, "auth-seal-cost", {"summary": summary})


def save(args: argparse.Namespace, name: str, fields: dict) -> int:
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()} ({os.cpu_count()} cpus)",
        "commit": _commit(),
        **fields,
    }
    print(json.dumps(fields, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return 0


def _commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--seal", action="store_true", help="only the cost of sealing and opening a frame")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.seal:
        return seal_costs(args)
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
