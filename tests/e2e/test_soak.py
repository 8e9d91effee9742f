"""A fault soak, bounded in time: 200+ PD requests with faults injected while reads are in flight, against real
vLLM servers with a deployment key and the real `kvbridge proxy`; every answer must equal the aggregated run's,
and no block may stay allocated on either side.

The prefill and decode servers run on two test hosts (network namespaces, tests/support/hosts.py): the KV crosses a veth
over TCP (kvbridge's KV channel, the default between hosts; NIXL stays on each host's loopback), so the bytes a READ
has moved can be counted on the decode host's link, and slowing the path to the decode host (tc) makes a 300-token
READ last seconds. The proxy and the client stay in the root namespace.

Traffic (seeded): plain requests through the proxy, lists of prompts and n=2 through the proxy, clients that
disconnect from the proxy mid-request, and, straight to the decode server, swapped params (another prompt's),
forged params (edited blocks, unsigned), replays, and decode legs that arrive after the params' lease. After that
pool, before any kill, both servers' KV usage must be back to its baseline (nothing leaked by the faults). Then,
each with the path to the decode host slowed, and checked by the bytes delivered to the decode host over its link
(100 kB or more of the READ's 1.5 MB, not all of it):

- a lease shorter than the read: a READ claimed before the prefill's lease ends and lasting past it loads the KV
  (token-identical, counted as transferred); while it is in flight after both leases ended, the prefill holds
  its blocks but has freed those of a request prefilled with it and never read (the control: the same gauge and
  the expired-lease counter see a lease that nothing pinned);
- the decode server killed mid-READ (the prefill frees the blocks), a new one on its address, traffic resumed;
- the prefill server killed mid-READ (the decode answers by recompute, token-identical, and frees its blocks), a
  new one on its address, traffic resumed.

The figures are printed. Not covered here: a link cut mid-READ (tests/e2e/test_e2e_hosts.py, xfail on a UCX crash),
and kills with several requests in flight at once (one READ at a time, so that the bytes counted are its own).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from kvbridge.serving.launcher import (
    RequestFailed,
    VllmServer,
    complete,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.wire.params import parse_prefill_done
from support.e2e_support import wait_for
from support.hosts import Host, connector_on, network_hosts, server_on, slowed, when_sent
from support.proxy import proxy_process

pytestmark = pytest.mark.vllm

KEY = b"soak-deployment-key-0123456789abcdef"
LEASE_S = 6.0
MAX_TOKENS = 6
READ_TOKENS = 300
"""A READ of three blocks: about 1.5 MB of KV (the tiny model's 4 layers x 4 KV heads x 128 tokens x 64 dims of K
and V in fp32 per block), 3 s at 4 Mbit/s."""
KV_BYTES = 3 * 4 * 4 * 128 * 64 * 4
MID_READ = 200_000
"""Bytes of the READ delivered to the decode host when a server is killed."""
SOURCE = "vllm:prompt_tokens_by_source_total"


def proxy(prefill: str, decode: str, key_file: str, log_path: Path) -> contextlib.AbstractContextManager[str]:
    cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill, "--decode", decode]
    return proxy_process([*cmd, "--port", "0", "--auth-key-file", key_file], log_path)


def prompt(rng: random.Random, n: int | None = None) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n or rng.randrange(40, 400))]


class Soak:
    def __init__(self, prefill: VllmServer, decode: VllmServer, proxy_url: str, rng: random.Random, model: str) -> None:
        self.prefill, self.decode, self.proxy_url, self.rng, self.model = prefill, decode, proxy_url, rng, model
        self.references: dict[tuple[int, ...], list[int]] = {}
        self.outcomes: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.lost = 0

    def reference(self, tokens: list[int]) -> list[int]:
        key = tuple(tokens)
        if key not in self.references:
            self.references[key] = complete(self.prefill.url, tokens, MAX_TOKENS)["choices"][0]["token_ids"]
        return self.references[key]

    def check(self, kind: str, tokens: list[int], got: list[int]) -> None:
        self.outcomes[kind] += 1
        if got != self.reference(tokens):
            self.wrong.append(kind)

    def params(self, tokens: list[int]) -> dict:
        return complete(self.prefill.url, tokens, 1, kv_transfer_params={"do_remote_decode": True})[
            "kv_transfer_params"
        ]

    def via_proxy(self, body: dict, timeout: float = 120) -> dict:
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **body}
        reply = httpx.post(self.proxy_url + "/v1/completions", json=body, timeout=timeout)
        assert reply.status_code == 200, reply.text
        return reply.json()

    # one request of each kind ------------------------------------------------------------------------

    def plain(self) -> None:
        tokens = prompt(self.rng)
        self.check("plain", tokens, self.via_proxy({"prompt": tokens})["choices"][0]["token_ids"])

    def listed(self) -> None:
        prompts = [prompt(self.rng), prompt(self.rng)]
        choices = sorted(self.via_proxy({"prompt": prompts})["choices"], key=lambda c: c["index"])
        for tokens, choice in zip(prompts, choices, strict=True):
            self.check("list", tokens, choice["token_ids"])

    def n2(self) -> None:
        tokens = prompt(self.rng)
        # n > 1 needs sampling (vLLM refuses n > 1 at temperature 0): top_k=1 makes it greedy
        choices = self.via_proxy({"prompt": tokens, "n": 2, "temperature": 1.0, "top_k": 1})["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1]
        for choice in choices:
            self.check("n=2", tokens, choice["token_ids"])

    def disconnect(self) -> None:
        self.faults["client disconnect"] += 1
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                self.proxy_url + "/v1/completions",
                json={"model": self.model, "prompt": prompt(self.rng, 380), "max_tokens": 200, "ignore_eos": True},
                timeout=0.3,
            )

    def swapped(self) -> None:
        self.faults["swapped params"] += 1
        a, b = prompt(self.rng, 200), prompt(self.rng, 200)
        self.params(a)
        pb = self.params(b)
        self.check(
            "swapped", a, complete(self.decode.url, a, MAX_TOKENS, kv_transfer_params=pb)["choices"][0]["token_ids"]
        )
        self.check("owner after swap", b, self.decode_with(b, pb))

    def forged(self) -> None:
        self.faults["forged params"] += 1
        tokens = prompt(self.rng)
        done = parse_prefill_done(self.params(tokens))
        edit = self.rng.choice(
            [
                {"remote_block_ids": [b + 7 for b in done.remote_block_ids]},
                {"kvbridge_sig": ""},
                {"remote_port": free_port()},
            ]
        )
        forged = msgspec.structs.replace(done, **edit).to_dict()
        self.check("forged", tokens, self.decode_with(tokens, forged))

    def replayed(self) -> None:
        self.faults["replayed params"] += 1
        tokens = prompt(self.rng)
        params = self.params(tokens)
        self.check("first use", tokens, self.decode_with(tokens, params))
        self.check("replay", tokens, self.decode_with(tokens, params))

    def late(self) -> None:
        self.faults["decode leg after the lease"] += 1
        tokens = prompt(self.rng)
        params = self.params(tokens)
        time.sleep(LEASE_S + 1)
        self.check("late", tokens, self.decode_with(tokens, params))

    def decode_with(self, tokens: list[int], params: dict) -> list[int]:
        return complete(self.decode.url, tokens, MAX_TOKENS, kv_transfer_params=params, timeout=120)["choices"][0][
            "token_ids"
        ]


def test_fault_soak(tmp_path, tiny_model):
    model = tiny_model
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    secure = {"auth_key_file": str(key_file)}
    started = time.monotonic()
    with network_hosts("prefill", "decode") as hosts:
        ph, dh = hosts["prefill"], hosts["decode"]

        def prefill_server(name: str) -> VllmServer:
            config = kvbridge_config("kv_producer", lease_s=LEASE_S, **connector_on(ph), **secure)
            return VllmServer(
                model,
                port=8000,
                cpu_bind="0",
                kv_transfer_config=config,
                name=name,
                log_path=tmp_path / f"{name}.log",
                **server_on(ph),
            )

        def decode_server(name: str) -> VllmServer:
            config = kvbridge_config(
                "kv_consumer",
                "recompute",
                handshake_timeout_s=2.0,
                handshake_retries=1,
                transfer_timeout_s=10.0,
                **connector_on(dh),
                **secure,
            )
            return VllmServer(
                model,
                port=8000,
                cpu_bind="1",
                kv_transfer_config=config,
                name=name,
                log_path=tmp_path / f"{name}.log",
                **server_on(dh),
            )

        prefill, decode = prefill_server("prefill"), decode_server("decode")
        with running((prefill, decode)), proxy(prefill.url, decode.url, str(key_file), tmp_path / "proxy.log") as url:
            figures = run_soak(model, prefill, decode, prefill_server, decode_server, url, dh)
    figures["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures, indent=1))
    assert figures["outputs different from the aggregated run"] == 0
    assert figures["requests answered"] >= 200
    assert figures["blocks left allocated"] == "none", "blocks stayed allocated"
    assert figures["prompt tokens moved by kvbridge (new decode server)"] > 0, "the KV must really move"


def run_soak(model, prefill, decode, prefill_server, decode_server, url: str, dh: Host) -> dict:
    phases: dict[str, float] = {}
    t_phase = time.monotonic()

    def phase(name: str) -> None:
        nonlocal t_phase
        phases[name] = round(time.monotonic() - t_phase, 1)
        t_phase = time.monotonic()

    baseline = prefill.kv_usage(), decode.kv_usage()
    rng = random.Random(2026)
    soak = Soak(prefill, decode, url, rng, str(model))
    kinds = ["plain"] * 10 + ["listed"] * 2 + ["n2"] * 2 + ["disconnect", "swapped", "forged", "replayed"]
    plan = [rng.choice(kinds) for _ in range(150)] + ["late"] * 2
    with ThreadPoolExecutor(4) as pool:
        for result in [pool.submit(getattr(soak, kind)) for kind in plan]:
            result.result()
    # Before any kill: every fault of the pool gave its blocks back on both sides (a lease plus a margin for the
    # last disconnected clients' decode legs and the last leases to end).
    t_pool = time.monotonic()
    back = wait_for(lambda: (prefill.kv_usage(), decode.kv_usage()) == baseline, LEASE_S + 15)
    after_pool = {
        "baseline (prefill, decode)": baseline,
        "after the pool (prefill, decode)": (prefill.kv_usage(), decode.kv_usage()),
        "seconds to get back": round(time.monotonic() - t_pool, 1),
    }
    print("kv usage after the fault pool:", json.dumps(after_pool))
    assert back, f"blocks stayed allocated after the fault pool: {after_pool}"
    phase("the pool")

    lease = read_outlives_lease(soak, dh, baseline[0])
    print("a read outlived its lease:", json.dumps(lease))
    phase("a read outliving its lease")

    # The decode server killed mid-READ: the prefill frees the blocks (the proxy's abort, else the claim's pin
    # ends: transfer timeout + margin), and a new decode server takes its address.
    killed_decode = kill_mid_read(soak, dh, decode, "decode server killed mid-READ")
    t0 = time.monotonic()
    assert wait_for(lambda: prefill.kv_usage() == baseline[0], 10 + 5 + LEASE_S + 5), "the prefill kept the blocks"
    killed_decode["prefill blocks freed after (s)"] = round(time.monotonic() - t0, 1)
    print("decode killed mid-READ:", json.dumps(killed_decode))
    decode = soak.decode = decode_server("decode-2").start()
    restarted = None
    try:
        decode.wait_ready(timeout=300)
        assert wait_for(lambda: _healthy(url), 30), "the proxy did not take the new decode server back"
        with ThreadPoolExecutor(4) as pool:
            for result in [pool.submit(soak.plain) for _ in range(40)]:
                result.result()
        phase("decode killed mid-READ, replaced, 40 requests")
        # The prefill server killed mid-READ: the decode answers by recompute (checked against the reference taken
        # before the kill) and frees its blocks; a new prefill server takes its address.
        killed_prefill = kill_mid_read(soak, dh, prefill, "prefill server killed mid-READ")
        t0 = time.monotonic()
        assert wait_for(lambda: decode.kv_usage() == baseline[1], 15), "the decode kept the blocks"
        killed_prefill["decode blocks freed after (s)"] = round(time.monotonic() - t0, 1)
        print("prefill killed mid-READ:", json.dumps(killed_prefill))
        assert killed_prefill["answer"] == "200, same tokens", killed_prefill
        restarted = soak.prefill = prefill_server("prefill-2").start()
        restarted.wait_ready(timeout=300)
        assert wait_for(lambda: _healthy(url), 30), "the proxy did not take the new prefill server back"
        with ThreadPoolExecutor(4) as pool:
            for result in [pool.submit(soak.plain) for _ in range(20)]:
                result.result()
        freed = wait_for(lambda: restarted.kv_usage() == baseline[0], 45) and wait_for(
            lambda: decode.kv_usage() == baseline[1], 15
        )
        moved = metric_sum(metrics(decode.url), SOURCE, source="external_kv_transfer")
        phase("prefill killed mid-READ, replaced, 20 requests")
    finally:
        decode.stop()
        if restarted is not None:
            restarted.stop()
    return {
        "requests answered": sum(soak.outcomes.values()),
        "by kind": dict(soak.outcomes),
        "faults injected": dict(soak.faults),
        "requests lost with the killed servers (HTTP errors, never wrong answers)": soak.lost,
        "outputs different from the aggregated run": len(soak.wrong),
        "kv usage after the fault pool (before the kills)": after_pool,
        "a read outlived its lease": lease,
        "decode killed mid-READ": killed_decode,
        "prefill killed mid-READ": killed_prefill,
        "blocks left allocated": "none" if freed else "LEAKED",
        "prompt tokens moved by kvbridge (new decode server)": moved,
        "seconds by phase (after the servers started)": phases,
    }


def read_outlives_lease(soak: Soak, dh: Host, baseline: float) -> dict:
    """A READ claimed before the prefill's lease ends, lasting past it (the path to the decode host at 3 Mbit/s:
    about 4 s), must load the KV: the claim pins the blocks. The control: a request prefilled with it and never
    read is freed at its lease's end. Seen by the expired-lease counter (the control's lease only), and by the KV
    usage gauge once both leases are over while the read is still going. A gauge reading that comes back after the
    read has landed (or not at all) on a loaded machine shows nothing and is listed, not checked; if no reading is
    left, the read must also have ended with no lease aborted and no load failed (no other path freed it)."""
    soak.faults["lease shorter than the read in flight"] += 1
    prefill, decode = soak.prefill, soak.decode
    a, b = prompt(soak.rng, READ_TOKENS), prompt(soak.rng, READ_TOKENS)
    soak.reference(a)  # the aggregated answer, before the read
    expired_before = metric_sum(metrics(prefill.url), "vllm:kvbridge_expired_leases_total")
    failed_before = metric_sum(metrics(decode.url), "vllm:kvbridge_failures_total")
    aborted_before = metric_sum(metrics(prefill.url), "vllm:kvbridge_aborted_leases_total")
    moved_before = metric_sum(metrics(decode.url), SOURCE, source="external_kv_transfer")
    pa, pb = soak.params(a), soak.params(b)
    both_held = prefill.kv_usage()
    answer: dict = {}

    def leg() -> None:
        answer["tokens"] = soak.decode_with(a, pa)
        answer["done"] = time.time()

    read = threading.Thread(target=leg)
    samples: list[tuple[float, int]] = []  # (unix time, bytes delivered to the decode host since the leg began)
    with slowed(dh, "3mbit"):
        time.sleep(max(0.0, pa["remote_expires"] - 1.5 - time.time()))  # the leg 1.5 s before the lease ends
        sent = dh.rx_bytes()
        leg_at = time.time()
        read.start()
        held = None
        both_over = max(pa["remote_expires"], pb["remote_expires"]) + 0.7  # both leases over, their frees seen
        late: list[tuple[float | None, int, float]] = []  # (usage, bytes, seconds) of readings not taken
        while read.is_alive():
            samples.append((time.time(), dh.rx_bytes() - sent))
            if held is None and samples[-1][0] > both_over:
                # Both leases over. The gauge counts only if the read was still going when /metrics answered:
                # that answer can take seconds on a loaded machine, and a read that lands meanwhile frees its
                # blocks. So the bytes are read again after it; a reading that came back too late is not taken.
                asked = time.monotonic()
                try:
                    usage: float | None = prefill.kv_usage()
                except OSError:  # no answer in time: no reading
                    usage = None
                reading = usage, dh.rx_bytes() - sent, round(time.monotonic() - asked, 2)
                if usage is not None and reading[1] < KV_BYTES:
                    held = reading
                else:
                    late.append(reading)
            time.sleep(0.01)
        read.join()
    lease_end = pa["remote_expires"]
    at_end = next((n for t, n in samples if t >= lease_end), None)
    moved = metric_sum(metrics(decode.url), SOURCE, source="external_kv_transfer") - moved_before
    assert wait_for(lambda: prefill.kv_usage() == baseline, 15), "the read's blocks stayed allocated"
    assert wait_for(
        lambda: metric_sum(metrics(prefill.url), "vllm:kvbridge_expired_leases_total") >= expired_before + 1, 10
    ), "the control's lease never expired"
    expired = metric_sum(metrics(prefill.url), "vllm:kvbridge_expired_leases_total") - expired_before
    figures = {
        "decode leg began (s before the lease's end)": round(lease_end - leg_at, 2),
        "read bytes delivered by the lease's end": at_end,
        "usage: both held, after both leases with the read in flight, baseline": (
            both_held,
            held and held[0],
            baseline,
        ),
        "read bytes delivered when that reading came back, and its seconds": held and held[1:],
        "readings not taken: back after the read landed, or none (usage, bytes, seconds)": late,
        "answered (s after the lease's end)": round(answer.get("done", lease_end) - lease_end, 2),
        "prompt tokens transferred": moved,
        "leases expired (the unread control only)": expired,
        "loads failed": metric_sum(metrics(decode.url), "vllm:kvbridge_failures_total") - failed_before,
        "leases aborted": metric_sum(metrics(prefill.url), "vllm:kvbridge_aborted_leases_total") - aborted_before,
    }

    def diagnosed() -> dict:
        """The figures and the log lines that say what became of the read: read only for a failure's message."""
        logs = {server: server.log_path.read_text(errors="replace").splitlines() for server in (prefill, decode)}
        return {
            **figures,
            "log lines of the read": [
                line.strip()[:300] for lines in logs.values() for line in lines if pa["remote_request_id"] in line
            ],
            "the decode's last kvbridge warnings": [
                line.strip()[:300] for line in logs[decode] if "WARNING" in line and "[kvbridge]" in line
            ][-4:],
        }

    soak.check("read outlived its lease", a, answer.get("tokens", []))
    assert at_end is not None and 100_000 <= at_end < KV_BYTES, f"no READ in flight at the lease's end: {diagnosed()}"
    after_both = next((n for t, n in samples if t > both_over), None)
    assert after_both is not None and after_both < KV_BYTES, f"the read ended before both leases had: {diagnosed()}"
    if held is not None:
        assert baseline < held[0] < both_held, f"the pinned read's blocks must stay, the unread ones go: {diagnosed()}"
    else:  # no reading while the read went on: no other path may have freed it (the lease counter is asserted below)
        assert figures["leases aborted"] == 0 and figures["loads failed"] == 0, diagnosed()
    assert moved == len(a), f"the read must load the KV, not recompute: {diagnosed()}"
    assert answer["done"] > lease_end and expired == 1, diagnosed()
    return figures


