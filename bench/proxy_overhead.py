"""What `kvbridge proxy` adds to a request's time to its first byte, against a backend that answers at once.

A fake OpenAI-compatible backend (uvicorn with uvloop and httptools, in a subprocess of its own) answers
POST /v1/completions at once: JSON, or 3 SSE token events and `[DONE]` when asked to stream; GET /metrics with the
vLLM series the proxy's cost learner reads, GET /health. In front of it, one `kvbridge proxy` process per source
tree (`--tree NAME=SRC`, e.g. the working tree and a `git worktree` of a base commit), with the flags of the
multi-turn trace bench's selective arm (`--disaggregation selective --routing cache_aware`, the threshold learned,
the backend both the prefill and the decode instance, so that every request goes straight to it: `decode_idle`).

An httpx client (one kept connection per target) sends the same request directly to the backend and through each
proxy, in a shuffled order each round, for token-id prompts of 32 and 2,000 tokens (a fresh prompt each round),
streamed and not: `--n` rounds after `--warmup` unmeasured ones. The time is to the first body byte when streaming
(TTFT), to the whole reply otherwise. Printed and saved: p50/p90 per target and shape, and per proxy the p50 and
p90 added over the direct path, with the paired median (each proxied request less the direct one of its round).

`--profile DIR` runs each proxy under cProfile and writes its stats (`<name>.pstats`, and the top functions as
text) after the measured rounds; profiled times are not the figures to quote.

    flock /tmp/kvbridge-vllm.lock .venv/bin/python bench/proxy_overhead.py --tree new=src \\
        --tree base=/tmp/proxy-base/src --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

BACKEND = r"""
import json, sys
import uvicorn

METRICS = (
    b'vllm:prompt_tokens_by_source_total{source="local_compute"} 1000.0\n'
    b'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 0.0\n'
    b"vllm:request_prefill_time_seconds_sum 0.5\n"
    b"vllm:kvbridge_transfer_seconds_sum 0.0\nvllm:kvbridge_transfer_seconds_count 0.0\n"
    b"vllm:kvbridge_transfers_total 0.0\n"
)
TOKENS = ("a", "b", "c")


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    path = scope["path"]
    if scope["method"] == "GET":
        body, ctype = (METRICS, b"text/plain; version=0.0.4") if path == "/metrics" else (b"{}", b"application/json")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    req = json.loads(raw)
    n = len(req.get("prompt") or ())
    if req.get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for token in TOKENS:
            chunk = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": token}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    doc = {"id": "cmpl-1", "object": "text_completion", "model": "m",
           "choices": [{"index": 0, "text": "".join(TOKENS), "finish_reason": "length"}],
           "usage": {"prompt_tokens": n, "completion_tokens": len(TOKENS), "total_tokens": n + len(TOKENS)}}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
                        log_level="warning", access_log=False, lifespan="on")
uvicorn.Server(config).run()
"""

PROFILED_PROXY = r"""
import cProfile, io, pstats, signal, sys
from kvbridge.serving.cli import main

out = sys.argv[1]
profile = cProfile.Profile()


def dump(*_):
    profile.disable()
    profile.dump_stats(out + ".pstats")
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    with open(out + ".txt", "w") as f:
        f.write(text.getvalue())
    with open(out + ".done", "w") as f:
        f.write("1")


