"""PD requests with a prefill and a decode worker sharing a core, the workers' idle wait off and on (issue
"Liveness", item 5), one after the other in one run.

Prefill pp=1 on core 0; decode tp=2 on "1|0" (its second worker shares core 0). For each setting of
`idle_wait_s` on both sides (0 = off, then the default): fresh servers, both warmed, then N 300-token prompts
through the PD protocol (prefill leg max_tokens=1, then the decode leg, policy recompute so a failed load still
answers). Per request: seconds, whether every prompt token came through kvbridge (external_kv_transfer), and output
equal to the prefill server's own. Meanwhile a probe thread sends a Claim to the prefill worker's side channel every
0.3 s and records each answer's latency (what a decode worker's claim waits). With --background N, N more client
threads keep both servers generating (plain 64-token requests) throughout: claims with both engines under full load.

    .venv/bin/python bench/shared_cores.py [--requests 8] [--background 0] [--waits 0 0.005] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvbridge.core.config import BridgeConfig
from kvbridge.serving.launcher import (
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
from kvbridge.serving.tiny_model import build_tiny_model
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel_client import exchange

SOURCE = "vllm:prompt_tokens_by_source_total"


def probe(port: int, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        claim = wire.Claim(request_id="probe", block_ids=(), engine_id="x", worker=wire.Worker())
        try:
            exchange("127.0.0.1", port, claim, timeout_s=10, retries=0)
            out.append(round(time.monotonic() - t0, 4))
        except Exception:
            out.append(None)  # no answer in 10 s
        stop.wait(0.3)


def busy(urls: list[str], stop: threading.Event, seed: int, count: list) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        for url in urls:
            complete(url, [rng.randrange(1, 1000) for _ in range(50)], 64, timeout=120, ignore_eos=True)
            count[0] += 1


def run(model: Path, root: Path, idle_wait_s: float, requests: int, background: int = 0) -> dict:
    port = free_base_port(1)
    prefill = VllmServer(
        model,
        port=free_port(),
        cpu_bind="0",
        kv_transfer_config=kvbridge_config("kv_producer", side_channel_port=port, idle_wait_s=idle_wait_s),
        name="prefill",
        log_path=root / f"prefill-{idle_wait_s}.log",
    )
    decode = VllmServer(
        model,
        port=free_port(),
        tp=2,
        cpu_bind="1|0",
        kv_transfer_config=kvbridge_config(
            "kv_consumer", "recompute", side_channel_port=free_base_port(1), idle_wait_s=idle_wait_s
        ),
        name="decode",
        log_path=root / f"decode-{idle_wait_s}.log",
    )
    rows, lat, stop = [], [], threading.Event()
    with running((prefill, decode)):
        rng = random.Random(1)
        for server in (prefill, decode):
            complete(server.url, [rng.randrange(1, 1000) for _ in range(20)], 2)
        thread = threading.Thread(target=probe, args=(port, stop, lat), daemon=True)
        thread.start()
        generated = [0]
        loaders = [
            threading.Thread(target=busy, args=([prefill.url, decode.url], stop, 100 + i, generated), daemon=True)
            for i in range(background)
        ]
        for loader in loaders:
            loader.start()
        for _ in range(requests):
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            before = metric_sum(metrics(decode.url), SOURCE, source="external_kv_transfer")
            t0 = time.monotonic()
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
            got = complete(decode.url, prompt, 8, kv_transfer_params=params["kv_transfer_params"], timeout=120)
            seconds = time.monotonic() - t0
            moved = metric_sum(metrics(decode.url), SOURCE, source="external_kv_transfer") - before
            same = got["choices"][0]["token_ids"] == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
            rows.append({"seconds": round(seconds, 3), "transferred": moved == len(prompt), "equal": same})
        stop.set()
        thread.join()
        for loader in loaders:
            loader.join(120)
    answered = [x for x in lat if x is not None]
    return {
        "idle_wait_s": idle_wait_s,
        "background_clients": background,
        "background_requests": generated[0],
        "requests": rows,
        "transferred": sum(r["transferred"] for r in rows),
        "seconds_median": statistics.median(r["seconds"] for r in rows),
        "seconds_max": max(r["seconds"] for r in rows),
        "probe_answers": len(answered),
        "probe_unanswered_10s": len(lat) - len(answered),
        "probe_median_s": statistics.median(answered) if answered else None,
        "probe_max_s": max(answered) if answered else None,
    }


def main() -> None:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--background", type=int, default=0, help="client threads keeping both servers busy")
    parser.add_argument("--waits", type=float, nargs="+", default=[0.0, BridgeConfig().idle_wait_s])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        results = [run(model, root, wait, args.requests, args.background) for wait in args.waits]
    for r in results:
        print(
            f"idle_wait_s={r['idle_wait_s']} background={r['background_clients']}: "
            f"{r['transferred']}/{len(r['requests'])} transferred, "
            f"seconds median {r['seconds_median']:.2f} max {r['seconds_max']:.2f}; side-channel probe "
            f"median {r['probe_median_s']} max {r['probe_max_s']} s, unanswered in 10 s: {r['probe_unanswered_10s']}"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"shared-cores-{stamp}.json"
    record = {"command": " ".join([sys.executable, *sys.argv]), "machine": platform.platform(), "results": results}
    path.write_text(json.dumps(record, indent=2))
    print("saved", path)


if __name__ == "__main__":
    main()
