"""`kvbridge demo`: a disaggregated prefill/decode deployment on this machine, end to end, in a few minutes.

It builds a tiny model with seeded real weights (or uses --model), starts a prefill vLLM server with PP=2 and
a decode server with another layout (TP=2 by default), both with kvbridge, on loopback; warms both up (vLLM
on CPU prepares its kernels on the first requests, which would make the first TTFT read like a hang: one short
plain request to each server and one short disaggregated request, not timed); sends a handful of prompts
through the PD protocol (prefill leg with max_tokens=1 and do_remote_decode, decode leg with the returned
kv_transfer_params), and prints one row per request: prompt tokens, TTFT, KV bytes moved, and from the decode
server's kvbridge metrics the load's claim wait, its KV hop (claim sent -> data landed) and its wire time (posting
the READs -> data landed), and whether the output equals a non-disaggregated run. It ends with one summary line:
requests, how many equal the aggregated run, median TTFT, KV moved in all, the median claim wait and KV hop, and
the wire rate (bytes over wire time only).
Every process it started is stopped on success, failure and Ctrl-C.

Both servers share a deployment key, so their side channels answer only each other: a fresh random key in a
private temporary file (0600, removed at the end) unless --auth-key-file names one.
--keyless-exposes-kv-to-local-processes runs without one (loopback only, and any local process could then read the KV).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from kvbridge.core.topology import ParallelLayout
from kvbridge.serving.launcher import (
    INSECURE_WARNING,
    VllmServer,
    complete,
    complete_streaming,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    private_key_file,
)
from kvbridge.serving.tiny_model import build_tiny_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: build a tiny seeded Qwen2 model locally)")
    p.add_argument("--prefill", default="pp=2,tp=1", help="prefill layout (default pp=2,tp=1)")
    p.add_argument("--decode", default="pp=1,tp=2", help="decode layout (default pp=1,tp=2)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workdir", default=".kvbridge-demo", help="where the model and server logs go")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--auth-key-file", metavar="PATH", help="the deployment key (default: a fresh one in a private temp file)"
    )
    key.add_argument(
        "--keyless-exposes-kv-to-local-processes",
        action="store_true",
        help="no deployment key: any local process can read the KV",
    )


def _cores(workers: int, side: int) -> str:
    """Prefill workers on the first half of the cores, decode workers on the second (on 2 cores: one each).

    A prefill server that holds blocks for readers is stepped continuously by vLLM; sharing a core with it
    would starve the decode server."""
    n = os.cpu_count() or 2
    half = max(1, n // 2)
    cores = list(range(half)) if side == 0 else list(range(half, n)) or [0]
    return "|".join(str(cores[i % len(cores)]) for i in range(workers))


def _server(
    name: str, model: Path, layout: ParallelLayout, side: int, workdir: Path, key_file: Path | None
) -> VllmServer:
    secure = (
        {"auth_key_file": str(key_file)} if key_file is not None else {"keyless_exposes_kv_to_local_processes": True}
    )
    return VllmServer(
        model,
        port=free_port(),
        pp=layout.pp,
        tp=layout.tp,
        cpu_bind=_cores(layout.workers_per_engine, side),
        kv_transfer_config=kvbridge_config(  # recompute: a failed load costs latency, not the request
            "kv_both", "recompute", side_channel_port=free_base_port(layout.workers_per_engine), **secure
        ),
        name=name,
        log_path=workdir / f"{name}.log",
    )


def _wait_all(servers: list[VllmServer], timeout: float) -> None:
    """Wait for every server, printing progress every few seconds (start-up takes 30-40 s each on CPU)."""
    done = threading.Event()
    errors: list[BaseException] = []

    def wait(server: VllmServer) -> None:
        try:
            server.wait_ready(timeout)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    start = time.monotonic()
    while any(t.is_alive() for t in threads):
        done.wait(5)
        states = ", ".join(f"{s.name}: {'ready' if s.ready_after_s else 'starting'}" for s in servers)
        print(f"  {time.monotonic() - start:5.0f} s  {states}", flush=True)
        if errors:
            break
    if errors:
        raise errors[0]


PHASES = ("claim", "hop", "post", "wire")
"""The load phases a row shows (vllm:kvbridge_load_phase_seconds): claim sent -> granted, claim sent -> data
landed, and the wire time: posting the READs (with CMA on one host the copy runs inside the post) plus posted ->
data landed."""


def _kv_metrics(url: str) -> tuple[float, ...]:
    """(KV bytes, loads, then each of PHASES' seconds summed over the decode workers' loads)."""
    m = metrics(url)
    name = "vllm:kvbridge_load_phase_seconds"
    return (
        metric_sum(m, "vllm:kvbridge_bytes_total"),
        metric_sum(m, f"{name}_count", phase="wire"),
        *(metric_sum(m, f"{name}_sum", phase=phase) for phase in PHASES),
    )


def _wait_metrics(url: str, before: tuple[float, ...], timeout: float = 5.0) -> tuple[float, ...]:
    """vLLM publishes connector stats with the engine's periodic stats: wait for them to move."""
    deadline = time.monotonic() + timeout
    now = _kv_metrics(url)
    while (now[0] == before[0] or now[1] == before[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _kv_metrics(url)
    return now


def _warm_up(prefill: VllmServer, decode: VllmServer, rng: random.Random) -> float:
    """One short plain request to each server and one short disaggregated request (which also makes the decode
    side's first handshake), each with its own prompt; returns the seconds it took. Waits until the decode
    server's metrics show the warm-up's transfer, so that no timed row counts its bytes."""
    start = time.monotonic()
    plain_p, plain_d, pd = ([rng.randrange(1, 1000) for _ in range(48)] for _ in range(3))
    complete(prefill.url, plain_p, 2, timeout=600)
    complete(decode.url, plain_d, 2, timeout=600)
    before = _kv_metrics(decode.url)
    first = complete(prefill.url, pd, 1, kv_transfer_params={"do_remote_decode": True}, timeout=600)
    complete_streaming(decode.url, pd, 2, kv_transfer_params=first["kv_transfer_params"], timeout=600)
    _wait_metrics(decode.url, before)
    return time.monotonic() - start


class Row(NamedTuple):
    """One timed request: TTFT, KV bytes moved (all decode workers), and per decode worker's load (its mean over
    the workers, which read in parallel) the claim wait, the KV hop and the wire time, in seconds."""

    ttft_s: float
    moved: float
    claim_s: float
    hop_s: float
    wire_s: float  # posting the READs -> data landed
    equal: bool

    @property
    def wire_rate(self) -> float:
        """GB/s over the wire time only (the workers read their shares in parallel)."""
        return self.moved / self.wire_s / 1e9 if self.wire_s > 0 else 0.0


def summary(rows: list[Row]) -> str:
    """The closing line: medians of TTFT, claim wait and KV hop; KV moved in all and the wire rate (bytes over
    wire time only: READs posted -> data landed, so claims, queues and vLLM's steps are not in it)."""

    def median(values) -> float:
        values = list(values)
        return statistics.median(values) if values else 0.0

    moved, wire_s = sum(r.moved for r in rows), sum(r.wire_s for r in rows)
    equal = sum(r.equal for r in rows)
    rate = moved / wire_s / 1e9 if wire_s > 0 else 0.0
    ttft, claim, hop = (1000 * median(getattr(r, k) for r in rows) for k in ("ttft_s", "claim_s", "hop_s"))
    line = (
        f"summary: {len(rows)} requests, {equal} of {len(rows)} equal the aggregated run, median TTFT {ttft:.1f} ms, "
        f"{moved / 2**20:.2f} MiB of KV moved, median claim wait {claim:.2f} ms, median KV hop {hop:.2f} ms, "
        f"wire rate {rate:.2f} GB/s (wire time only)"
    )
    return line if equal == len(rows) else line + "; SOME OUTPUTS DIFFER"


def run(args: argparse.Namespace) -> int:
    if args.keyless_exposes_kv_to_local_processes:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
        return _run(args, None)
    with private_key_file(args.auth_key_file) as key_file:
        made = "given" if args.auth_key_file else "a fresh random key, removed at the end"
        print(f"deployment key: {key_file} ({made}); the side channels answer only holders of it", flush=True)
        return _run(args, key_file)


def _run(args: argparse.Namespace, key_file: Path | None) -> int:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    prefill_layout = ParallelLayout.parse(args.prefill)
    decode_layout = ParallelLayout.parse(args.decode)
    if args.model:
        model = Path(args.model)
    else:
        print(f"building a tiny seeded Qwen2 model in {workdir / 'model'} ...", flush=True)
        model = build_tiny_model(workdir / "model")
    prefill = _server("prefill", model, prefill_layout, 0, workdir, key_file)
    decode = _server("decode", model, decode_layout, 1, workdir, key_file)
    print(f"starting prefill ({prefill_layout}) and decode ({decode_layout}) vLLM servers; logs in {workdir}")
    with prefill, decode:  # entering starts them; leaving stops them, also on errors and Ctrl-C
        _wait_all([prefill, decode], args.startup_timeout)
        print(f"ready: prefill {prefill.url}, decode {decode.url}", flush=True)
        print("warming up both servers (vLLM prepares its kernels on the first requests; not timed) ...", flush=True)
        print(f"warmed up in {_warm_up(prefill, decode, random.Random(1)):.1f} s\n", flush=True)
        rng = random.Random(0)
        header = (
            f"{'req':>3} {'prompt':>6} {'TTFT ms':>8} {'prefill ms':>10} {'KV MiB':>7} {'claim ms':>8} {'hop ms':>7} "
            f"{'wire ms':>7} {'GB/s':>6}  output = aggregated"
        )
        print(header)
        print("-" * len(header))
        rows: list[Row] = []
        for i in range(args.requests):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(64, 700))]
            before = _kv_metrics(decode.url)
            t0 = time.monotonic()
            first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=120)
            prefill_s = time.monotonic() - t0
            tokens, first_token_s = complete_streaming(
                decode.url, prompt, args.max_tokens, kv_transfer_params=first["kv_transfer_params"], timeout=120
            )
            ttft = prefill_s + first_token_s
            after = _wait_metrics(decode.url, before)
            moved, loads = after[0] - before[0], max(1.0, after[1] - before[1])
            claim_s, hop_s, post_s, wire_s = ((a - b) / loads for a, b in zip(after[2:], before[2:], strict=True))
            wire_s += post_s
            reference = complete(prefill.url, prompt, args.max_tokens)["choices"][0]["token_ids"]
            row = Row(ttft, moved, claim_s, hop_s, wire_s, tokens == reference)
            rows.append(row)
            print(
                f"{i:>3} {len(prompt):>6} {1000 * ttft:>8.1f} {1000 * prefill_s:>10.1f} {moved / 2**20:>7.2f} "
                f"{1000 * claim_s:>8.2f} {1000 * hop_s:>7.2f} {1000 * wire_s:>7.2f} {row.wire_rate:>6.2f}  "
                f"{'yes' if row.equal else 'NO'}",
                flush=True,
            )
        print(
            "\nTTFT = prefill leg + decode leg to its first token. From the decode server's kvbridge metrics: KV MiB "
            "(vllm:kvbridge_bytes_total, all workers); per worker's load (mean over the workers, which read in "
            "parallel) claim ms (claim sent -> granted), hop ms (claim sent -> data landed) and wire ms (READs "
            "posted, with CMA the copy itself, -> data landed) from vllm:kvbridge_load_phase_seconds; GB/s = KV MiB "
            "over wire ms."
        )
        print(summary(rows), flush=True)
        return 0 if all(r.equal for r in rows) else 1