signal.signal(signal.SIGUSR1, dump)
profile.enable()
sys.exit(main(["proxy", *sys.argv[2:]]))
"""

SHAPES = ((32, True), (32, False), (2000, True), (2000, False))
"""Prompt tokens and whether streamed."""


def shape_name(tokens: int, stream: bool) -> str:
    return f"{tokens}-tok {'stream' if stream else 'json'}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, log: Path | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text()[-2000:] if log else ''}")
        try:
            httpx.get(url + "/metrics", timeout=1, trust_env=False)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


class Proxy:
    """`kvbridge proxy` from one source tree, as a user runs it (its log in a file), optionally under cProfile."""

    def __init__(self, name: str, src: Path, flags: list[str], work: Path, profile: Path | None) -> None:
        self.name, self.src, self.work = name, src, work
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        args = ["--host", "127.0.0.1", "--port", str(port), *flags]
        if profile is None:
            self.cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", *args]
            self.stats = None
        else:
            self.stats = profile / name
            self.cmd = [sys.executable, "-c", PROFILED_PROXY, str(self.stats), *args]
        self.log_path = work / f"proxy-{name}.log"

    def __enter__(self) -> Proxy:
        env = dict(os.environ, PYTHONPATH=str(self.src.resolve()))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_up(self.url, self.proc, self.log_path)
        return self

    def dump_profile(self) -> None:
        if self.stats is None:
            return
        self.proc.send_signal(signal.SIGUSR1)
        done = Path(str(self.stats) + ".done")
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        done.unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def timed(client: httpx.Client, url: str, payload: bytes, stream: bool) -> float:
    """Seconds to the first body byte (streamed) or to the whole reply."""
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    if stream:
        with client.stream("POST", url + "/v1/completions", content=payload, headers=headers) as resp:
            chunks = resp.iter_raw()
            first = next(chunks)
            took = time.perf_counter() - t0
            rest = b"".join(chunks)
        body = first + rest
        ok = resp.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    else:
        resp = client.post(url + "/v1/completions", content=payload, headers=headers)
        took = time.perf_counter() - t0
        ok = resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
    if not ok:
        raise RuntimeError(f"{url}: unexpected reply {resp.status_code}")
    return took


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(times: dict[str, dict[str, list[float]]], proxies: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for shape, by_target in times.items():
        direct = by_target["direct"]
        row: dict[str, dict] = {"direct": {"p50_ms": pct(direct, 0.5) * 1e3, "p90_ms": pct(direct, 0.9) * 1e3}}
        for name in proxies:
            via = by_target[name]
            row[name] = {
                "p50_ms": pct(via, 0.5) * 1e3,
                "p90_ms": pct(via, 0.9) * 1e3,
                "added_p50_ms": (pct(via, 0.5) - pct(direct, 0.5)) * 1e3,
                "added_p90_ms": (pct(via, 0.9) - pct(direct, 0.9)) * 1e3,
                "added_paired_median_ms": statistics.median(v - d for v, d in zip(via, direct, strict=True)) * 1e3,
            }
        out[shape] = {k: {m: round(x, 3) for m, x in v.items()} for k, v in row.items()}
    return out


def tree_commit(src: Path) -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short=9", "HEAD") or "unknown"
    return sha + ("+uncommitted" if git("status", "--porcelain", "--", ".") else "")


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{platform.node()} {platform.machine()} {model} ({os.cpu_count()} cores; load {load} at the end)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=SRC", help="a proxy from SRC (repeat)")
    p.add_argument("--n", type=int, default=200, help="measured rounds (each: every shape, every target)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proxy-flags", default="", help="more flags for every proxy, one string")
    p.add_argument("--profile", type=Path, help="run the proxies under cProfile, stats into this folder")
    p.add_argument("--out", type=Path, help="folder for proxy-overhead-<stamp>.json")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvbridge-proxy-overhead-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    port = free_port()
    backend_url = f"http://127.0.0.1:{port}"
    flags = [
        *("--prefill", backend_url, "--decode", backend_url, "--log-level", "info"),
        *("--disaggregation", "selective", "--routing", "cache_aware", "--prefix-block-tokens", "32"),
        *args.proxy_flags.split(),
    ]
    rng = random.Random(args.seed)
    backend_log = open(work / "backend.log", "w")  # noqa: SIM115 (closed in the finally below)
    backend = subprocess.Popen([sys.executable, "-c", BACKEND, str(port)], stdout=backend_log, stderr=subprocess.STDOUT)
    proxies: list[Proxy] = []
    times: dict[str, dict[str, list[float]]] = {shape_name(*s): {} for s in SHAPES}
    try:
        wait_up(backend_url, backend)
        for name, src in trees.items():
            proxies.append(Proxy(name, Path(src), flags, work, args.profile).__enter__())
        targets = {"direct": backend_url, **{px.name: px.url for px in proxies}}
        clients = {name: httpx.Client(trust_env=False, timeout=30) for name in targets}
        for shape in times.values():
            for name in targets:
                shape[name] = []
        for i in range(args.warmup + args.n):
            for tokens, stream in SHAPES:
                body = {
                    "model": "m",
                    "prompt": [rng.randrange(32000) for _ in range(tokens)],
                    "max_tokens": 16,
                    "temperature": 0.0,
                    "stream": stream,
                }
                payload = json.dumps(body).encode()
                order = list(targets)
                rng.shuffle(order)
                for name in order:
                    took = timed(clients[name], targets[name], payload, stream)
                    if i >= args.warmup:
                        times[shape_name(tokens, stream)][name].append(took)
        for px in proxies:
            px.dump_profile()
        for c in clients.values():
            c.close()
        decisions = {px.name: decisions_of(px.url) for px in proxies}
    finally:
        for px in proxies:
            px.__exit__()
        backend.terminate()
        backend.wait(10)
        backend_log.close()
    names = [px.name for px in proxies]
    result = {
        "command": "python " + " ".join(sys.argv),
        "host": machine(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trees": {name: {"src": src, "commit": tree_commit(Path(src))} for name, src in trees.items()},
        "proxy_flags": flags[4:],
        "n": args.n,
        "warmup": args.warmup,
        "profiled": bool(args.profile),
        "decisions": decisions,
        "shapes": summarize(times, names),
    }
    if len(names) > 1:
        first = names[0]
        result["added_p50_ratio_to_" + names[1]] = {
            shape: round(row[first]["added_p50_ms"] / row[names[1]]["added_p50_ms"], 3)
            for shape, row in result["shapes"].items()
            if row[names[1]]["added_p50_ms"] > 0
        }
    print(report(result, names))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"proxy-overhead-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {path}")
    return 0


def decisions_of(url: str) -> dict[str, float]:
    """The proxy's `kvbridge_proxy_decisions_total` by path/reason (all `direct/decode_idle` here)."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvbridge_proxy_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            parts = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1 : -1].split(","))
            out[f"{parts['path'].strip(chr(34))}/{parts['reason'].strip(chr(34))}"] = float(value)
    return out


def report(result: dict, names: list[str]) -> str:
    lines = [f"{'shape':<16} {'target':<8} {'p50 ms':>8} {'p90 ms':>8} {'+p50':>7} {'+p90':>7} {'+paired':>8}"]
    for shape, row in result["shapes"].items():
        for target in ["direct", *names]:
            r = row[target]
            added = (
                f"{r['added_p50_ms']:>7.3f} {r['added_p90_ms']:>7.3f} {r['added_paired_median_ms']:>8.3f}"
                if target != "direct"
                else ""
            )
            lines.append(f"{shape:<16} {target:<8} {r['p50_ms']:>8.3f} {r['p90_ms']:>8.3f} {added}")
    for key, value in result.items():
        if key.startswith("added_p50_ratio"):
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
