"""TTFT of disaggregated prefill/decode with kvbridge vs vLLM's NixlConnector, same prompts, same machine, one run.

For each layout pair and each connector it starts a prefill and a decode vLLM server (CPU, tiny float32 model,
prefill workers on core 0, decode workers on core 1), sends the same prompts through the PD protocol
(prefill leg with max_tokens=1, decode leg streamed) and records: whether the pair works (server start,
HTTP status, hang), TTFT (prefill leg + decode leg to first token), and whether the output equals the
aggregated run. An aggregated baseline TTFT (the prefill server answering alone, streamed) is measured too.

    .venv/bin/python bench/ttft_compare.py [--pairs pp1-pp1,pp2-pp1,...] [--prompts 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from kvbridge.serving.launcher import (
    RequestFailed,
    ServerError,
    VllmServer,
    complete,
    complete_streaming,
    free_base_port,
    free_port,
)
from kvbridge.serving.tiny_model import build_tiny_model

LAYOUTS = {"pp1": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}
DEFAULT_PAIRS = "pp1-pp1,pp2-pp1,pp1-pp2,tp2-pp1,pp2-tp2"


def kv_config(connector: str, role: str) -> tuple[dict, dict]:
    """(kv-transfer-config, extra environment) for one server."""
    if connector == "kvbridge":
        cfg = {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": free_base_port(4)},
        }
        return cfg, {}
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    return cfg, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_base_port(8))}


def server(model, name, layout, cores, connector, role, logdir) -> VllmServer:
    pp, tp = LAYOUTS[layout]
    cfg, env = kv_config(connector, role)
    return VllmServer(
        model,
        port=free_port(),
        pp=pp,
        tp=tp,
        cpu_bind="|".join([cores] * (pp * tp)),
        kv_transfer_config=cfg,
        env=env,
        name=f"{connector}-{name}-{layout}",
        log_path=logdir / f"{connector}-{name}-{layout}.log",
    )


def last_error(server: VllmServer) -> str:
    for line in reversed(server.log_tail(200).splitlines()):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return "see log"


def run_pair(model, pair: str, connector: str, prompts, logdir, timeout: float) -> dict:
    p_layout, d_layout = pair.split("-")
    prefill = server(model, "prefill", p_layout, "0", connector, "kv_producer", logdir)
    decode = server(model, "decode", d_layout, "1", connector, "kv_consumer", logdir)
    result: dict = {"pair": f"{p_layout}->{d_layout}", "connector": connector}
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
            first = complete(prefill.url, warm, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout)
            complete(decode.url, warm, 2, kv_transfer_params=first["kv_transfer_params"], timeout=timeout)
            for prompt in prompts:
                _, aggregated_ttft = complete_streaming(prefill.url, prompt, 8, timeout=timeout)
                reference = complete(prefill.url, prompt, 8, timeout=timeout)["choices"][0]["token_ids"]
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
        aggregated_ttft_median_ms=1000 * statistics.median(r["aggregated_ttft_s"] for r in rows),
        rows=rows,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--connectors", default="kvbridge,nixl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--workdir", default="/tmp/kvbridge-ttft")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(100, 800))] for _ in range(args.prompts)]
    results = []
    for pair in args.pairs.split(","):
        for connector in args.connectors.split(","):
            t0 = time.monotonic()
            res = run_pair(model, pair, connector, prompts, workdir, args.timeout)
            res["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    print(f"\n{'pair':<10} {'connector':<9} {'status':<32} {'TTFT med ms':>11} {'p90 ms':>8} {'aggr. ms':>9}")
    for r in results:
        med = f"{r['ttft_median_ms']:.1f}" if "ttft_median_ms" in r else "-"
        p90 = f"{r['ttft_p90_ms']:.1f}" if "ttft_p90_ms" in r else "-"
        agg = f"{r['aggregated_ttft_median_ms']:.1f}" if "aggregated_ttft_median_ms" in r else "-"
        print(f"{r['pair']:<10} {r['connector']:<9} {r['status'][:32]:<32} {med:>11} {p90:>8} {agg:>9}")
    by = {(r["pair"], r["connector"]): r for r in results}
    for pair in {r["pair"] for r in results}:
        a, b = by.get((pair, "kvbridge"), {}), by.get((pair, "nixl"), {})
        if "ttft_median_ms" in a and "ttft_median_ms" in b:
            print(f"{pair}: kvbridge/NixlConnector median TTFT ratio {a['ttft_median_ms'] / b['ttft_median_ms']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ttft-compare-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "command": " ".join([sys.executable, *sys.argv]),
                "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
                "prompts": [len(p) for p in prompts],
                "results": results,
            },
            indent=2,
        )
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