def kill_mid_read(soak: Soak, dh: Host, server: VllmServer, fault: str) -> dict:
    """One request through the proxy with the path to the decode host slowed; `server` SIGKILLed once 200 kB of
    its READ have reached the decode host (checked: before all of it had). An answer must be the aggregated one;
    an HTTP error counts as lost."""
    soak.faults[fault] += 1
    tokens = prompt(soak.rng, READ_TOKENS)
    soak.reference(tokens)  # before the prefill server may be gone
    reply: dict = {}

    def leg() -> None:
        body = {"model": soak.model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            got = httpx.post(soak.proxy_url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
            reply["status"] = got.status_code
            if got.status_code == 200:
                reply["tokens"] = got.json()["choices"][0]["token_ids"]
        except httpx.HTTPError as exc:
            reply["status"] = type(exc).__name__
        reply["seconds"] = round(time.monotonic() - t0, 1)

    request = threading.Thread(target=leg)
    with slowed(dh):
        t0 = time.monotonic()
        request.start()
        in_flight = when_sent(dh.rx_bytes, MID_READ, server.kill)
        request.join(120)
    assert MID_READ <= in_flight < KV_BYTES, f"{fault}: the kill came at {in_flight} bytes of {KV_BYTES}, not mid-READ"
    if "tokens" in reply:
        soak.check(fault, tokens, reply["tokens"])
        answer = "200, same tokens" if reply["tokens"] == soak.reference(tokens) else "200, WRONG tokens"
    else:
        soak.lost += 1
        answer = f"lost ({reply.get('status')})"
    return {"read bytes delivered at the kill": in_flight, "answer": answer, "seconds": reply.get("seconds")}


def _failed(future) -> bool:
    try:
        future.result()
    except (RequestFailed, OSError, AssertionError, httpx.HTTPError):
        return True
    return False


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
