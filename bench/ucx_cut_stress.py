"""Link cuts while NIXL READs are in flight, without vLLM: how often does UCX crash the prefill (target) process?

In CI the prefill worker died 1 time in 4 of SIGSEGV inside UCX once a link cut mid-READ was restored
(ucp_worker_progress -> uct_tcp_iface_progress -> ucp_worker_discard_uct_ep -> uct_tcp_ep_pending_purge ->
ucp_request_memory_dereg, under NIXL's getNotifs). This reproduces the situation of
tests/e2e/test_e2e_hosts.py::test_a_link_cut_while_a_read_is_in_flight_is_recomputed many times per run:

  namespaces    tests/support/hosts.py: a prefill and a decode namespace on a bridge, UCX over tcp on their veth
  prefill       one NixlTransport (kvbridge's) registering a large DRAM region, polling notifications() with
                backoff as kvbridge's prefill worker does; nothing else
  decode        one NixlTransport posting --reads READs per cut, each a request's scattered blocks (KV_HND
                layout: one descriptor per layer, plane and block, coalesced as kvbridge does)
  each cut      the path to the decode host slowed (tc tbf on its root-side veth, as mid_read() does) so READs
                are in flight for seconds; once a random share of the bytes has left the prefill host, its link is
                cut (--cut: `ip link set down` as the test does, or netem 100% loss), held down a random time,
                restored; the decode side meanwhile applies --policy to its transfer handles
  outcome       every exit of the prefill (or decode) process by a signal is a crash: counted, its log tail kept,
                and the process restarted (the decode reloads the new agent's metadata)

Policies (what the decode side does with its xfer handles):
  kvbridge       runtime/nixl_reads.py: poll; on ERR release and drop the peer (remove_remote_agent, re-added on
                 the next post); at the transfer timeout release the still-running READ (NIXL cancels it) and keep
                 the peer; a release NIXL refuses is retried on every poll
  final-only     never release a handle whose status is not final (DONE/ERR): after the timeout keep polling
  pre-cut        release (cancel) every handle right before the link is cut
--barrier-s S: before any removal of the prefill agent (and before close), one flush READ from it
  (NixlTransport.post_flush, what runtime/nixl_reads.py now posts: 64 bytes into a scratch buffer, no
  notification), waited for up to S: the prefill has no GET replies queued towards us once it is done
  (the results ucx-cut-barrier-drop-settle-* and ucx-cut-ab-close-* used another barrier: a 64-byte READ into
  block 0 with a notification)
--linger-s S: before the drop or close, keep the endpoint open and polled for S (the time-based alternative)
--restart-each: a fresh prefill process for each cut (a guess to test: UCX's request pool grows from unzeroed memory
  on a fresh process's first cuts, and the purge reads a field the GET-reply request never sets)
--alternate on: the treatment (barrier and/or linger) on odd cuts only, an A/B in one run ("by_arm" in the JSON)
--drop: when the decode side also removes the prefill agent (remove_remote_agent; re-added on the next post):
  never (kvbridge on a timeout; it still does at close, counted as "shutdown"), timeout (with the timed-out
  READ's release), close (after the restore, the decode closes its agent and starts a new one: a decode
  restart), settle (after the restore, once the READs are settled: an engine reaped, a peer dropped)

    .venv/bin/python bench/ucx_cut_stress.py --name defaults --cuts 50
    .venv/bin/python bench/ucx_cut_stress.py --name put-off --env UCX_TCP_PUT_ENABLE=n
    # the A/B that decided the workaround: the decode closes its agent right after each restore, the flush READ
    # before the close on odd cuts (pass another --seed per run: the cut sequence is seeded)
    .venv/bin/python bench/ucx_cut_stress.py --name hot-ab-flush --seed 1 --drop close --barrier-s 15 \
        --alternate on --settle-s 0 --down-s 0.3 1.5 --timeout-s 0.3 1.0 --after-s 0.2 --budget-s 270

Each run writes bench/results/ucx-cut-<name>-<stamp>.json. Needs root and iproute2 (like tests/support/hosts.py);
everything
it makes (namespaces, veths, bridge, qdiscs, processes) is removed on exit, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from kvbridge.core.descriptors import worker_descriptors  # noqa: E402
from kvbridge.core.errors import KVBridgeError  # noqa: E402
from kvbridge.core.memory import synthesize_memory  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402

RANK = WorkerRank(0, 0)
LAYOUT = "KV_HND"  # [2, blocks, heads, tokens, head] per layer: a scattered block is one descriptor per layer and plane
POLICIES = ("kvbridge", "final-only", "pre-cut")
DROPS = ("never", "timeout", "settle", "close")
PEER_WORDS = ("disconnect", "remote", "connection", "unreachable", "peer", "not_found", "not found")  # nixl_reads


def geometry(args) -> KVGeometry:
    return KVGeometry(args.layers, args.kv_heads, args.head_size, "bfloat16", args.block_size)


def memory(args, base: int):
    return synthesize_memory(LAYOUT, geometry(args), list(range(args.layers)), args.kv_heads, args.blocks, base)


def transport_config(args) -> TransportConfig:
    return TransportConfig(ucx_tls=args.tls, ucx_net_devices=args.device)


# -- the prefill process: register, publish, progress ----------------------------------------------------------


def prefill_main(args) -> None:
    work = Path(args.dir)
    size = memory(args, 0).regions[0].nbytes
    buf = np.random.default_rng(args.seed).integers(0, 256, size, dtype=np.uint8)
    with NixlTransport(f"cut-prefill-{args.gen}", transport_config(args)) as transport:
        transport.register(memory(args, buf.ctypes.data), "DRAM")
        meta = work / f"prefill-{args.gen}.meta"
        (work / "tmp.meta").write_bytes(transport.agent_metadata())
        (work / "prefill.addr").write_text(str(buf.ctypes.data))
        os.replace(work / "tmp.meta", meta)
        backoff = Backoff(first_s=100e-6, cap_s=2e-3)  # runtime/prefill_worker.py's rhythm
        notes = 0
        while not ((work / "stop").exists() or (work / f"stop-{args.gen}").exists()):
            got = transport.notifications()  # NIXL getNotifs: where CI's crash happened
            if got:
                notes += sum(len(v) for v in got.values())
                backoff.reset()
            backoff.sleep()
        print(f"prefill gen {args.gen}: {notes} notifications", flush=True)


# -- the decode process: commands on stdin, one JSON answer per line on stdout ----------------------------------


class Decode:
    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(args.dir)
        self.rng = np.random.default_rng(args.seed + 1)
        self.dst = np.zeros(memory(args, 0).regions[0].nbytes, dtype=np.uint8)
        self.dst_mem = memory(args, self.dst.ctypes.data)
        self.plan = make_plan(ParallelLayout.parse("pp=1"), ParallelLayout.parse("pp=1"), geometry(args))
        self.opened = 0
        self.transport = NixlTransport("cut-decode", transport_config(args)).start()
        self.transport.register(self.dst_mem, "DRAM")
        self.peer: str | None = None
        self.gen = -1
        self.src_mem = None
        self.active: list[dict] = []  # {"t": Transfer, "posted": s, "timed_out": bool}
        self.unreleased: list = []  # handles whose release NIXL refused (retried each poll)
        self.stats = {"done": 0, "err": 0, "timeout_released": 0, "release_refused": 0, "dropped_peer": 0}
        self.stats.update(late_checked=0, late_written=0, late_after_barrier=0)
        self.watched: list[tuple[np.ndarray, np.ndarray]] = []  # dst ranges of READs released unfinished
        self.errors: list[str] = []

    def connect(self, gen: int) -> None:
        if self.peer is not None:
            self.drop(barrier=gen == self.gen)  # a restarted prefill's old agent is dead: no barrier
        meta = self.work / f"prefill-{gen}.meta"
        self.src_mem = memory(self.args, int((self.work / "prefill.addr").read_text()))
        self.peer = self.transport.add_peer(meta.read_bytes())
        self.gen = gen

    def reopen(self, barrier: bool = True) -> None:
        """Close the agent (its UCX worker and sockets go: what a decode restart does) and start a new one."""
        self.drop(barrier)  # with --barrier-s, after a barrier READ
        self.transport.close()
        self.active, self.unreleased = [], []
        self.opened += 1
        self.transport = NixlTransport(f"cut-decode-{self.opened}", transport_config(self.args)).start()
        self.transport.register(self.dst_mem, "DRAM")

    def barrier(self) -> str:
        """A flush READ (NixlTransport.post_flush: 64 bytes, no notification) from the peer, waited for: its GET
        reply leaves the prefill after every reply queued before it on the same lane, so once it is DONE the
        prefill's pending queue towards us is empty."""
        t0 = time.monotonic()
        try:
            t = self.transport.post_flush(self.peer, self.src_mem.regions[0])  # what runtime/nixl_reads.py posts
            backoff = Backoff()
            while not self.transport.poll(t):
                if time.monotonic() - t0 > self.args.barrier_s:
                    if not self.release(t):
                        self.unreleased.append(t)
                    return "timeout"
                backoff.sleep()
            self.release(t)
            self.stats.setdefault("barrier_waits_s", []).append(round(time.monotonic() - t0, 3))
            self.check_late("barrier")  # the flush READ is done: every earlier answer has landed
            return "done"
        except KVBridgeError as exc:
            self.errors.append(f"barrier: {exc}")
            return "error"

    def linger(self, seconds: float) -> None:
        """Keep the endpoint open (polling, progressing UCX) for `seconds` before a drop or close: the other
        candidate workaround (time for the prefill to send what it still has queued towards us)."""
        end = time.monotonic() + seconds
        backoff = Backoff()
        while time.monotonic() < end:
            if self.poll():
                backoff.reset()
            backoff.sleep()

    def drop(self, barrier: bool = True) -> None:
        if self.peer is not None:
            if barrier and self.args.barrier_s > 0:
                outcome = self.barrier()
                self.stats[f"barrier_{outcome}"] = self.stats.get(f"barrier_{outcome}", 0) + 1
            try:
                self.transport.remove_peer(self.peer)
            except KVBridgeError as exc:
                self.errors.append(f"remove_peer: {exc}")
            self.peer = None
            self.stats["dropped_peer"] += 1

    def post(self, gen: int) -> dict:
        if self.peer is None or gen != self.gen:
            self.connect(gen)
        self.check_late("post")
        nbytes = ndesc = 0
        dst_perm = self.rng.permutation(self.args.blocks)  # disjoint destinations: a late write is never another's
        for i in range(self.args.reads):
            n = self.args.request_blocks
            sb, db = self.rng.permutation(self.args.blocks)[:n], dst_perm[i * n : (i + 1) * n]
            d = worker_descriptors(self.plan, RANK, self.dst_mem, {RANK: self.src_mem}, sb, db)[RANK]
            try:
                t = self.transport.read(self.peer, d, self.dst_mem, self.src_mem, f"cut:{time.time()}:{i}".encode())
            except KVBridgeError as exc:
                self.errors.append(f"post: {exc}")
                self.stats["err"] += 1
                pending = getattr(exc, "transfer", None)
                if pending is not None:
                    self.unreleased.append(pending)
                if any(w in str(exc).lower() for w in PEER_WORDS):
                    self.drop()
                continue
            self.active.append({"t": t, "posted": time.monotonic(), "timed_out": False, "d": d})
            nbytes += d.nbytes
            ndesc += len(d)
        return {"posted": len(self.active), "bytes": nbytes, "descriptors": ndesc}

    def release(self, t) -> bool:
        try:
            self.transport.release(t)
            return True
        except KVBridgeError:
            self.stats["release_refused"] += 1
            return False

    def watch(self, d) -> None:
        """A READ released unfinished: fill its destination with a sentinel; a byte that changes later was written
        by the READ after its release (UCX does not cancel a GET: NIXL's release only frees the request)."""
        offsets = d.dst_addr.astype(np.int64) - self.dst.ctypes.data
        lengths = d.length.astype(np.int64)
        for o, n in zip(offsets, lengths, strict=True):
            self.dst[o : o + n] = 0xEE
        self.watched.append((offsets, lengths))

    def check_late(self, when: str) -> None:
        """Count the released READs whose destination changed since (`when`: "post" or "barrier")."""
        for offsets, lengths in self.watched:
            self.stats["late_checked"] += 1
            if any((self.dst[o : o + n] != 0xEE).any() for o, n in zip(offsets, lengths, strict=True)):
                self.stats["late_written"] += 1
                if when == "barrier":
                    self.stats["late_after_barrier"] += 1
        self.watched = []

    def release_all(self) -> dict:
        """pre-cut: cancel every handle now (the link is still up)."""
        n = 0
        for a in self.active:
            if not self.release(a["t"]):
                self.unreleased.append(a["t"])
            n += 1
        self.active = []
        return {"released": n}

    def poll(self) -> bool:
        policy, timeout = self.args.policy, self.args.cur_timeout
        still, progressed = [], False
        for a in self.active:
            t = a["t"]
            try:
                done = self.transport.poll(t)
            except KVBridgeError as exc:
                self.stats["err"] += 1
                self.errors.append(f"poll: {exc}")
                if not self.release(t):
                    self.unreleased.append(t)
                if any(w in str(exc).lower() for w in PEER_WORDS):
                    self.drop()
                progressed = True
                continue
            if done:
                self.stats["done"] += 1
                if not self.release(t):
                    self.unreleased.append(t)
                progressed = True
            elif time.monotonic() - a["posted"] > timeout and policy != "final-only":
                self.stats["timeout_released"] += 1
                if not self.release(t):
                    self.unreleased.append(t)
                else:
                    self.watch(a["d"])
                if self.args.drop == "timeout":
                    self.drop()
                progressed = True
            else:
                still.append(a)
        self.active = still
        self.unreleased = [t for t in self.unreleased if not self.release(t)]
        if not self.active and not progressed:
            self.transport.notifications()  # progress UCX as the decode worker's idle engine would
        return progressed


