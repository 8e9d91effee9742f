"""TTFT of disaggregated prefill/decode with kvbridge vs vLLM's NixlConnector: same prompts, same machine, same
pinning, the same aggregated baseline for both, several runs, interleaved.

For each run, each layout pair and each arm it starts a prefill and a decode vLLM server (CPU, tiny float32 model,
prefill workers on core 0, decode workers on core 1), warms both (a plain request each and one PD request: the
first requests compile and connect), sends the same prompts through the PD protocol (prefill leg with
max_tokens=1, decode leg streamed) and records whether the pair works (server start, HTTP status, hang), TTFT
(prefill leg + decode leg to first token) and whether the output equals the aggregated run. The decode leg (the
decode request sent -> its first token: the KV's claim, transfer and the first step) is reported on its own too,
with each arm's pooled median over NixlConnector's. The arms' order turns each run, so no arm always runs first.

Arms:
- `kvbridge`, `nixl` (vLLM's NixlConnector as it ships);
- `nixl-unpinned`: NixlConnector with its own thread pinning off. On CPU its worker calls
  `os.sched_setaffinity(0, <the last core of each NUMA node>)` at start (vllm/distributed/kv_transfer/
  kv_connector/v1/nixl/base_worker.py), so on a 2-core host the worker thread of the prefill *and* of the decode
  server land on core 1, beside the decode's OpenMP threads. This arm makes that call a no-op (a sitecustomize
  shim on PYTHONPATH for the servers' processes only): the difference between `nixl` and `nixl-unpinned`
  isolates what the pinning costs.

The aggregated baseline is one plain server per run and pair (the prefill's layout, no KV connector, core 0), the
same for every arm; each arm's TTFT is reported against it.

    .venv/bin/python bench/ttft_compare.py [--pairs pp1-pp1,tp2-pp1] [--arms kvbridge,nixl,nixl-unpinned] \
        [--runs 3] [--prompts 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from kvbridge.serving.key_files import private_key_file
from kvbridge.serving.launcher import (
    RequestFailed,
    ServerError,
    VllmServer,
    complete,
    complete_streaming,
    exit_on_sigterm,
    free_base_port,
    free_port,
)
from kvbridge.serving.tiny_model import build_tiny_model
from multiturn_trace import commit  # the checkout's commit, "+dirty" with uncommitted changes

LAYOUTS = {"pp1": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}
DEFAULT_PAIRS = "pp1-pp1,tp2-pp1"
ARMS = ("kvbridge", "nixl", "nixl-unpinned")
SHIM = """import os
if os.environ.get("KVBRIDGE_BENCH_NO_SETAFFINITY") == "1":
    os.sched_setaffinity = lambda pid, cores: None  # the ttft_compare arm 'nixl-unpinned'
"""


def shim_env(workdir: Path) -> dict[str, str]:
    """Environment that turns NixlConnector's own sched_setaffinity into a no-op in the servers' processes."""
    shim = workdir / "no-setaffinity"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    path = os.pathsep.join(x for x in (str(shim), os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": path, "KVBRIDGE_BENCH_NO_SETAFFINITY": "1"}


def kv_config(arm: str | None, role: str, workdir: Path, key_file: Path | None = None) -> tuple[dict | None, dict]:
    """(kv-transfer-config, extra environment) for one server of `arm` (None: a plain server); `key_file`: the
    deployment key kvbridge's two servers share (kvbridge refuses to serve keyless unless told to)."""
    if arm is None:
        return None, {}
    if arm == "kvbridge":
        cfg = {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": free_base_port(4), "auth_key_file": str(key_file)},
        }
        return cfg, {}
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_base_port(8))}
    if arm == "nixl-unpinned":
        env.update(shim_env(workdir))
    return cfg, env


def server(model, name, layout, cores, arm, role, logdir, key_file=None) -> VllmServer:
    pp, tp = LAYOUTS[layout]
    cfg, env = kv_config(arm, role, logdir, key_file)
    tag = arm or "plain"
    return VllmServer(
        model,
        port=free_port(),
        pp=pp,
        tp=tp,
        cpu_bind="|".join([cores] * (pp * tp)),
        kv_transfer_config=cfg,
        env=env,
        name=f"{tag}-{name}-{layout}",
        log_path=logdir / f"{tag}-{name}-{layout}.log",
    )


