"""Medians per (thread, function) of the calls `sitecustomize.py` timed: python3 summarize.py DIR [--skip N]."""

import argparse
import glob
import json
import os
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--skip", type=int, default=2, help="first calls left out per function (the cold first loads)")
    args = p.parse_args()
    for path in sorted(glob.glob(os.path.join(args.folder, "prof-*.json"))):
        print("==", os.path.basename(path))
        with open(path) as f:
            calls = json.load(f)
        for key in sorted(calls):
            kept = calls[key][args.skip :] or calls[key]
            wall = statistics.median(c[0] for c in kept)
            cpu = statistics.median(c[1] for c in kept)
            print(f"{key:60} n={len(kept):5} wall_med={wall:9.1f}us cpu_med={cpu:9.1f}us")


if __name__ == "__main__":
    main()
