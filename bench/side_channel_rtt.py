"""Side-channel round trip of a kept client (what each claim costs), for two source trees side by side.

Each round runs one subprocess per tree (alternating, `--rounds` times): a `SideChannelServer` answering Ack and a
`SideChannelClient` sending `--messages` messages one after another to it on 127.0.0.1; the median microseconds per
round trip of each subprocess are compared (ratio of the medians over rounds). Used to check what the side
channel's peer watch (`wire/peer_watch.py`: a ZMQ monitor per client socket) costs a claim.

    flock /tmp/kvbridge-vllm.lock python bench/side_channel_rtt.py --base ../base/src --new src \\
        --out bench/results/side-channel-rtt-<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import statistics, sys, time
from kvbridge.wire import messages as wire
from kvbridge.wire import side_channel as sc
from kvbridge.wire import side_channel_client as scc
from kvbridge.wire import side_channel_server as scs
n = int(sys.argv[1])
server = scs.SideChannelServer(0, lambda m: wire.Ack())
server.start()
client = scc.SideChannelClient(timeout_s=2.0, retries=1)
target = [("127.0.0.1", server.port)]
for _ in range(50):
    client.exchange_all(target, wire.Ack())
took = []
for _ in range(n):
    t0 = time.perf_counter()
    client.exchange_all(target, wire.Ack())
    took.append(time.perf_counter() - t0)
client.close()
server.close()
print(statistics.median(took) * 1e6)
"""


def run(src: str, messages: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    out = subprocess.run([sys.executable, "-c", CHILD, str(messages)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the reference tree's src folder")
    p.add_argument("--new", required=True, help="the tree measured against it")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    base, new = [], []
    for _ in range(args.rounds):
        base.append(run(args.base, args.messages))
        new.append(run(args.new, args.messages))
    result = {
        "command": "python " + " ".join(sys.argv),
        "host": f"{platform.node()} ({os.cpu_count()} cores)",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": args.base,
        "new": args.new,
        "base_median_us": [round(x, 1) for x in base],
        "new_median_us": [round(x, 1) for x in new],
        "ratio_new_to_base": round(statistics.median(new) / statistics.median(base), 3),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
