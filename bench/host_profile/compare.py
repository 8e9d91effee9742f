"""Two sets of `sitecustomize.py` profiles side by side: per function, the median thread-CPU time per call in each
set and their ratio (second over first). Each set is one or more folders (e.g. one per round of an alternating run):

    python3 bench/host_profile/compare.py --base /tmp/hp/base-* --head /tmp/hp/head-* [--skip 2]

Thread-CPU time leaves out the time a thread waits (for a core, a lock, an answer), so on a shared machine it
moves less than wall time; functions neither set changed show how much it still moves.
"""

import argparse
import glob
import json
import os
import statistics


def pooled(folders: list[str], skip: int) -> dict[str, list[float]]:
    """Function name -> thread-CPU microseconds of every call after each process's first `skip`, over all threads."""
    out: dict[str, list[float]] = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "prof-*.json"))):
            with open(path) as f:
                calls = json.load(f)
            for key, values in calls.items():
                out.setdefault(key.split("|", 1)[1], []).extend(cpu for _, cpu in values[skip:])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", nargs="+", required=True, help="folders of the first set")
    p.add_argument("--head", nargs="+", required=True, help="folders of the second set")
    p.add_argument("--skip", type=int, default=2, help="first calls left out per process (the cold first loads)")
    args = p.parse_args()
    base, head = pooled(args.base, args.skip), pooled(args.head, args.skip)
    print(f"{'function':32} {'calls':>11} {'base us':>9} {'head us':>9} {'ratio':>6}")
    for name in sorted(base.keys() & head.keys()):
        if base[name] and head[name]:
            b, h = statistics.median(base[name]), statistics.median(head[name])
            ratio = h / b if b else float("nan")
            print(f"{name:32} {len(base[name]):5}/{len(head[name]):5} {b:9.1f} {h:9.1f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
