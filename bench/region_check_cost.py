"""What it costs to find the regions a READ's descriptors land in (`NixlTransport._mem_type_of`), three ways, per
call: `np.unique`, a set of the ids, a count per region (`np.bincount`); the fastest of `--repeat` rounds of
`--number` calls, for READs of 16 to 115,000 descriptors (the sizes of docs/benchmarks/gpu-one-node.md) over
`--regions` regions. Prints a table and saves a JSON with the command and machine:

    .venv/bin/python bench/region_check_cost.py --out bench/results
"""

import argparse
import json
import os
import platform
import sys
import time
import timeit

import numpy as np

SIZES = (16, 64, 128, 256, 1024, 14336, 115000)


def ways(used: np.ndarray, regions: int) -> dict:
    return {
        "np.unique": lambda: np.unique(used).tolist(),
        "set": lambda: set(used.tolist()),
        "bincount": lambda: np.flatnonzero(np.bincount(used, minlength=regions)).tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regions", type=int, default=56, help="regions of the worker (vLLM: one per layer and K/V)")
    p.add_argument("--number", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for the JSON (none: print only)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'descriptors':>11} " + " ".join(f"{w:>10}" for w in ways(np.zeros(1, np.int64), 1)) + "   (us per call)")
    for n in SIZES:
        used = rng.integers(0, args.regions, n).astype(np.int64)
        us = {
            w: min(timeit.repeat(f, number=args.number, repeat=args.repeat)) / args.number * 1e6
            for w, f in ways(used, args.regions).items()
        }
        rows.append({"descriptors": n, **{k: round(v, 2) for k, v in us.items()}})
        print(f"{n:>11} " + " ".join(f"{v:>10.1f}" for v in us.values()))
    if args.out:
        path = os.path.join(args.out, f"region-check-cost-{time.strftime('%Y%m%d-%H%M%S')}.json")
        meta = {"command": " ".join(sys.argv), "machine": {"platform": platform.platform(), "nproc": os.cpu_count()}}
        with open(path, "w") as f:
            json.dump({**meta, "regions": args.regions, "rows": rows}, f, indent=1)
        print("saved", path)


if __name__ == "__main__":
    main()
