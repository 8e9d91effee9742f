"""Where the CPU goes when prefill and decode workers share a core: per-thread scheduler statistics per request.

Same placement as bench/shared_cores.py (prefill pp=1 on core 0; decode tp=2 on "1|0"). For each 300-token PD
request: the prefill leg's and the decode leg's seconds, and for every thread of both servers' processes the time
it ran and the time it waited runnable on a run queue (/proc/<pid>/task/<tid>/schedstat) over the request. The
threads that ran or waited most are kept. This is what showed vLLM's own busy loops (a worker spins with
sched_yield for 1 s after each step it reads; an engine steps continuously while loads are pending or blocks held).

    .venv/bin/python bench/shared_cores_threads.py [--requests 6] [--idle-wait 0.005] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    exit_on_sigterm,
    free_base_port,
    free_port,
    kvbridge_config,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model


def family(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def sample(pids: list[int]) -> dict[tuple[int, int], tuple[str, float, float]]:
    """(pid, tid) -> ("process/thread", seconds run, seconds waited runnable)."""
    out = {}
    for pid in pids:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                thread = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                run, wait, _ = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            out[(pid, int(tid))] = (f"{process}/{thread}", run / 1e9, wait / 1e9)
    return out


def main() -> None:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--idle-wait", type=float, default=0.005)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvbridge-threads-"))
    model = build_tiny_model(root / "model")
    extra = {"idle_wait_s": args.idle_wait}
    prefill = VllmServer(
        model,
        port=free_port(),
        cpu_bind="0",
        kv_transfer_config=kvbridge_config("kv_producer", side_channel_port=free_base_port(1), **extra),
        name="prefill",
        log_path=root / "prefill.log",
    )
    decode = VllmServer(
        model,
        port=free_port(),
        tp=2,
        cpu_bind="1|0",
        kv_transfer_config=kvbridge_config("kv_consumer", "recompute", side_channel_port=free_base_port(1), **extra),
        name="decode",
        log_path=root / "decode.log",
    )
    rows = []
    with running((prefill, decode)):
        rng = random.Random(18)
        for server in (prefill, decode):
            complete(server.url, [rng.randrange(1, 1000) for _ in range(20)], 2)
        pids = family(prefill.process.pid) + family(decode.process.pid)
        roles = {p: "prefill" for p in family(prefill.process.pid)} | {p: "decode" for p in family(decode.process.pid)}
        for i in range(args.requests):
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            before, t0 = sample(pids), time.monotonic()
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
            t1 = time.monotonic()
            complete(decode.url, prompt, 8, kv_transfer_params=params["kv_transfer_params"], timeout=120)
            t2, after = time.monotonic(), sample(pids)
            threads = []
            for key, (name, run, wait) in after.items():
                if key in before:
                    ran, waited = run - before[key][1], wait - before[key][2]
                    if ran > 0.05 or waited > 0.3:
                        threads.append(
                            {
                                "server": roles[key[0]],
                                "thread": name,
                                "tid": key[1],
                                "ran_s": round(ran, 3),
                                "waited_s": round(waited, 3),
                            }
                        )
            threads.sort(key=lambda t: -t["ran_s"])
            row = {"prefill_leg_s": round(t1 - t0, 3), "decode_leg_s": round(t2 - t1, 3), "threads": threads[:8]}
            rows.append(row)
            print(f"request {i}: prefill leg {row['prefill_leg_s']} s, decode leg {row['decode_leg_s']} s")
            for t in threads[:6]:
                print(f"    {t['server']:7} {t['thread']:40} ran {t['ran_s']:6.2f} s  waited {t['waited_s']:6.2f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"shared-cores-threads-{time.strftime('%Y%m%d-%H%M%S')}.json"
    load = os.getloadavg()
    path.write_text(
        json.dumps(
            {
                "command": " ".join([sys.executable, *sys.argv]),
                "machine": {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_at_end": load},
                "placement": {"prefill": "pp=1 on core 0", "decode": "tp=2 on 1|0"},
                "idle_wait_s": args.idle_wait,
                "requests": rows,
            },
            indent=1,
        )
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