MARK = "@@ "  # NIXL/UCX print to stdout too: answers carry this prefix


def say(text: str) -> None:
    print(MARK + text, flush=True)


def decode_main(args) -> None:
    side = Decode(args)
    args.cur_timeout = 1e9
    say(json.dumps({"op": "ready", "pid": os.getpid()}))
    backoff = Backoff(first_s=50e-6, cap_s=5e-3)
    settle_until = None
    while True:
        if side.poll():
            backoff.reset()
        if settle_until is not None and (not side.active or time.monotonic() > settle_until):
            reply = {"settled": not side.active, "left": len(side.active), "stats": side.stats, "peer": side.peer}
            reply["errors"] = side.errors[-3:]
            say(json.dumps({"op": "settle", **reply}))
            settle_until = None
        r, _, _ = select.select([sys.stdin], [], [], backoff.step())
        if not r:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        backoff.reset()
        if cmd["op"] == "post":
            args.cur_timeout = cmd["timeout_s"]
            say(json.dumps({"op": "post", **side.post(cmd["gen"])}))
        elif cmd["op"] == "release":
            say(json.dumps({"op": "release", **side.release_all()}))
        elif cmd["op"] == "drop":
            side.linger(cmd.get("linger", 0.0))
            side.drop(cmd.get("barrier", True))
            say(json.dumps({"op": "drop"}))
        elif cmd["op"] == "reopen":
            side.linger(cmd.get("linger", 0.0))
            side.reopen(cmd.get("barrier", True))
            say(json.dumps({"op": "reopen"}))
        elif cmd["op"] == "settle":
            settle_until = time.monotonic() + cmd["s"]
        elif cmd["op"] == "stop":
            side.drop()  # with --barrier-s, after a barrier READ
            side.transport.close()
            say(json.dumps({"op": "stop", "stats": side.stats}))
            return


