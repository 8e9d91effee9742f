"""PD TTFT with authentication on and off, same prompts, interleaved in one run.

Two prefill/decode pairs of real vLLM servers (CPU, tiny float32 model; prefills on core 0, decodes on core 1):
one with a deployment key (sealed side channel, signed kv_transfer_params), one without. Each prompt goes through
the PD protocol (prefill leg with max_tokens=1, decode leg streamed) to one pair, then to the other, alternating
which goes first; TTFT = prefill leg + decode leg to its first token. Outputs are checked against each other.

    .venv/bin/python bench/ttft_auth.py [--prompts 24] [--tokens 300] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    complete_streaming,
    exit_on_sigterm,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model


def pair(model: Path, root: Path, keyed: bool) -> tuple[VllmServer, VllmServer]:
    extra = {}
    if keyed:
        key = root / "key"
        key.write_bytes(b"bench-deployment-key-0123456789abcdef")
        extra = {"auth_key_file": str(key)}
    name = "keyed" if keyed else "open"
    prefill = VllmServer(
        model,
        port=free_port(),
        cpu_bind="0",
        kv_transfer_config=kvbridge_config("kv_producer", side_channel_port=free_base_port(1), **extra),
        name=f"prefill-{name}",
        log_path=root / f"prefill-{name}.log",
    )
    decode = VllmServer(
        model,
        port=free_port(),
        cpu_bind="1",
        kv_transfer_config=kvbridge_config("kv_consumer", side_channel_port=free_base_port(1), **extra),
        name=f"decode-{name}",
        log_path=root / f"decode-{name}.log",
    )
    return prefill, decode


def pd_ttft(prefill: VllmServer, decode: VllmServer, tokens: list[int]) -> tuple[float, list[int]]:
    t0 = time.monotonic()
    params = complete(prefill.url, tokens, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    leg = time.monotonic() - t0
    out, first = complete_streaming(decode.url, tokens, 8, kv_transfer_params=params)
    return leg + first, out


def main() -> int:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvbridge-ttft-auth-"))
    model = build_tiny_model(root / "model")
    pairs = {"on": pair(model, root, True), "off": pair(model, root, False)}
    rng = random.Random(7)
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    equal = 0
    with running([s for both in pairs.values() for s in both]):
        for prefill, decode in pairs.values():  # warm: vLLM compiles lazily
            warm = [rng.randrange(1, 1000) for _ in range(args.tokens)]
            pd_ttft(prefill, decode, warm)
        for i in range(args.prompts):
            tokens = [rng.randrange(1, 1000) for _ in range(args.tokens)]
            order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
            outs = {}
            for name in order:
                seconds, outs[name] = pd_ttft(*pairs[name], tokens)
                ttft[name].append(seconds)
            equal += outs["on"] == outs["off"]
        moved = {
            name: metric_sum(metrics(decode.url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            for name, (_, decode) in pairs.items()
        }
    summary = {
        name: {
            "median_ms": round(1000 * statistics.median(v), 1),
            "p90_ms": round(1000 * sorted(v)[int(0.9 * (len(v) - 1))], 1),
            "min_ms": round(1000 * min(v), 1),
        }
        for name, v in ttft.items()
    }
    summary["ratio_on_off_median"] = round(summary["on"]["median_ms"] / summary["off"]["median_ms"], 3)
    summary["outputs_equal"] = f"{equal}/{args.prompts}"
    summary["prompt_tokens_moved"] = moved
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}",
        "summary": summary,
        "ttft_s": ttft,
    }
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ttft-auth-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
