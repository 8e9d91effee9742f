"""An outsider against a prefill worker's transport, across test hosts: the victim, the attacker and the key holder.

    python -m support.transport_attack victim DIR IP DEVICE [--ucx-tcp]
    python -m support.transport_attack attacker DIR DEVICE {read-write|crash|side-channel|kv-channel} [--with-key]
    python -m support.transport_attack holder DIR IP

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
- side-channel: the victim's side channel, as a ZMQ client: a handshake, a claim naming the held request (its id
  and blocks, as leaked params would give them, with a guessed token), each unsealed and sealed with a wrong key,
  and raw frames (garbage, 2 MiB, an empty one, a truncated request);
- kv-channel: the victim's KV channel port: a hello without the key followed by a forged read of the held request,
  the channel's handshake with a wrong key, garbage, a truncated hello.
It writes what each got to DIR/attack-<mode>.json. `--with-key`: the same side-channel and kv-channel clients holding
the deployment key (the controls: the routes are reachable, and the key is what opens them).

The victim also holds a request of a user (HELD_ID, HELD_BLOCKS; its token goes to DIR/params.json, which only the
key holder reads). The key holder is a keyed DecodeWorker on another host that loads that request as a decode
would (a claim over the side channel, the blocks over the KV channel) and writes to DIR/holder.json whether it got
the victim's bytes exactly.

`victim_on` and `run_on` run these processes in test hosts (support.hosts) for the tests.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SECRET = b"USER-A PROMPT: my card is 4111-1111-1111-1111, expiry 12/29, and my home address is 1 Main St"
PAYLOAD = b"<<ATTACKER-WROTE-THIS>>"
KEY = b"transport-attack-deployment-key-0123456789"
WRONG_KEY = b"not-the-deployment-key-0123456789abcdef"
ENGINE = "victim"
PORT = 5600
BLOCKS = 16  # per layer; two layers, LBHNC
HELD_ID, HELD_BLOCKS = "user-a-request-1", (3, 7, 9, 12)
TESTS = Path(__file__).resolve().parents[1]


def victim_kv():
    """The victim's KV buffer: seeded bytes, the user's secret at its head (block 0 of layer 0)."""
    import torch

    kv = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(27))
    kv[: len(SECRET)] = torch.frombuffer(bytearray(SECRET), dtype=torch.uint8)
    return kv


def _geometry():
    from kvbridge.core.topology import KVGeometry

    return KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


def held_bytes(kv, block_ids) -> bytes:
    """The bytes of `block_ids` of both layers (as the KV channel sends them: layer by layer)."""
    per_layer = kv[: 2 * BLOCKS * 512].view(2, BLOCKS, 512)  # 512: 2 heads x 4 tokens x (K, V of 8) x 4 bytes
    return per_layer[:, list(block_ids)].contiguous().numpy().tobytes()


def victim(work: Path, ip: str, device: str, ucx_tcp: bool) -> None:
    from kvbridge.core.config import BridgeConfig
    from kvbridge.core.identity import WorkerIdentity
    from kvbridge.core.memory import synthesize_memory
    from kvbridge.core.topology import ParallelLayout, WorkerRank
    from kvbridge.runtime.prefill_worker import PrefillWorker

    geometry = _geometry()
    kv = victim_kv()
    memory = synthesize_memory("LBHNC", geometry, [0, 1], 2, BLOCKS, kv.data_ptr())
    extra = {"ucx_tcp_exposes_process_memory": True, "ucx_net_devices": device} if ucx_tcp else {}
    config = BridgeConfig(side_channel_host=ip, side_channel_port=PORT, lease_s=60, **extra)
    worker = PrefillWorker(
        WorkerIdentity(ENGINE, ParallelLayout(), 0, WorkerRank(0, 0), geometry), memory, config, key=KEY
    ).start()
    try:
        token = os.urandom(16).hex()
        worker.hold(HELD_ID, (HELD_BLOCKS,), token=token, prompt_hash="h")
        (work / "params.json").write_text(json.dumps({"token": token, "host": ip}))
        leak = {
            "metadata": worker.transport.agent_metadata().hex(),
            "addr": memory.regions[0].addr,
            "nbytes": memory.regions[0].nbytes,
            "ucx": worker.transport.ucx_env,
            "host": ip,
            "stream_port": worker.stream.port if worker.stream else 0,
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


def nixl_attacker(work: Path, mode: str) -> None:
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


def _report(work: Path, name: str, report: dict) -> None:
    (work / f"{name}.tmp").write_text(json.dumps(report))
    (work / f"{name}.tmp").rename(work / f"{name}.json")


def side_channel_attacker(work: Path, key: bytes | None) -> dict:
    """Each try: whether anything came back (`answered`), and what (the answer's type, or its size)."""
    import zmq

    from kvbridge.core.errors import TransferError
    from kvbridge.core.leases import blocks_digest
    from kvbridge.core.memory import synthesize_memory
    from kvbridge.core.topology import ParallelLayout, WorkerRank
    from kvbridge.wire import messages as wire
    from kvbridge.wire.auth import Sealer, destination
    from kvbridge.wire.side_channel_client import exchange

    leak = json.loads((work / "leak.json").read_text())
    host, me = leak["host"], (ENGINE, 0, 0, 0)
    memory = synthesize_memory("LBHNC", _geometry(), [0, 1], 2, BLOCKS, 1 << 20)
    handshake = wire.HandshakeRequest.build(
        "outsider", ParallelLayout(), 0, WorkerRank(0, 0), _geometry(), "LBHNC", memory, target=(0, WorkerRank(0, 0))
    )
    claim = wire.Claim(
        request_id=HELD_ID,
        block_ids=HELD_BLOCKS,
        engine_id="outsider",
        worker=wire.Worker(),
        token=os.urandom(16).hex(),  # a guess: the outsider has the id and the blocks, not the token
        prompt_hash="h",
        blocks_digest=blocks_digest(HELD_BLOCKS),
    )
    sealers = {"sealed with the key": Sealer(key)} if key else {"unsealed": None, "wrong key": Sealer(WRONG_KEY)}

    def ask(message, sealer) -> dict:
        try:
            answer = exchange(host, PORT, message, timeout_s=1.0, retries=0, sealer=sealer, identity=me)
            return {"answered": True, "answer": type(answer).__name__}
        except TransferError as exc:
            return {"answered": False, "error": type(exc).__name__}

    def send(frame: bytes) -> dict:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{PORT}")
        try:
            sock.send(frame)
            got = sock.recv() if sock.poll(700) else None
        finally:
            sock.close(linger=0)
        return {"answered": got is not None, "answer_bytes": len(got or b"")}

    tries = {
        f"{name}, {how}": functools.partial(ask, message, sealer)
        for name, message in (("handshake", handshake), ("claim", claim))
        for how, sealer in sealers.items()
    }
    if key is None:
        raw = {
            "garbage": os.urandom(200),
            "oversized (2 MiB)": os.urandom(2 << 20),
            "empty": b"",
            "a truncated request": wire.encode(claim)[:20],
            "a truncated wrong-key frame": Sealer(WRONG_KEY).seal_request(wire.encode(handshake), PORT)[0][:40],
        }
    else:  # the raw client's control: a whole frame sealed with the key for this worker
        raw = {"a sealed frame, raw": Sealer(key).seal_request(wire.encode(handshake), destination(PORT, *me))[0]}
    tries.update({name: functools.partial(send, frame) for name, frame in raw.items()})
    # All at once, each on a socket of its own: each still waits its whole deadline for an answer.
    with concurrent.futures.ThreadPoolExecutor(len(tries)) as pool:
        running = {name: pool.submit(attempt) for name, attempt in tries.items()}
    return {name: future.result() for name, future in running.items()}


def kv_channel_attacker(work: Path, key: bytes | None) -> dict:
    """Each try: the bytes the KV channel sent back (count, hex head), or the frames a keyed client got."""
    import socket

    from kvbridge.transport import kv_stream as ks
    from kvbridge.wire import stream_messages as sm
    from support.kv_channel_client import stream_read, stream_request

    leak = json.loads((work / "leak.json").read_text())
    host, port = leak["host"], leak["stream_port"]
    forged = stream_request(leak["addr"], leak["nbytes"], BLOCKS, HELD_ID, os.urandom(16).hex(), list(HELD_BLOCKS))

    def frames_of(key_: bytes) -> dict:
        frames, err = stream_read(host, port, key_, forged)
        messages = [str(sm.decode(f[2])) for f in frames if f[0] == ks.KIND_MESSAGE]
        data = b"".join(f[2] for f in frames if f[0] == ks.KIND_DATA)
        return {"frames": len(frames), "messages": messages, "data": data.hex(), "error": type(err).__name__}

    if key:
        return {"read with the key": frames_of(key)}

    def raw(sent: bytes) -> dict:
        got = b""
        with socket.create_connection((host, port), timeout=5) as sock:
            try:
                sock.sendall(sent)
                sock.shutdown(socket.SHUT_WR)
                while chunk := sock.recv(1 << 16):
                    got += chunk
            except OSError as exc:
                return {"bytes": len(got), "head": got[:64].hex(), "error": type(exc).__name__}
        return {"bytes": len(got), "head": got[:64].hex(), "all": got.hex()}

    hello = ks.HELLO.pack(ks.MAGIC, 1, bytes(ks.KEY_ID_BYTES), os.urandom(32))
    return {
        "hello without the key, a forged read": raw(hello + bytes(32) + sm.encode(forged)),
        "read with a wrong key": frames_of(WRONG_KEY),
        "garbage": raw(os.urandom(4096)),
        "a truncated hello": raw(hello[:10]),
        "answer_size": ks.ANSWER.size,
    }


def holder(work: Path, ip: str) -> None:
    """A key holder's load of the held request, as a decode worker on another host makes it."""
    import torch

    from kvbridge.core.config import BridgeConfig
    from kvbridge.core.identity import WorkerIdentity
    from kvbridge.core.memory import synthesize_memory
    from kvbridge.core.topology import ParallelLayout, WorkerRank
    from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
    from kvbridge.wire.params import PrefillDone

    params = json.loads((work / "params.json").read_text())
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", _geometry(), [0, 1], 2, BLOCKS, kv.data_ptr())
    config = BridgeConfig(side_channel_host=ip, side_channel_port=PORT)
    worker = DecodeWorker(
        WorkerIdentity("holder", ParallelLayout(), 0, WorkerRank(0, 0), _geometry()), memory, config, key=KEY
    ).start()
    dst = (1, 2, 5, 8)
    try:
        source = PrefillDone(
            remote_engine_id=ENGINE,
            remote_request_id=HELD_ID,
            remote_block_ids=list(HELD_BLOCKS),
            remote_host=params["host"],
            remote_port=PORT,
            remote_layout="pp=1,tp=1",
            remote_token=params["token"],
            remote_prompt_hash="h",
        )
        worker.load(LoadJob(f"d-{HELD_ID}", source, (dst,), (HELD_BLOCKS,)))
        report: dict = {"loaded": None}
        deadline = time.monotonic() + 20
        while report["loaded"] is None and time.monotonic() < deadline:
            done, failed, _ = worker.results(wait_s=0.05)
            report["loaded"] = True if f"d-{HELD_ID}" in done else False if f"d-{HELD_ID}" in failed else None
        report["exact"] = held_bytes(kv, dst) == held_bytes(victim_kv(), HELD_BLOCKS)
        report["over_the_kv_channel_bytes"] = worker.stream.bytes if worker.stream else 0
    finally:
        worker.close()
    _report(work, "holder", report)


def attacker(work: Path, mode: str, key: bytes | None) -> None:
    if mode == "side-channel":
        _report(work, f"attack-{mode}{'-keyed' if key else ''}", side_channel_attacker(work, key))
    elif mode == "kv-channel":
        _report(work, f"attack-{mode}{'-keyed' if key else ''}", kv_channel_attacker(work, key))
    else:
        nixl_attacker(work, mode)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} (victim rc {proc.poll()})")
        time.sleep(0.05)