# -- the run: namespaces, processes, cuts -------------------------------------------------------------------------


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class Proc:
    """A role's process in its namespace, its stderr+stdout in a log file."""

    def __init__(self, role: str, host, passed: list[str], work: str, env: dict, gen: int, log: Path) -> None:
        cmd = ["ip", "netns", "exec", host.netns, sys.executable, __file__, *passed]
        cmd += ["--role", role, "--dir", work, "--device", host.device, "--gen", str(gen)]
        self.log = log
        self.logf = open(log, "ab")  # noqa: SIM115 (closed in stop())
        stdin = subprocess.PIPE if role == "decode" else subprocess.DEVNULL
        stdout = subprocess.PIPE if role == "decode" else self.logf
        self.p = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=stdout, stderr=self.logf, text=role == "decode")
        self.buf = b""

    def alive(self) -> bool:
        return self.p.poll() is None

    def send(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout_s: float, op: str) -> dict | None:
        """The next answer to `op` (late answers to earlier commands are skipped), or None after `timeout_s`.
        Reads the pipe itself (no buffered readline: a line already buffered would not wake select)."""
        deadline = time.monotonic() + timeout_s
        fd = self.p.stdout.fileno()
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                at = line.find(MARK.encode())  # NIXL's own output may precede it on the line
                if at < 0:
                    self.logf.write(line + b"\n")
                    continue
                self.logf.write(line[:at] + b"\n")
                answer = json.loads(line[at + len(MARK) :])
                if answer.get("op") == op:
                    return answer
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk

    def stop(self) -> None:
        if self.alive():
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.logf.close()

    def tail(self, n: int = 40) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()[-n:]


