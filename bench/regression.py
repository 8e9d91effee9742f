"""The same bench on two commits side by side in one run, and one JSON with the ratios (head over base).

Each commit gets a tree of its own (`git worktree add --detach`, removed at the end; or a tree given with
`--base-tree`/`--head-tree`, e.g. `git archive` output carried to a machine without the repository), and every
measurement alternates between the two trees, so that both see the same machine state.

- `cpu`: disaggregated prefill/decode through real vLLM servers (CPU, the tiny seeded model; prefill workers on
  core 0, decode workers on core 1), the servers importing kvbridge from the commit's tree. `--busy-tokens N`
  keeps the prefill server computing other prompts of N tokens meanwhile (a loaded prefill instance). Per request: TTFT,
  its prefill leg, its decode leg (TTFT minus the prefill leg), and from the decode server's metrics the KV bytes
  and `vllm:kvbridge_transfer_seconds` (a commit's own meaning: claim sent -> data landed from 58b7562 on, job
  queued -> completion before it) and each load phase (`handshake` holds the claim's building from 0be9247 on,
  `claim` before it). Runs `--runs` rounds per pair, the commits' order turning each round. Wrap in
  `flock /tmp/kvbridge-vllm.lock` on a shared machine.
- `gpu`: `bench/gpu_workers.py` of each commit's own tree (its runtime, its scenario), the same arguments, rounds
  alternating; per (pair, path, claims) the warm load, the time to posting (job -> READs posted or kernels
  queued) and the kernels' GPU time: each run's fields in seconds as the bench wrote them, the summary's medians
  in milliseconds (`*_median_ms`; files up to regression-gpu-1a2bed2-9971c0f-20261207-054009.json name them
  `*_median_s`).

    flock /tmp/kvbridge-vllm.lock .venv/bin/python bench/regression.py cpu --base b59d6e4 --head HEAD
    python3 bench/regression.py gpu --base-tree T/base --head-tree T/head -- --pairs 'pp1->pp1' --paths auto
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from machine_load import OtherLoad, describe  # noqa: E402

# --- the two trees ----------------------------------------------------------------------------------------------


def rev(commit: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=9", commit], check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def trees(args):
    """{"base": (label, dir), "head": (label, dir)}: given trees, or worktrees of the commits made here."""
    made: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-regression-"))
    out = {}
    try:
        for side in ("base", "head"):
            given = getattr(args, f"{side}_tree")
            if given:
                out[side] = (getattr(args, side) or Path(given).name, Path(given).resolve())
                continue
            sha = rev(getattr(args, side))
            path = tmp / sha
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True, capture_output=True
            )
            made.append(path)
            out[side] = (sha, path)
        yield out
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        with contextlib.suppress(OSError):
            tmp.rmdir()


def ratio(head: float | None, base: float | None) -> float | None:
    return round(head / base, 3) if head and base else None


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --- cpu: PD TTFT through real vLLM servers ----------------------------------------------------------------------

LAYOUTS = {"pp1": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}


def keep_busy(url: str, tokens: int, clients: int, timeout: float):
    """Start `clients` threads that send the server prefill-only requests of `tokens` fresh random tokens, one after
    another, until the returned event is set: a prefill engine that is always computing another prompt."""
    import threading

    from kvbridge.serving.launcher import complete

    stop = threading.Event()

    def run(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                complete(url, [rng.randrange(1, 1000) for _ in range(tokens)], 1, timeout=timeout)
            except Exception:
                stop.wait(0.5)  # the server is gone or failing: do not spin

    threads = [threading.Thread(target=run, args=(1000 + i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    stop.threads = threads  # joined by `stop_busy`
    return stop


def stop_busy(stop) -> None:
    if stop is not None:
        stop.set()
        for thread in stop.threads:
            thread.join(timeout=30)


def tree_config(tree: Path, config: dict) -> dict:
    """`config` with the connector settings the tree's kvbridge does not know left out: a commit from before
    `keyless_exposes_kv_to_local_processes` served loopback servers without a key by default, and its config
    refuses unknown fields."""
    known = "".join(p.read_text() for p in (tree / "src" / "kvbridge").rglob("config.py"))
    extra = {k: v for k, v in config["kv_connector_extra_config"].items() if k in known}
    return {**config, "kv_connector_extra_config": extra}


def cpu_pair(model, pair: str, tree: Path, prompts, workdir: Path, timeout: float, busy=(0, 0)) -> dict:
    from kvbridge.serving.launcher import (
        VllmServer,
        complete,
        complete_streaming,
        free_base_port,
        free_port,
        kvbridge_config,
        metric_sum,
        metrics,
    )

    env = {"PYTHONPATH": str(tree / "src")}
    servers = []
    for role, layout, core in (("prefill", pair.split("-")[0], "0"), ("decode", pair.split("-")[1], "1")):
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        pp, tp = LAYOUTS[layout]
        servers.append(
            VllmServer(
                model,
                port=free_port(),
                pp=pp,
                tp=tp,
                cpu_bind="|".join([core] * (pp * tp)),
                kv_transfer_config=tree_config(
                    tree, kvbridge_config(kv_role, side_channel_port=free_base_port(pp * tp))
                ),
                env=env,
                name=f"{role}-{layout}",
                log_path=workdir / f"{tree.name}-{role}-{layout}.log",
            )
        )
    prefill, decode = servers

    def kv() -> tuple[float, ...]:
        """KV bytes, transfer seconds and loads, then each load phase's seconds (commits that export them)."""
        m = metrics(decode.url)
        return (
            metric_sum(m, "vllm:kvbridge_bytes_total"),
            metric_sum(m, "vllm:kvbridge_transfer_seconds_sum"),
            metric_sum(m, "vllm:kvbridge_transfer_seconds_count"),
            *(metric_sum(m, "vllm:kvbridge_load_phase_seconds_sum", phase=p) for p in CPU_PHASES),
        )

    def settled(before) -> tuple[float, float, float]:
        deadline = time.monotonic() + 5
        now = kv()
        while now[2] == before[2] and time.monotonic() < deadline:
            time.sleep(0.1)
            now = kv()
        return now

    rows = []
    with prefill, decode:
        for s in servers:
            s.wait_ready(600)
        warm = [random.Random(99).randrange(1, 1000) for _ in range(64)]
        complete(prefill.url, warm, 2, timeout=timeout)
        complete(decode.url, warm, 2, timeout=timeout)
        before = kv()
        first = complete(prefill.url, warm, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
        complete(decode.url, warm, 2, kv_transfer_params=first["kv_transfer_params"], timeout=timeout)
        settled(before)
        busy_tokens, busy_clients = busy
        load = OtherLoad.start()
        stop = keep_busy(prefill.url, busy_tokens, busy_clients, timeout) if busy_tokens and busy_clients else None
        try:
            for prompt in prompts:
                before = kv()
                t0 = time.monotonic()
                first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
                prefill_s = time.monotonic() - t0
                _, decode_first = complete_streaming(
                    decode.url, prompt, 4, kv_transfer_params=first["kv_transfer_params"], timeout=timeout
                )
                after = settled(before)
                moved, seconds, loads, *phases = (a - b for a, b in zip(after, before, strict=True))
                per_load_s = seconds / loads if loads else None
                mib_per_load = moved / loads / 2**20 if loads else None
                rows.append(
                    {
                        "prompt_tokens": len(prompt),
                        "ttft_s": prefill_s + decode_first,
                        "prefill_leg_s": prefill_s,
                        "decode_leg_s": decode_first,
                        "kv_bytes": moved,
                        "loads": loads,
                        "transfer_s_per_load": per_load_s,
                        "transfer_ms_per_mib": 1000 * per_load_s / mib_per_load
                        if per_load_s and mib_per_load
                        else None,
                        "phase_ms_per_load": {
                            p: 1000 * v / loads for p, v in zip(CPU_PHASES, phases, strict=True) if v and loads
                        },
                    }
                )
        finally:
            stop_busy(stop)
        others = load.stop()
        # the prefill side's timeline of the requests it released (commits that export it), means over the run
        m = metrics(prefill.url)
        name = "vllm:kvbridge_hold_phase_seconds"
        counts = {p: metric_sum(m, f"{name}_count", phase=p) for p in HOLD_PHASES}
        hold = {p: 1000 * metric_sum(m, f"{name}_sum", phase=p) / n for p, n in counts.items() if n}
    return {"rows": rows, **cpu_medians(rows), "prefill_hold_phase_ms_mean": hold, "other_load": others}


CPU_PHASES = ("handshake", "claim", "queue", "post", "wire", "report", "hop")
"""Load phases read from vllm:kvbridge_load_phase_seconds where the commit exports it (transfer_stats.PHASES)."""
HOLD_PHASES = ("hold", "claim", "release")  # the prefill's: finished -> held -> claim answered -> released


def cpu_medians(rows: list[dict]) -> dict:
    phases = {p: median(r.get("phase_ms_per_load", {}).get(p) for r in rows) for p in CPU_PHASES}
    return {
        **{f"{p}_ms_per_load": v for p, v in phases.items() if v is not None},
        "ttft_ms": 1000 * median(r["ttft_s"] for r in rows),
        "prefill_leg_ms": 1000 * median(r["prefill_leg_s"] for r in rows),
        "decode_leg_ms": 1000 * median(r["decode_leg_s"] for r in rows),
        "transfer_ms_per_load": 1000 * (median(r["transfer_s_per_load"] for r in rows) or 0.0),
        "transfer_ms_per_mib": median(r["transfer_ms_per_mib"] for r in rows),
        "kv_mib_per_request": median(r["kv_bytes"] / 2**20 for r in rows),
    }


def run_cpu(args, sides) -> dict:
    from kvbridge.serving.tiny_model import build_tiny_model

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    runs = []
    for run in range(args.runs):
        for pair in args.pairs.split(","):
            order = ("base", "head") if run % 2 == 0 else ("head", "base")
            for side in order:
                label, tree = sides[side]
                t0 = time.monotonic()
                try:
                    res = cpu_pair(
                        model, pair, tree, prompts, workdir, args.timeout, (args.busy_tokens, args.busy_clients)
                    )
                except Exception as exc:  # recorded: one failure must not hide the other side
                    res = {"error": f"{type(exc).__name__}: {exc}"}
                res.update(run=run, pair=pair, side=side, commit=label, wall_s=round(time.monotonic() - t0, 1))
                runs.append(res)
                shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != "rows"}
                print(json.dumps(shown), flush=True)
                if "other_load" in res:
                    print(f"  {pair} {side}: {describe(res['other_load'])}", flush=True)
    summary = {}
    for pair in args.pairs.split(","):
        both = {}
        for side in ("base", "head"):
            rows = [r for x in runs if x["pair"] == pair and x["side"] == side for r in x.get("rows", [])]
            both[side] = cpu_medians(rows) if rows else {}
        summary[pair] = {
            **both,
            "ratio": {k: ratio(both["head"].get(k), both["base"].get(k)) for k in both["base"]},
            "per_run": {
                side: [
                    {k: round(v, 3) for k, v in x.items() if k.endswith(("_ms", "_mib")) and v is not None}
                    for x in runs
                    if x["pair"] == pair and x["side"] == side
                ]
                for side in ("base", "head")
            },
        }
    busy = {"tokens": args.busy_tokens, "clients": args.busy_clients}
    return {
        "prompts": {"count": args.prompts, "tokens": args.prompt_tokens},
        "busy_prefill": busy,
        "summary": summary,
        "runs": runs,
    }


