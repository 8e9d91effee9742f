"""Stand-alone reproducer: a UCX target process dies of SIGSEGV after its link is cut while it answers NIXL READs.

NIXL and UCX only (the `nixl` Python package, numpy, iproute2): nothing of kvbridge is imported, so the script can
be attached to an upstream report as is. Needs root (network namespaces).

    target      one process serving every cut (a new one after a crash; --fresh: one per cut), in its own network
                namespace: one NIXL agent (UCX backend, no progress
                thread), 32 MiB of DRAM registered, polling get_new_notifs() every millisecond
    initiator   one process in another namespace: one NIXL agent; per cut it loads the target's metadata and
                posts --reads READs, each of 192 scattered 2 KiB descriptors (384 KiB) with a notification
    the cut     the path to the initiator is slowed to 32 mbit (tc tbf on its bridge port) so the READs run for
                about a second; once 5-70% of their bytes have left the target, the target's link is set down for
                0.3-1.5 s; the initiator releases every READ not done 0.3-1.0 s after it was posted (NIXL cancels
                it, UCX's GET reply stays queued at the target); the link comes back; 0.2 s later the initiator
                closes its agent (remove_remote_agent, deregister, delete) and makes a new one
    outcome     the target's exit: killed by SIGSEGV counts as a crash (UCX 1.23.0 from nixl-cu12 1.5.1: in
                ucp_worker_progress -> uct_tcp_iface_progress -> ucp_worker_discard_uct_ep ->
                uct_tcp_ep_pending_purge -> ucp_request_memory_dereg), any other signal as another failure.
                The target dies when the next initiator agent connects and UCX discards the old endpoint, which
                still holds the GET replies of the released READs: a crash seen at cut i is counted for the close
                of cut i-1 (and a new target serves cut i+1)

--flush: before closing its agent the initiator posts one 64-byte READ from the target and waits up to 15 s for
it (UCX answers one initiator's GETs in order: once it is done the target has nothing queued for us). This is the
mitigation kvbridge uses; with it the crash is expected to be rare.

    sudo python bench/ucx_cut_repro.py --cuts 30            # expect most cuts to crash the target
    sudo python bench/ucx_cut_repro.py --cuts 30 --flush    # the mitigation
    sudo python bench/ucx_cut_repro.py --cuts 60 --alternate  # both, odd cuts flushed: an A/B in one run

Prints one JSON line per cut and a summary; --out FILE writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SUBNET = "10.78.0"
BUFFER = 32 << 20
DESC = 2048
DESCS = 192
UCX = {"UCX_TLS": "self,tcp", "UCX_HANDLE_ERRORS": "bt"}  # bt: a crash prints UCX's backtrace to stderr


# -- the two NIXL processes --------------------------------------------------------------------------------------


def make_agent(name: str, device: str):
    os.environ.update(UCX, UCX_NET_DEVICES=device)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    return agent


def target_main(args) -> None:
    work = Path(args.dir)
    buf = np.random.default_rng(args.gen).integers(0, 256, BUFFER, dtype=np.uint8)
    agent = make_agent(f"target-{args.gen}", args.device)
    reg = agent.register_memory(np.array([(buf.ctypes.data, BUFFER, 0)], dtype=np.uint64), "DRAM")
    (work / "tmp").write_bytes(agent.get_agent_metadata())
    (work / "addr").write_text(str(buf.ctypes.data))
    os.replace(work / "tmp", work / f"target-{args.gen}.meta")
    while not (work / f"stop-{args.gen}").exists():
        agent.get_new_notifs()  # UCX progress happens here
        time.sleep(0.001)
    agent.deregister_memory(reg)  # the orderly close of a serving process: where the target crashes
    agent = None


def initiator_main(args) -> None:
    work = Path(args.dir)
    rng = np.random.default_rng(1)
    dst = np.zeros(BUFFER, dtype=np.uint8)
    scratch = np.zeros(64, dtype=np.uint8)
    opened = 0

    def new_agent():
        nonlocal opened
        opened += 1
        agent = make_agent(f"initiator-{opened}", args.device)
        regs = [
            agent.register_memory(np.array([(dst.ctypes.data, BUFFER, 0)], dtype=np.uint64), "DRAM"),
            agent.register_memory(np.array([(scratch.ctypes.data, 64, 0)], dtype=np.uint64), "DRAM"),
        ]
        return agent, regs

    agent, regs = new_agent()
    for line in sys.stdin:
        cmd = line.split()
        gen, flush = int(cmd[1]), cmd[2] == "1"
        timeout_s = float(cmd[3])
        peer = agent.add_remote_agent((work / f"target-{gen}.meta").read_bytes())
        src = int((work / "addr").read_text())
        handles = []
        for i in range(args.reads):
            blocks = rng.permutation(BUFFER // DESC)[:DESCS]
            dsts = rng.permutation(BUFFER // DESC)[:DESCS]
            remote = np.array([(src + b * DESC, DESC, 0) for b in blocks], dtype=np.uint64)
            local = np.array([(dst.ctypes.data + b * DESC, DESC, 0) for b in dsts], dtype=np.uint64)
            h = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
                f"n{i}".encode(),
            )
            agent.transfer(h)
            handles.append(h)
        print("posted", flush=True)
        t0, states = time.monotonic(), {}
        while handles:  # poll; release a READ when done, failed, or past the timeout (unfinished)
            still = []
            for h in handles:
                try:
                    state = agent.check_xfer_state(h)
                except Exception:
                    state = "ERR"
                if state == "PROC" and time.monotonic() - t0 < timeout_s:
                    still.append(h)
                    continue
                states[state] = states.get(state, 0) + 1
                try:
                    agent.release_xfer_handle(h)
                except Exception:
                    states["release_refused"] = states.get("release_refused", 0) + 1
            handles = still
            time.sleep(0.001)
        print("released " + json.dumps(states), flush=True)
        sys.stdin.readline()  # the link is back
        flushed = ""
        if flush:
            h = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(np.array([(scratch.ctypes.data, 64, 0)], dtype=np.uint64), "DRAM"),
                agent.get_xfer_descs(np.array([(src, 64, 0)], dtype=np.uint64), "DRAM"),
                peer,
            )
            t1 = time.monotonic()
            try:
                agent.transfer(h)
                while (state := agent.check_xfer_state(h)) == "PROC" and time.monotonic() - t1 < 15:
                    time.sleep(0.001)
            except Exception:
                state = "ERR"
            flushed = state
            agent.release_xfer_handle(h)
        with contextlib.suppress(Exception):
            agent.remove_remote_agent(peer)
        for reg in regs:
            agent.deregister_memory(reg)
        agent = None  # the last reference: NIXL destroys the agent, UCX closes its endpoints to the target
        agent, regs = new_agent()
        print("closed " + flushed, flush=True)


# -- the orchestrator (root namespace) ---------------------------------------------------------------------------


def ip(*args: str, netns: str | None = None, check: bool = True) -> None:
    subprocess.run(["ip", *(["-n", netns] if netns else []), *args], check=check, capture_output=True)


def counter(link: str) -> int:
    with open(f"/sys/class/net/{link}/statistics/tx_bytes") as f:  # delivered towards the initiator
        return int(f.read())


def orchestrate(args) -> int:
    tag = f"ucxr{os.getpid() % 10000}"
    hosts = {
        "t": (f"{tag}-t", f"{tag}ht", f"{tag}nt", f"{SUBNET}.10"),
        "i": (f"{tag}-i", f"{tag}hi", f"{tag}ni", f"{SUBNET}.11"),
    }
    work = Path(tempfile.mkdtemp(prefix="ucx-cut-repro-"))
    me = [sys.executable, os.path.abspath(__file__), "--dir", str(work)]
    rng = random.Random(args.seed)
    rows, procs, shutdown_exit = [], [], None
    try:
        ip("link", "add", f"{tag}br", "type", "bridge")
        ip("addr", "add", f"{SUBNET}.1/24", "dev", f"{tag}br")
        ip("link", "set", f"{tag}br", "up")
        for netns, link, device, addr in hosts.values():
            ip("netns", "add", netns)
            ip("link", "add", link, "type", "veth", "peer", "name", device)
            ip("link", "set", device, "netns", netns)
            ip("link", "set", link, "master", f"{tag}br")
            ip("link", "set", link, "up")
            ip("addr", "add", f"{addr}/24", "dev", device, netns=netns)
            ip("link", "set", device, "up", netns=netns)
            ip("link", "set", "lo", "up", netns=netns)
        t_ns, t_link, t_dev, _ = hosts["t"]
        i_ns, i_link, i_dev, _ = hosts["i"]
        subprocess.run(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                i_link,
                "root",
                "tbf",
                "rate",
                "32mbit",
                "burst",
                "32kbit",
                "latency",
                "400ms",
            ],
            check=True,
        )
        initiator = subprocess.Popen(
            ["ip", "netns", "exec", i_ns, *me, "--role", "initiator", "--device", i_dev, "--reads", str(args.reads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(initiator)

        def answer(prefix: str) -> str:
            while True:
                line = initiator.stdout.readline()
                if not line:
                    raise RuntimeError(f"the initiator exited ({initiator.poll()})")
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()

        gen, target = -1, None

        def start_target():
            nonlocal gen, target
            gen += 1
            with open(work / f"target-{gen}.log", "wb") as log:
                target = subprocess.Popen(
                    ["ip", "netns", "exec", t_ns, *me, "--role", "target", "--device", t_dev, "--gen", str(gen)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            procs.append(target)
            while not (work / f"target-{gen}.meta").exists():
                if target.poll() is not None:
                    raise RuntimeError(f"target {gen} exited at start ({target.returncode})")
                time.sleep(0.05)

        for cut in range(args.cuts):
            flush = args.flush or (args.alternate and cut % 2 == 1)
            if target is None or target.poll() is not None or args.fresh:
                if target is not None and target.poll() is None:
                    (work / f"stop-{gen}").touch()
                    target.wait(15)
                start_target()
            total = args.reads * DESCS * DESC
            share = rng.uniform(0.05, 0.7)
            down_s, timeout_s = rng.uniform(0.3, 1.5), rng.uniform(0.3, 1.0)
            before = counter(i_link)
            initiator.stdin.write(f"cut {gen} {int(flush)} {timeout_s}\n")
            initiator.stdin.flush()
            answer("posted")
            t0 = time.monotonic()
            while counter(i_link) - before < share * total and time.monotonic() - t0 < 10:
                time.sleep(0.001)
            ip("link", "set", t_link, "down")
            time.sleep(down_s)
            released = json.loads(answer("released "))
            ip("link", "set", t_link, "up")
            time.sleep(0.2)
            initiator.stdin.write("restored\n")
            initiator.stdin.flush()
            flushed = answer("closed")
            time.sleep(1.0)  # the target meets the closed endpoint (the crash comes within milliseconds)
            code = target.poll()
            row = {
                "cut": cut,
                "target_run": gen,
                "flush": flush,
                "flushed": flushed,
                "cut_at_share": round(share, 2),
                "down_s": round(down_s, 2),
                "release_after_s": round(timeout_s, 2),
                "reads": released,
                "target_exit": code,  # `ip netns exec` execs the target: its own status; None: still serving
                "crash": code in (-signal.SIGSEGV, 128 + signal.SIGSEGV),
            }
            if code is not None:  # the target's last words (UCX's backtrace on a crash)
                text = (work / f"target-{gen}.log").read_text(errors="replace").splitlines()
                row["target_log"] = [line for line in text if "mpool" not in line][:40]  # UCX's backtrace
            rows.append(row)
            print(json.dumps(row), flush=True)
        if target is not None and target.poll() is None:
            (work / f"stop-{gen}").touch()
            shutdown_exit = target.wait(15)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for host in hosts.values():
            ip("netns", "del", host[0], check=False)
        ip("link", "del", f"{tag}br", check=False)
    summary = {"command": " ".join(sys.argv), "versions": versions(), "cuts": len(rows), "last_exit": shutdown_exit}
    # The target dies when the next initiator connects and UCX discards the old endpoint (ucp_worker_discard_uct_ep):
    # a crash seen at cut i (its READs fail) is caused by the close at cut i-1, so it counts for that close's arm.
    for i, row in enumerate(rows):
        row["caused_by_close_of"] = None
        if row["crash"] and i > 0 and rows[i - 1]["target_run"] == row["target_run"]:
            row["caused_by_close_of"] = i - 1
    for arm in (False, True):
        closes = [r for r in rows if r["flush"] == arm]
        if closes:
            summary["close_with_flush" if arm else "close_without_flush"] = {
                "closes": len(closes),
                "target_crashes_after": sum(
                    1
                    for r in rows
                    if r["caused_by_close_of"] is not None and rows[r["caused_by_close_of"]]["flush"] == arm
                ),
            }
    summary["crashes"] = sum(r["crash"] for r in rows)
    summary["other_exits"] = sum(1 for r in rows if r["target_exit"] is not None and not r["crash"])
    summary["rows"] = rows
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["run", "target", "initiator"], default="run")
    p.add_argument("--dir", default="")
    p.add_argument("--device", default="")
    p.add_argument("--gen", type=int, default=0)
    p.add_argument("--reads", type=int, default=8)
    p.add_argument("--cuts", type=int, default=30)
    p.add_argument("--flush", action="store_true")
    p.add_argument("--alternate", action="store_true")
    p.add_argument("--fresh", action="store_true", help="a new target process for every cut (default: one serves on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.role == "target":
        target_main(args)
        return 0
    if args.role == "initiator":
        initiator_main(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
