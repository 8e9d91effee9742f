"""A multi-turn chat trace replayed through four arms in one run, on real vLLM servers with kvbridge:

    aggregated     the decode server alone (one instance, one core)
    always-pd      `kvbridge proxy --disaggregation always --routing least_loaded` (every request: prefill, then decode)
    kvbridge       `kvbridge proxy --disaggregation selective --routing cache_aware` (threshold learned from /metrics)
    aggregated-x2  both servers as aggregated instances behind `kvbridge proxy --routing cache_aware`, every request
                   straight to one of them (`--direct-below-tokens` above any prompt): the same two cores as the
                   disaggregated arms, no disaggregation

    flock /tmp/kvbridge-vllm.lock python bench/multiturn_trace.py --out bench/results

The trace (seeded): `--users` conversations of `--turns` turns. A conversation opens with a long context (a shared
system prompt and a document of its own); each later turn is the whole conversation so far (every prompt and every
reply) plus a new user turn, short mostly, long (a pasted document) with probability `--long-share`. Requests arrive
at `--rate` per second in turn order (turn 1 of every user, then turn 2 ...); a user's next turn waits for its
previous reply. Replies are greedy, `--max-tokens` long (ignore_eos), streamed. `--layers` and `--hidden` size the
tiny model (built locally), so that prefill weighs more against the proxy's own hop.

The machine has 2 cores: one prefill server (core 0) and one decode server (core 1), both `kv_both` kvbridge
servers. The model's threads are pinned; the servers' HTTP processes, the proxy and this client are not. So the
aggregated arm computes on one core and the disaggregated arms and aggregated-x2 on two; the aggregated arm's HTTP
side still has the idle core 0. Each arm salts its requests (`cache_salt`), so no arm is served from another arm's
prefix cache. Per arm: TTFT p50/p90/p99 (and medians by kind of turn), inter-token latency, requests/s, the
servers' prompt tokens computed, loaded through kvbridge and served from their prefix caches (vLLM's
`vllm:prompt_tokens_by_source_total`), the proxy's decisions, and whether every reply equals the aggregated arm's.
JSON goes to `--out` (with the command, the machine and the commit) and a PNG of TTFT over the trace next to it
(matplotlib: `pip install -e '.[bench]'`; skipped, and said so, when it is not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvbridge.serving.launcher import (
    VllmServer,
    exit_on_sigterm,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model
from machine_load import OtherLoad, describe

SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")
ARMS = ("aggregated", "always-pd", "kvbridge", "aggregated-x2")
CRITERION = ("aggregated", "always-pd")
"""kvbridge's TTFT p50 and p90 against the better of these (the bench's goal); aggregated-x2 is reported too."""
ALWAYS_DIRECT = str(1 << 24)
"""`--direct-below-tokens` above any prompt: every request straight to a decode instance."""


@dataclass
class Turn:
    user: int
    turn: int
    new: list[int]
    """The new user turn's tokens."""


@dataclass
class Result:
    user: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    sent_s: float
    ttft_s: float | None
    """None: the request failed."""
    itl_s: float | None
    output: list[int] = field(default_factory=list)
    error: str | None = None


def trace(args: argparse.Namespace) -> list[Turn]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1, 1000) for _ in range(args.system_tokens)]
    turns = []
    for t in range(args.turns):
        for u in range(args.users):
            if t == 0:
                n = rng.randint(*args.first_tokens)
                new = system + [rng.randrange(1, 1000) for _ in range(n)]
            else:
                long = rng.random() < args.long_share
                n = rng.randint(*(args.long_tokens if long else args.short_tokens))
                new = [rng.randrange(1, 1000) for _ in range(n)]
            turns.append(Turn(u, t, new))
    return turns