@contextmanager
def victim_on(host, work: Path, ucx_tcp: bool = False) -> Iterator[tuple[subprocess.Popen, dict]]:
    """The victim process on test host `host` (support.hosts.Host), once it serves: (its process, the leak). Stopped
    on exit (killed if it does not stop); its log's tail is in `work/victim.log`."""
    cmd = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "support.transport_attack", "victim"]
    cmd += [str(work), host.ip, host.device, *(["--ucx-tcp"] if ucx_tcp else [])]
    with open(work / "victim.log", "wb") as log:
        victim_proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(work / "leak.json", victim_proc)
            yield victim_proc, json.loads((work / "leak.json").read_text())
            (work / "stop").touch()
            if victim_proc.poll() is None:
                victim_proc.wait(timeout=30)
        finally:
            if victim_proc.poll() is None:
                victim_proc.send_signal(signal.SIGKILL)
                victim_proc.wait(timeout=10)


def run_on(host, work: Path, role: str, *args: str, report: str, nixl_tcp: bool = False) -> dict:
    """One attacker or key-holder process on test host `host`; the JSON it wrote to `work/<report>.json`.
    `nixl_tcp`: its NIXL agent on UCX tcp over the host's device (the NIXL attacker's)."""
    cmd = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "support.transport_attack", role, str(work)]
    env = {**_env(), **({"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device} if nixl_tcp else {})}
    out = subprocess.run([*cmd, *args], env=env, capture_output=True, timeout=120)
    path = work / f"{report}.json"
    assert path.exists(), out.stderr.decode()[-3000:]
    return json.loads(path.read_text())


if __name__ == "__main__":
    role, work = sys.argv[1], Path(sys.argv[2])
    if role == "victim":
        victim(work, sys.argv[3], sys.argv[4], "--ucx-tcp" in sys.argv)
    elif role == "holder":
        holder(work, sys.argv[3])
    else:
        attacker(work, sys.argv[4], KEY if "--with-key" in sys.argv else None)
