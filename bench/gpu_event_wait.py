"""How a decode worker should learn that its gather kernel finished: wake-up delay and CPU cost per way of waiting.

A GPU kernel of known length (torch.cuda._sleep) stands in for the gather; a helper thread waits for its event:

  spin       event.query() in a tight loop (a core at 100%, holding the GIL between queries)
  backoff    event.query() with sleeps of 50 us doubling to 2 ms (the decode worker's NIXL polling)
  blocking   a cudaEventBlockingSync event, event.synchronize() (the thread sleeps in the driver)
  predicted  sleep 90% of the expected time, then event.query() every 20 us (sleeping between)

For each it reports the median delay from the kernel's end (the spin wait's wake-up, measured alternately, is the
reference) and how many iterations the main Python thread completed meanwhile (does the waiter leave the GIL?).

    python3 bench/gpu_event_wait.py --out DIR     # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.transport.backoff import Backoff  # noqa: E402


def cycles_for(seconds: float) -> int:
    """torch.cuda._sleep cycles that take about `seconds` on this GPU."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)
    return int(seconds * per_s)


def wait(way: str, event: torch.cuda.Event, expected_s: float) -> None:
    if way == "predicted":
        time.sleep(0.9 * expected_s)
        while not event.query():
            time.sleep(20e-6)
    elif way == "blocking":
        event.synchronize()
    elif way == "spin":
        while not event.query():
            pass
    else:
        backoff = Backoff(first_s=50e-6, cap_s=2e-3)
        while not event.query():
            time.sleep(backoff.step())


def one(way: str, cycles: int, busy: bool, expected_s: float) -> tuple[float, int]:
    """Seconds from launch to the waiter's wake-up, and the main thread's loop iterations meanwhile (busy: the
    main thread runs Python meanwhile, as an engine's step does; else it waits in join)."""
    event = torch.cuda.Event(blocking=way == "blocking")
    woke: list[float] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    event.record()
    waiter = threading.Thread(target=lambda: (wait(way, event, expected_s), woke.append(time.perf_counter())))
    waiter.start()
    spins = 0
    while busy and waiter.is_alive():
        spins += 1
    waiter.join()
    return woke[0] - t0, spins


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel-ms", nargs="+", type=float, default=[1.0, 2.0, 3.0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for busy in (False, True):
        for ms in args.kernel_ms:
            cycles = cycles_for(ms / 1e3)
            times: dict[str, list[float]] = {w: [] for w in ("spin", "backoff", "blocking", "predicted")}
            spins: dict[str, list[int]] = {w: [] for w in times}
            for _ in range(args.reps):
                for way in times:  # alternately, so all three see the same machine state
                    s, n = one(way, cycles, busy, ms / 1e3)
                    times[way].append(s)
                    spins[way].append(n)
            ref = statistics.median(times["spin"])
            for way in times:
                med = statistics.median(times[way])
                row = {
                    "main_thread": "busy" if busy else "idle",
                    "kernel_ms": ms,
                    "way": way,
                    "wake_median_ms": med * 1e3,
                    "delay_vs_spin_us": (med - ref) * 1e6,
                    "main_thread_iterations_median": statistics.median(spins[way]),
                }
                rows.append(row)
                print(
                    f"main thread {row['main_thread']}  kernel {ms:4.1f} ms  {way:9} wake after {med * 1e3:6.3f} ms"
                    f"  (+{(med - ref) * 1e6:7.1f} us vs spin)  main ran {row['main_thread_iterations_median']:>9,.0f}",
                    flush=True,
                )
    record = {"command": [sys.executable, *sys.argv], "device": torch.cuda.get_device_name(), "rows": rows}
    (args.out / f"gpu-event-wait-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