def crash_record(proc: Proc, role: str, cut: int, since_restore: float | None, phase: str = "cut") -> dict:
    rc = proc.p.returncode
    tail = proc.tail()
    return {
        "role": role,
        "phase": phase,
        "cut": cut,
        "returncode": rc,
        "signal": signal.Signals(-rc).name if rc < 0 else None,
        "s_after_restore": since_restore,
        "ucx_frames": [line for line in tail if "ucp_" in line or "uct_" in line or "nixl" in line.lower()][:20],
        "log_tail": tail[-25:],
    }


def versions() -> dict:
    import ctypes
    from importlib.metadata import version

    out = {"nixl": version("nixl")}
    libs = Path(sys.prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    for so in sorted(libs.glob("nixl_cu*.libs/libucp-*.so*")):
        lib = ctypes.CDLL(str(so))
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        out["ucx"] = lib.ucp_get_version_string().decode()
        out["ucx_lib"] = str(so.relative_to(libs))
    return out


def _terminated(signum, frame) -> None:
    raise SystemExit(f"terminated by signal {signum}")  # so that every namespace and process is cleaned up


def run(args, argv: list[str]) -> int:
    from hosts import network_hosts

    signal.signal(signal.SIGTERM, _terminated)
    rng = random.Random(args.seed)
    passed = [a for a in argv if a not in ("--role", "run")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # no faulthandler: UCX's own handler prints the native stack
    for key in ("UCX_TLS", "UCX_NET_DEVICES"):
        env.pop(key, None)
    for kv in args.env:
        k, v = kv.split("=", 1)
        env[k] = v
    t_start = time.monotonic()
    cuts: list[dict] = []
    crashes: list[dict] = []
    decode_stats: dict = {}
    failure = ""
    with tempfile.TemporaryDirectory() as work, network_hosts("prefill", "decode") as hosts:
        ph, dh = hosts["prefill"], hosts["decode"]
        logs = Path(work)
        gen = 0
        procs: dict[str, Proc] = {}

        def start_prefill() -> None:
            nonlocal gen
            gen += 1
            procs["prefill"] = Proc("prefill", ph, passed, work, env, gen, logs / f"prefill-{gen}.log")
            deadline = time.monotonic() + 180  # a loaded 2-core machine imports slowly
            while not (logs / f"prefill-{gen}.meta").exists():
                if not procs["prefill"].alive() or time.monotonic() > deadline:
                    raise RuntimeError("prefill did not start:\n" + "\n".join(procs["prefill"].tail()))
                time.sleep(0.05)

        def start_decode() -> None:
            procs["decode"] = Proc("decode", dh, passed, work, env, 0, logs / "decode.log")
            if procs["decode"].recv(180, "ready") is None:
                raise RuntimeError("decode did not start:\n" + "\n".join(procs["decode"].tail()))

        def check(cut: int, restored_at: float | None) -> None:
            for role, starter in (("prefill", start_prefill), ("decode", start_decode)):
                p = procs[role]
                if not p.alive():
                    since = time.monotonic() - restored_at if restored_at else None
                    crashes.append(crash_record(p, role, cut, since))
                    print(f"cut {cut}: {role} exited rc={p.p.returncode} ({since} s after restore)", flush=True)
                    p.stop()
                    starter()

        shaped = False
        try:
            start_prefill()
            start_decode()
            rate = ["tc", "qdisc", "add", "dev", dh.link, "root", "tbf", "rate", args.rate, "burst", "16kb"]
            sh(*rate, "latency", "50ms")
            shaped = True
            restored_at = None
            for i in range(args.cuts):
                if time.monotonic() - t_start > args.budget_s:
                    print(f"budget of {args.budget_s} s spent after {i} cuts", flush=True)
                    break
                check(i, restored_at)
                if args.restart_each and i > 0 and procs["prefill"].alive():  # every cut on a fresh prefill
                    Path(work, f"stop-{gen}").touch()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        procs["prefill"].p.wait(30)
                    if procs["prefill"].p.returncode == 0:  # a clean stop is no crash (runs before 21:40 counted it)
                        procs["prefill"].stop()
                        start_prefill()
                    check(i, restored_at)  # an exit by a signal here is a crash, counted on this cut
                dec = procs["decode"]
                timeout_s = rng.uniform(*args.timeout_s)
                down_s = rng.uniform(*args.down_s)
                share = rng.uniform(*args.cut_at)
                sent0 = ph.tx_bytes()
                dec.send(op="post", gen=gen, timeout_s=timeout_s)
                posted = dec.recv(30, "post")
                if posted is None:
                    check(i, restored_at)
                    continue
                t_post = time.monotonic()
                deadline = t_post + 20
                while ph.tx_bytes() - sent0 < share * posted["bytes"] and time.monotonic() < deadline:
                    time.sleep(0.002)
                in_flight = ph.tx_bytes() - sent0
                if args.policy == "pre-cut":
                    dec.send(op="release")
                    dec.recv(10, "release")
                cut_at = time.monotonic()
                if args.cut == "down":
                    sh("ip", "link", "set", ph.link, "down")
                else:
                    sh("tc", "qdisc", "add", "dev", ph.link, "root", "netem", "loss", "100%")
                time.sleep(down_s)
                if args.cut == "down":
                    sh("ip", "link", "set", ph.link, "up")
                else:
                    sh("tc", "qdisc", "del", "dev", ph.link, "root")
                restored_at = time.monotonic()
                dec.send(op="settle", s=args.settle_s)
                settled = dec.recv(args.settle_s + 10, "settle")
                treated = args.alternate == "off" or i % 2 == 1
                if args.drop in ("settle", "close"):
                    barrier = args.barrier_s > 0 and treated
                    linger = args.linger_s if treated else 0.0
                    dec.send(op="drop" if args.drop == "settle" else "reopen", barrier=barrier, linger=linger)
                    dec.recv(60 + linger, "drop" if args.drop == "settle" else "reopen")
                    time.sleep(1.0)  # a crash at the close comes within milliseconds: counted on this cut
                    check(i, restored_at)
                time.sleep(rng.uniform(0, args.after_s))
                rec = {
                    "cut": i,
                    "posted": posted,
                    "bytes_sent_at_cut": in_flight,
                    "cut_after_post_s": round(cut_at - t_post, 3),
                    "down_s": round(down_s, 3),
                    "timeout_s": round(timeout_s, 3),
                    "settle_s": round(time.monotonic() - restored_at, 3),
                    "settled": settled,
                    "prefill_gen": gen,
                    "barrier": args.barrier_s > 0 and treated,
                    "treated": treated,
                    "linger_s": args.linger_s if treated else 0.0,
                }
                cuts.append(rec)
                left = settled.get("left") if settled else "?"
                print(
                    f"cut {i}: {in_flight} of {posted['bytes']} B out, down {down_s:.1f} s, timeout {timeout_s:.1f} s,"
                    f" settled {settled and settled.get('settled')} (left {left}), prefill gen {gen}",
                    flush=True,
                )
                if settled:
                    decode_stats = settled["stats"]
            check(len(cuts), restored_at)
            time.sleep(1)
            check(len(cuts), restored_at)
            procs["decode"].send(op="stop")
            procs["decode"].recv(30, "stop")
            time.sleep(1.5)  # the prefill sees the decode's endpoints close
        except Exception:  # a broken run still reports what it counted
            failure = traceback.format_exc()
            print(failure, flush=True)
        finally:
            Path(work, "stop").touch()
            if shaped:
                sh("tc", "qdisc", "del", "dev", dh.link, "root", check=False)
            sh("tc", "qdisc", "del", "dev", ph.link, "root", check=False)
            sh("ip", "link", "set", ph.link, "up", check=False)
            for role in ("decode", "prefill"):
                if role in procs:
                    p = procs[role]
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.p.wait(15)
                    if p.p.returncode is not None and p.p.returncode < 0 and role == "prefill":
                        crashes.append(crash_record(p, role, len(cuts), None, "shutdown"))  # the decode closed
                    p.stop()
    mid_read = [c for c in cuts if 0 < c["bytes_sent_at_cut"] < c["posted"]["bytes"]]
    record = {
        "name": args.name,
        "command": [sys.executable, *sys.argv],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "node": platform.node()},
        "versions": versions(),
        "env": dict(kv.split("=", 1) for kv in args.env),
        "settings": {k: v for k, v in vars(args).items() if k not in ("dir", "device", "gen", "role")},
        "cuts": len(cuts),
        "cuts_mid_read": len(mid_read),
        "crashes": len([c for c in crashes if c["role"] == "prefill" and c["phase"] == "cut"]),
        "by_arm": {  # --alternate on: the treatment (barrier and/or linger) on odd cuts only
            arm: {
                "cuts": len([c for c in cuts if c["treated"] == flag]),
                "prefill_crashes": len(
                    [
                        x
                        for x in crashes
                        if x["role"] == "prefill"
                        and x["phase"] == "cut"
                        and any(c["cut"] == x["cut"] and c["treated"] == flag for c in cuts)
                    ]
                ),
                "decode_crashes": len(
                    [
                        x
                        for x in crashes
                        if x["role"] == "decode" and any(c["cut"] == x["cut"] and c["treated"] == flag for c in cuts)
                    ]
                ),
            }
            for arm, flag in (("treated", True), ("untreated", False))
        },
        "by_barrier": {
            arm: {
                "cuts": len([c for c in cuts if c["barrier"] == flag]),
                "crashes": len(
                    [
                        x
                        for x in crashes
                        if x["role"] == "prefill"
                        and x["phase"] == "cut"
                        and any(c["cut"] == x["cut"] and c["barrier"] == flag for c in cuts)
                    ]
                ),
            }
            for arm, flag in (("with", True), ("without", False))
        },
        "shutdown_crashes": len([c for c in crashes if c["role"] == "prefill" and c["phase"] == "shutdown"]),
        "decode_crashes": len([c for c in crashes if c["role"] == "decode"]),
        "signals": sorted({c["signal"] or f"rc={c['returncode']}" for c in crashes}),
        "seconds": round(time.monotonic() - t_start, 1),
        "failure": failure,
        "decode_stats": decode_stats,
        "crash_records": crashes,
        "cut_records": cuts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ucx-cut-{args.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(
        f"{args.name}: {record['crashes']} prefill crashes in {len(cuts)} cuts ({len(mid_read)} mid-READ)"
        f" + {record['shutdown_crashes']} at the decode's close, {record['decode_crashes']} decode crashes,"
        f" signals {record['signals']}, {record['seconds']} s; json: {path}"
    )
    return 1 if failure else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "prefill", "decode"], default="run")
    p.add_argument("--name", default="defaults", help="label of the configuration (in the result file's name)")
    p.add_argument("--cuts", type=int, default=50)
    p.add_argument("--budget-s", type=float, default=270.0, help="stop cutting after this long")
    p.add_argument("--env", action="append", default=[], help="K=V for both processes (UCX knobs), repeatable")
    p.add_argument("--tls", default="self,tcp", help="UCX_TLS (the e2e test's)")
    p.add_argument("--policy", choices=POLICIES, default="kvbridge")
    p.add_argument("--drop", choices=DROPS, default="never")
    p.add_argument(
        "--barrier-s", type=float, default=0.0, help="before removing the peer, a tiny READ waited for up to this"
    )
    p.add_argument(
        "--alternate", choices=["off", "on"], default="off", help="on: the barrier on odd cuts only (A/B in one run)"
    )
    p.add_argument(
        "--linger-s", type=float, default=0.0, help="before a drop or close, keep polling the endpoint this long"
    )
    p.add_argument(
        "--restart-each", action="store_true", help="a fresh prefill process for every cut (stopped cleanly first)"
    )
    p.add_argument("--cut", choices=["down", "netem"], default="down")
    p.add_argument("--rate", default="32mbit", help="tbf rate on the path to the decode host")
    p.add_argument("--reads", type=int, default=2, help="READs posted per cut")
    p.add_argument("--request-blocks", type=int, default=12)
    p.add_argument("--blocks", type=int, default=1024, help="blocks in the prefill's region")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cut-at", type=float, nargs=2, default=[0.05, 0.7], help="share of the bytes out at the cut")
    p.add_argument("--down-s", type=float, nargs=2, default=[0.3, 4.0])
    p.add_argument("--timeout-s", type=float, nargs=2, default=[0.5, 4.0], help="the decode's transfer timeout")
    p.add_argument("--settle-s", type=float, default=6.0, help="after the restore, wait this long for the READs")
    p.add_argument("--after-s", type=float, default=0.5, help="then up to this long (random) before the next")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--dir", default="")
    p.add_argument("--device", default="")
    p.add_argument("--gen", type=int, default=0)
    args = p.parse_args(argv)
    if args.role == "prefill":
        prefill_main(args)
        return 0
    if args.role == "decode":
        decode_main(args)
        return 0
    if args.cuts > 60:
        p.error("at most 60 cuts per run (keep runs bounded)")
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