# --- gpu: the runtime bench of each tree -------------------------------------------------------------------------

GPU_KEYS = ("warm_median_s", "post_median_s", "gpu_median_s")


def _ms(key: str) -> str:
    """A summary's name for a per-run field in seconds once it holds milliseconds."""
    return key.removesuffix("_s") + "_ms"


def run_gpu(args, sides) -> dict:
    out = Path(args.workdir)
    runs = []
    for run in range(args.runs):
        for side in ("base", "head") if run % 2 == 0 else ("head", "base"):
            label, tree = sides[side]
            dest = out / f"{side}-{run}"
            dest.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(tree / "bench" / "gpu_workers.py"), "--out", str(dest), *args.bench_args]
            proc = subprocess.run(cmd, capture_output=True, text=True)  # the script puts its own tree's src first
            print(f"--- {side} ({label}) round {run}: rc {proc.returncode}\n{proc.stdout[-6000:]}", flush=True)
            files = sorted(dest.glob("gpu-workers-*.json"))
            results = json.loads(files[-1].read_text())["results"] if files else []
            runs.append(
                {"run": run, "side": side, "commit": label, "rc": proc.returncode, "stderr": proc.stderr[-3000:]}
            )
            for r in results:
                key = f"{r.get('pair')} {r.get('path_asked')} claims={'on' if r.get('verify_requests') else 'off'}"
                entry = {k: r.get(k) for k in GPU_KEYS}
                entry.update(phase_medians_s=r.get("phase_medians_s"), host_post_median_s=r.get("host_post_median_s"))
                entry.update(
                    ok=r.get("ok"), error=r.get("error"), paths=sorted({w["path"] for w in r.get("decode", [])})
                )
                runs[-1].setdefault("scenarios", {})[key] = entry
    summary = {}
    keys = sorted({k for r in runs for k in r.get("scenarios", {})})
    for key in keys:
        both = {}
        for side in ("base", "head"):
            found = [r["scenarios"][key] for r in runs if r["side"] == side and key in r.get("scenarios", {})]
            # the medians in milliseconds, named so (files before this change kept the `_s` names for them)
            both[side] = {_ms(k): median(1000 * f[k] for f in found if f.get(k) is not None) for k in GPU_KEYS}
            both[side]["ok"] = [f.get("ok") for f in found]
        summary[key] = {
            **both,
            "ratio": {_ms(k): ratio(both["head"].get(_ms(k)), both["base"].get(_ms(k))) for k in GPU_KEYS},
        }
    return {"bench_args": args.bench_args, "summary": summary, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=["cpu", "gpu"])
    parser.add_argument("--base", help="base commit (default b59d6e4 unless --base-tree)")
    parser.add_argument("--head", help="head commit (default HEAD unless --head-tree)")
    parser.add_argument("--base-tree", help="a tree of the base commit (instead of a worktree made here)")
    parser.add_argument("--head-tree", help="a tree of the head commit")
    parser.add_argument("--runs", type=int, default=2, help="rounds; the commits' order turns each round")
    parser.add_argument("--pairs", default="pp1-pp1,pp2-tp2", help="cpu: prefill-decode layout pairs")
    parser.add_argument("--prompts", type=int, default=12, help="cpu: prompts per round and pair")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="cpu: tokens per prompt")
    parser.add_argument(
        "--busy-tokens",
        type=int,
        default=0,
        help="cpu: keep the prefill server computing other prompts of this many tokens meanwhile (0: idle)",
    )
    parser.add_argument("--busy-clients", type=int, default=2, help="cpu: clients sending those prompts")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--workdir", default="/tmp/kvbridge-regression")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.bench_args = argv[split + 1 :]  # gpu: arguments for bench/gpu_workers.py (after --)
    if not args.base_tree:
        args.base = args.base or "b59d6e4"
    if not args.head_tree:
        args.head = args.head or "HEAD"
    sys.path.insert(0, str(ROOT / "src"))
    if args.bench == "cpu":  # vLLM servers (the device's gpu bench has no kvbridge.serving dependencies)
        from kvbridge.serving.launcher import exit_on_sigterm

        exit_on_sigterm()  # SIGTERM stops the servers and worktrees this made, as Ctrl-C does
    with trees(args) as sides:
        result = (run_cpu if args.bench == "cpu" else run_gpu)(args, sides)
        commits = {side: label for side, (label, _) in sides.items()}
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
        "commits": commits,
        "ratios_are": "head / base (below 1: head is faster)",
        **result,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"regression-{args.bench}-{commits['base']}-{commits['head']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(
        json.dumps(
            record["summary"] if args.bench == "gpu" else {p: s["ratio"] for p, s in result["summary"].items()},
            indent=1,
        )
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
