"""What a prefill instance's processes burn while it holds KV that no decode reads.

vLLM steps its engine continuously while a finished request's blocks are held: its scheduler counts the request as
work until the connector frees it (a decode read it, aborted it, or its lease ended). A decode that died, or a link
cut, leaves the prefill holding until `lease_s`. This bench starts one `kv_both` kvbridge server of the tiny model
per source tree (`--tree NAME=SRC`, e.g. the working tree and a `git worktree` of a base commit), side by side in one
run, and reads the CPU seconds of its process tree (API server, engine, workers) over `--window` seconds: idle,
then holding `--held` requests prefilled with `do_remote_decode` and never read. The trees alternate `--runs` times.

    flock /tmp/kvbridge-vllm.lock .venv/bin/python bench/held_kv_cpu.py --tree head=src \\
        --tree base=/tmp/held-base/src --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.serving.launcher import (  # noqa: E402
    VllmServer,
    complete,
    exit_on_sigterm,
    free_base_port,
    free_port,
    kvbridge_config,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model  # noqa: E402


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each process of the tree under `pid`, by "pid:name"."""
    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            out[f"{proc.pid}:{proc.name()[:24]}"] = times.user + times.system
        except psutil.Error:
            pass
    return out


def window(pid: int, seconds: float) -> dict[str, float]:
    """CPU seconds each process of the tree used over the next `seconds`."""
    before = tree_cpu(pid)
    time.sleep(seconds)
    after = tree_cpu(pid)
    return {name: round(after[name] - before.get(name, 0.0), 3) for name in after}


def commit_of(src: Path) -> str:
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def measure(model: Path, root: Path, name: str, src: Path, args: argparse.Namespace, run: int) -> dict:
    """One server of `src`'s kvbridge: its CPU idle, then holding `args.held` unread requests."""
    extra = {"side_channel_port": free_base_port(args.tp), "lease_s": args.lease}
    server = VllmServer(
        model,
        port=free_port(),
        pp=1,
        tp=args.tp,
        cpu_bind="|".join([args.core] * args.tp),
        kv_transfer_config=kvbridge_config("kv_both", **extra),
        name=f"held-{name}-{run}",
        log_path=root / f"{name}-{run}.log",
        env={"PYTHONPATH": str(src)},  # the server's processes import kvbridge from this tree
    )
    with running([server]):
        complete(server.url, list(range(1, 60)), 2)
        time.sleep(1.0)
        idle = window(server.process.pid, args.window)
        for i in range(args.held):
            complete(server.url, [7 + i + 10 * run] * 300, 1, kv_transfer_params={"do_remote_decode": True})
        held = window(server.process.pid, args.window)
    row = {
        "tree": name,
        "commit": commit_of(src),
        "run": run,
        "idle_cpu_s": round(sum(idle.values()), 3),
        "held_cpu_s": round(sum(held.values()), 3),
        "held_by_process": held,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC, a kvbridge source folder")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--core", default="1", help="the core every worker is bound to")
    parser.add_argument("--held", type=int, default=3)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--lease", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = parser.parse_args()
    trees = [(name, Path(src).resolve()) for name, src in (t.split("=", 1) for t in args.tree)]
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvbridge-held-{os.getpid()}"
    model = build_tiny_model(root / "model")
    rows = [measure(model, root, name, src, args, run) for run in range(args.runs) for name, src in trees]
    summary = {}
    for name, _ in trees:
        mine = [r for r in rows if r["tree"] == name]
        summary[name] = {
            "commit": mine[0]["commit"],
            "idle_cpu_s": [r["idle_cpu_s"] for r in mine],
            "held_cpu_s": [r["held_cpu_s"] for r in mine],
        }
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
        "what": f"CPU seconds of one tp{args.tp} kv_both server's process tree over {args.window:g} s, idle and "
        f"holding {args.held} requests never read",
        "summary": summary,
        "runs": rows,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"held-kv-cpu-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print("saved", path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