def aggregated_baseline(model, layout: str, prompts, logdir, timeout: float) -> dict:
    """The plain server's streamed TTFT and greedy output per prompt (the reference for every arm)."""
    with server(model, "aggregated", layout, "0", None, None, logdir) as plain:
        plain.wait_ready(600)
        warm = [random.Random(99).randrange(1, 1000) for _ in range(64)]
        complete(plain.url, warm, 2, timeout=timeout)
        ttft, outputs = [], []
        for prompt in prompts:
            tokens, first = complete_streaming(plain.url, prompt, 8, timeout=timeout)
            ttft.append(first)
            outputs.append(tokens)
    return {"ttft_s": ttft, "tokens": outputs}


def last_error(server: VllmServer) -> str:
    for line in reversed(server.log_tail(200).splitlines()):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return "see log"


def run_pair(model, pair: str, arm: str, prompts, baseline: dict, logdir, timeout: float) -> dict:
    with private_key_file() as key_file:  # one key for both servers, removed once they have stopped
        return _run_pair(model, pair, arm, prompts, baseline, logdir, timeout, key_file)


def _run_pair(model, pair: str, arm: str, prompts, baseline: dict, logdir, timeout: float, key_file) -> dict:
    p_layout, d_layout = pair.split("-")
    prefill = server(model, "prefill", p_layout, "0", arm, "kv_producer", logdir, key_file)
    decode = server(model, "decode", d_layout, "1", arm, "kv_consumer", logdir, key_file)
    result: dict = {"pair": f"{p_layout}->{d_layout}", "connector": arm}
    with prefill, decode:  # entering starts them; leaving stops them, also on errors
        for s in (prefill, decode):
            try:
                s.wait_ready(600)
            except ServerError:
                result.update(status=f"{s.name} failed to start", error=last_error(s))
                return result
        # Warm both servers (first requests compile and connect).
        warm = [random.Random(99).randrange(1, 1000) for _ in range(64)]
        rows = []
        try:
            complete(prefill.url, warm, 2, timeout=timeout)
            complete(decode.url, warm, 2, timeout=timeout)
            first = complete(prefill.url, warm, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
            complete(decode.url, warm, 2, kv_transfer_params=first["kv_transfer_params"], timeout=timeout)
            for prompt, reference, aggregated_ttft in zip(prompts, baseline["tokens"], baseline["ttft_s"], strict=True):
                t0 = time.monotonic()
                first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
                prefill_s = time.monotonic() - t0
                tokens, decode_first = complete_streaming(
                    decode.url, prompt, 8, kv_transfer_params=first["kv_transfer_params"], timeout=timeout
                )
                rows.append(
                    {
                        "prompt_tokens": len(prompt),
                        "ttft_s": prefill_s + decode_first,
                        "prefill_leg_s": prefill_s,
                        "decode_leg_s": decode_first,
                        "aggregated_ttft_s": aggregated_ttft,
                        "equal": tokens == reference,
                    }
                )
        except RequestFailed as exc:
            result.update(status=f"HTTP {exc.status}", error=last_error(decode) if exc.status >= 500 else exc.body)
            return result
        except TimeoutError:
            result.update(status=f"hang (no answer in {timeout:.0f} s)", error=last_error(decode))
            return result
    ttfts = [r["ttft_s"] for r in rows]
    result.update(
        status="works" if all(r["equal"] for r in rows) else "wrong output",
        requests=len(rows),
        equal=sum(r["equal"] for r in rows),
        ttft_median_ms=1000 * statistics.median(ttfts),
        ttft_p90_ms=1000 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        decode_leg_median_ms=1000 * statistics.median(r["decode_leg_s"] for r in rows),
        aggregated_ttft_median_ms=1000 * statistics.median(r["aggregated_ttft_s"] for r in rows),
        rows=rows,
    )
    return result


@contextlib.contextmanager
def exclusive(lock: str | None):
    """Hold `lock` (flock) for one measurement, so no other vLLM job shares the cores with it."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def summarize(results: list[dict]) -> list[dict]:
    """Per (pair, arm): runs that worked, each run's median TTFT, their spread, the pooled median and p90, the
    pooled median of TTFT over the aggregated baseline's TTFT for the same prompts, the pooled medians of the
    prefill and decode legs, and the decode leg's over NixlConnector's (each over the runs that worked for it)."""
    rows, leg_ms = [], {}  # leg_ms: (pair, arm) -> pooled median decode leg, unrounded
    for key in sorted({(r["pair"], r["connector"]) for r in results}):
        runs = [r for r in results if (r["pair"], r["connector"]) == key]
        ok = [r for r in runs if "rows" in r and r.get("status") == "works"]
        row = {"pair": key[0], "arm": key[1], "runs": len(runs), "runs_ok": len(ok)}
        row["statuses"] = sorted({r["status"] for r in runs})
        if ok:
            pooled = [x["ttft_s"] * 1000 for r in ok for x in r["rows"]]
            ratios = [x["ttft_s"] / x["aggregated_ttft_s"] for r in ok for x in r["rows"]]
            medians = [r["ttft_median_ms"] for r in ok]
            leg_ms[key] = statistics.median(x["decode_leg_s"] * 1000 for r in ok for x in r["rows"])
            row.update(
                run_median_ms=[round(m, 1) for m in medians],
                run_median_spread_ms=[round(min(medians), 1), round(max(medians), 1)],
                pooled_median_ms=round(statistics.median(pooled), 1),
                pooled_p90_ms=round(sorted(pooled)[int(0.9 * (len(pooled) - 1))], 1),
                median_ratio_to_aggregated=round(statistics.median(ratios), 2),
                pooled_decode_leg_median_ms=round(leg_ms[key], 1),
                pooled_prefill_leg_median_ms=round(
                    statistics.median(x["prefill_leg_s"] * 1000 for r in ok for x in r["rows"]), 1
                ),
            )
        rows.append(row)
    for row in rows:  # each arm's decode leg against NixlConnector's, same pair (the runs that worked for each)
        key, nixl = (row["pair"], row["arm"]), (row["pair"], "nixl")
        if key in leg_ms and nixl in leg_ms:
            row["decode_leg_ratio_to_nixl"] = round(leg_ms[key] / leg_ms[nixl], 2)
    return rows


def main() -> int:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--workdir", default="/tmp/kvbridge-ttft")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--lock", help="a file to flock around each measurement (machines shared with other jobs)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(100, 800))] for _ in range(args.prompts)]
    arms = args.arms.split(",")
    results, baselines = [], []
    for run in range(args.runs):
        for pair in args.pairs.split(","):
            with exclusive(args.lock):
                baseline = aggregated_baseline(model, pair.split("-")[0], prompts, workdir, args.timeout)
            baselines.append({"run": run, "pair": pair, "ttft_ms": [round(1000 * t, 1) for t in baseline["ttft_s"]]})
            for arm in arms[run % len(arms) :] + arms[: run % len(arms)]:  # each run starts with another arm
                t0 = time.monotonic()
                with exclusive(args.lock):
                    res = run_pair(model, pair, arm, prompts, baseline, workdir, args.timeout)
                res.update(run=run, wall_s=round(time.monotonic() - t0, 1))
                results.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    summary = summarize(results)
    print(
        f"\n{'pair':<10} {'arm':<14} {'ok':>5} {'run medians ms':<26} {'pooled med':>10} {'p90':>8} {'/aggr.':>7}"
        f" {'decode leg':>10} {'/nixl':>6}"
    )
    for r in summary:
        meds = ", ".join(f"{m:.0f}" for m in r.get("run_median_ms", [])) or "; ".join(r["statuses"])[:26]
        med, p90 = r.get("pooled_median_ms", "-"), r.get("pooled_p90_ms", "-")
        ratio = r.get("median_ratio_to_aggregated", "-")
        leg, leg_ratio = r.get("pooled_decode_leg_median_ms", "-"), r.get("decode_leg_ratio_to_nixl", "-")
        print(
            f"{r['pair']:<10} {r['arm']:<14} {r['runs_ok']}/{r['runs']:<3} {meds:<26} {med:>10} {p90:>8} {ratio:>7}"
            f" {leg:>10} {leg_ratio:>6}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ttft-compare-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "command": " ".join([sys.executable, *sys.argv]),
                "commit": commit(),
                "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
                "prompts": [len(p) for p in prompts],
                "summary": summary,
                "aggregated_baselines": baselines,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