async def replay(url: str, turns: list[Turn], args: argparse.Namespace, salt: str) -> tuple[list[Result], float]:
    """Send the trace to `url` at the fixed rate; returns the results and the makespan."""
    history: dict[int, list[int]] = {}
    done: dict[tuple[int, int], asyncio.Event] = {(t.user, t.turn): asyncio.Event() for t in turns}
    results: list[Result] = []
    start = time.monotonic()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def one(i: int, t: Turn) -> None:
            await asyncio.sleep(max(0.0, start + i / args.rate_now - time.monotonic()))
            if t.turn:
                await done[(t.user, t.turn - 1)].wait()
            prompt = [*history.get(t.user, []), *t.new]
            body = {
                "model": args.model_name,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
                "cache_salt": salt,
            }
            sent = time.monotonic()
            stamps: list[float] = []
            out: list[int] = []
            error = None
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        event = json.loads(line[5:])
                        if "error" in event:
                            error = str(event["error"])[:300]
                        for choice in event.get("choices", ()):
                            ids = choice.get("token_ids") or []
                            if ids:
                                stamps.append(time.monotonic())
                                out.extend(ids)
            if error is None and len(out) != args.max_tokens:
                error = f"{len(out)} tokens of {args.max_tokens}"
            if error is not None:  # counted, and its conversation goes on without the reply
                print(f"{url}: user {t.user} turn {t.turn} failed: {error}", flush=True)
                out = []
            ttft = stamps[0] - sent if stamps and error is None else None
            itl = (stamps[-1] - stamps[0]) / (len(out) - 1) if len(out) > 1 else None
            results.append(Result(t.user, t.turn, len(prompt), len(t.new), sent - start, ttft, itl, out, error))
            history[t.user] = [*prompt, *out]
            done[(t.user, t.turn)].set()

        await asyncio.gather(*(one(i, t) for i, t in enumerate(turns)))
    return sorted(results, key=lambda r: r.sent_s), time.monotonic() - start


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank); inf when no request succeeded."""
    ordered = sorted(values)
    if not ordered:
        return float("inf")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def token_sources(servers: list[VllmServer]) -> dict[str, float]:
    out = dict.fromkeys(SOURCES, 0.0)
    for server in servers:
        samples = metrics(server.url)
        for source in SOURCES:
            out[source] += metric_sum(samples, SOURCE, source=source)
    return out


def proxy_decisions(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvbridge_proxy_decisions_total":
                out[f"{s.labels['path']}/{s.labels['reason']}"] = s.value
            elif s.name in (
                "kvbridge_proxy_direct_threshold_tokens",
                "kvbridge_proxy_prefill_tokens_per_second",
                "kvbridge_proxy_transfer_seconds_per_token",
                "kvbridge_proxy_hop_seconds",
            ):
                out[s.name.removeprefix("kvbridge_proxy_")] = s.value
    return out


class ProxyProcess:
    """`kvbridge proxy` as a user runs it, its log in a file."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--port", "0", *flags]
        self.log_path = log_path

    def __enter__(self) -> str:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if line.startswith("kvbridge proxy listening on "):
                    return line.split()[-1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the proxy did not start:\n{self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


KINDS = ("first", "short", "long")


def turn_kind(r: Result, args: argparse.Namespace) -> str:
    """first (system prompt and document), long (a pasted document) or short (a chat turn)."""
    if r.turn == 0:
        return "first"
    return "long" if r.new_tokens >= args.long_tokens[0] else "short"


def run_arm(name: str, url: str, turns: list[Turn], args: argparse.Namespace, servers: list[VllmServer]) -> dict:
    before = token_sources(servers)
    load = OtherLoad.start()
    results, makespan = asyncio.run(replay(url, turns, args, salt=f"{name}-{args.seed}-{args.rate_now}"))
    others = load.stop()
    time.sleep(1.0)  # the servers' metrics of the last requests
    after = token_sources(servers)
    ok = [r for r in results if r.ttft_s is not None]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [r.itl_s * 1000 for r in results if r.itl_s is not None]
    row = {
        "arm": name,
        "requests": len(results),
        "failed": [f"user {r.user} turn {r.turn}: {r.error}" for r in results if r.error is not None],
        "ttft_ms": {q: round(pct(ttft, v), 1) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "itl_ms": {"mean": round(statistics.fmean(itl), 2) if itl else None, "p90": round(pct(itl, 0.9), 2)},
        "requests_per_s": round(len(results) / makespan, 3),
        "prompt_tokens": {s: round(after[s] - before[s]) for s in SOURCES},
        "other_load": others,
        "trace": [
            {
                "user": r.user,
                "turn": r.turn,
                "kind": turn_kind(r, args),
                "prompt": r.prompt_tokens,
                "new": r.new_tokens,
                "sent_s": round(r.sent_s, 3),
                "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
            }
            for r in results
        ],
    }
    row["ttft_median_ms_by_kind"] = {
        kind: round(statistics.median(r.ttft_s * 1000 for r in ok if turn_kind(r, args) == kind), 1)
        for kind in KINDS
        if any(turn_kind(r, args) == kind for r in ok)
    }
    row["_outputs"] = {(r.user, r.turn): r.output for r in results}
    print(
        f"{name}: TTFT ms {row['ttft_ms']}, ITL ms {row['itl_ms']}, {row['requests_per_s']} req/s, "
        f"tokens {row['prompt_tokens']}, {len(row['failed'])} failed; {describe(others)}",
        flush=True,
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| arm | TTFT p50 ms | p90 | p99 | ITL mean ms | req/s | computed | loaded | cached | outputs = aggregated "
        "| decisions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, p = r["ttft_ms"], r["prompt_tokens"]
        decisions = ", ".join(
            f"{k} {v:g}"
            for k, v in sorted(r.get("proxy", {}).items())
            if "/" in k and v and r["arm"] != "aggregated-x2"
        )
        lines.append(
            f"| {r['arm']} | {t['p50']} | {t['p90']} | {t['p99']} | {r['itl_ms']['mean']} | {r['requests_per_s']} | "
            f"{p['local_compute']} | {p['external_kv_transfer']} | {p['local_cache_hit']} | "
            f"{r['outputs_equal_aggregated']}/{r['requests']}{failed(r)} | {decisions} |"
        )
    return "\n".join(lines)


def failed(row: dict) -> str:
    return f" ({len(row['failed'])} failed)" if row.get("failed") else ""


def plot(runs: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.5 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for r in run["arms"]:
            done = [x for x in r["trace"] if x["ttft_ms"] is not None]
            xs, ys = [x["sent_s"] for x in done], [x["ttft_ms"] for x in done]
            ax.plot(xs, ys, ".-", label=f"{r['arm']} (p50 {r['ttft_ms']['p50']:g} ms)", lw=0.8)
        ax.set_title(f"TTFT of each request over the trace, {run['rate']:g} requests/s")
        ax.set_xlabel("request sent (s into the trace)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def commit() -> str:
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main() -> int:
    exit_on_sigterm()  # SIGTERM stops the servers this started, as Ctrl-C does
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=float, nargs="+", default=[3.0], help="requests per second; several: one run each")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--first-tokens", type=int, nargs=2, default=(400, 900), metavar=("MIN", "MAX"))
    p.add_argument("--short-tokens", type=int, nargs=2, default=(10, 60), metavar=("MIN", "MAX"))
    p.add_argument("--long-tokens", type=int, nargs=2, default=(400, 800), metavar=("MIN", "MAX"))
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="the tiny model's layers")
    p.add_argument("--hidden", type=int, default=256, help="its hidden size (8 heads: 256, 512, 1024 ...)")
    p.add_argument("--max-model-len", type=int, default=4096, help="the servers' context (and the model's)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="each server's KV cache")
    p.add_argument("--block-size", type=int, default=32, help="vLLM CPU attention: a multiple of 32")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="aggregated always runs: the reference")
    p.add_argument(
        "--kvbridge-flags",
        default="",
        help="more `kvbridge proxy` flags for the kvbridge arm (a variant), one string: "
        "--kvbridge-flags '--direct-below-tokens 256', or --kvbridge-flags=--flag for a lone flag",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--model-name", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    turns = trace(args)
    longest = max(len(history) for history in conversation_lengths(turns, args.max_tokens).values())
    if longest > args.max_model_len:
        p.error(f"a conversation reaches {longest} tokens: raise --max-model-len above it")
    work = Path(tempfile.mkdtemp(prefix="kvbridge-multiturn-"))
    model = build_tiny_model(
        work / "model", num_layers=args.layers, hidden=args.hidden, max_positions=args.max_model_len
    )
    args.model_name = str(model)
    places = {"prefill": "0", "decode": "1"}
    servers = {
        name: VllmServer(
            model,
            port=free_port(),
            cpu_bind=core,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib,
            kv_transfer_config=kvbridge_config("kv_both", side_channel_port=free_base_port(1), lease_s=30.0),
            name=name,
            log_path=work / f"{name}.log",
        )
        for name, core in places.items()
    }
    prefill, decode = servers["prefill"], servers["decode"]
    both = [prefill, decode]
    base = ["--prefill", prefill.url, "--decode", decode.url, "--log-level", "info"]
    blocks = ["--prefix-block-tokens", str(args.block_size)]
    proxies = {
        "always-pd": [*base, "--disaggregation", "always", "--routing", "least_loaded"],
        "kvbridge": [
            *base,
            *("--disaggregation", "selective", "--routing", "cache_aware"),
            *blocks,
            *shlex.split(args.kvbridge_flags),
        ],
        "aggregated-x2": [
            *("--prefill", prefill.url, "--decode", prefill.url, "--decode", decode.url, "--log-level", "info"),
            *("--disaggregation", "selective", "--direct-below-tokens", ALWAYS_DIRECT, "--routing", "cache_aware"),
            *blocks,
        ],
    }
    proxies = {name: flags for name, flags in proxies.items() if name in args.arms}
    runs = []
    with running(both):
        args.rate_now = 1.0
        asyncio.run(replay(decode.url, turns[:1], args, salt="warm"))  # one request per path, not measured
        with ProxyProcess(proxies.get("always-pd", base), work / "proxy-warm.log") as url:
            asyncio.run(replay(url, turns[:1], args, salt="warm-pd"))
        for rate in args.rate:
            args.rate_now = rate
            rows = [run_arm("aggregated", decode.url, turns, args, both)]
            for name, flags in proxies.items():
                with ProxyProcess(flags, work / f"proxy-{name}-{rate:g}.log") as url:
                    row = run_arm(name, url, turns, args, both)
                    row["proxy"] = proxy_decisions(url)
                    rows.append(row)
            runs.append(summarize(rate, rows))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, args.out / f"multiturn-trace-{stamp}.png")
    report = {
        "command": "python " + shlex.join(sys.argv),
        "host": f"{platform.machine()}, {os.cpu_count()} cores: prefill server's model on core 0, decode's on core 1 "
        "(HTTP processes, proxy and client unpinned); the aggregated arm is the decode server alone, aggregated-x2 "
        "both servers",
        "commit": commit(),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trace": {k: v for k, v in vars(args).items() if k not in ("out", "model_name", "rate_now")},
        "plot": png or "skipped: matplotlib is not installed",
        "runs": runs,
    }
    path = args.out / f"multiturn-trace-{stamp}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for run in runs:
        print(f"\nrate {run['rate']}/s:")
        print(table(run["arms"]))
        print(f"TTFT medians by kind of turn: {run['ttft_median_ms_by_kind']}")
        print(f"kvbridge TTFT <= the better of aggregated and always-pd: {run.get('kvbridge_ttft_at_most_best_other')}")
        if "kvbridge_ttft_at_most_aggregated_x2" in run:
            print(f"kvbridge TTFT <= aggregated-x2: {run['kvbridge_ttft_at_most_aggregated_x2']}")
    print(f"plot: {report['plot']}")
    print(f"wrote {path}")
    return 0 if all(r["outputs_equal_aggregated"] == r["requests"] for run in runs for r in run["arms"]) else 1


def conversation_lengths(turns: list[Turn], reply_tokens: int) -> dict[int, list[int]]:
    """Each user's whole conversation (its last prompt and reply) as a list of placeholders, to bound its length."""
    out: dict[int, list[int]] = {}
    for t in turns:
        out[t.user] = [*out.get(t.user, []), *t.new, *([0] * reply_tokens)]
    return out


def summarize(rate: float, rows: list[dict]) -> dict:
    reference = rows[0]["_outputs"]
    for r in rows:
        outputs = r.pop("_outputs")
        r["outputs_equal_aggregated"] = sum(bool(outputs[k]) and outputs[k] == reference[k] for k in reference)
    by_arm = {r["arm"]: r for r in rows}
    out: dict = {"rate": rate}
    kvb = by_arm.get("kvbridge")
    others = [by_arm[a] for a in CRITERION if a in by_arm]
    if kvb is not None:
        out["kvbridge_ttft_at_most_best_other"] = {
            q: kvb["ttft_ms"][q] <= min(o["ttft_ms"][q] for o in others) for q in ("p50", "p90")
        }
        if "aggregated-x2" in by_arm:
            x2 = by_arm["aggregated-x2"]["ttft_ms"]
            out["kvbridge_ttft_at_most_aggregated_x2"] = {q: kvb["ttft_ms"][q] <= x2[q] for q in ("p50", "p90")}
    out["ttft_median_ms_by_kind"] = {r["arm"]: r["ttft_median_ms_by_kind"] for r in rows}
    out["arms"] = rows
    return out


if __name__ == "__main__":
    sys.exit(main())
