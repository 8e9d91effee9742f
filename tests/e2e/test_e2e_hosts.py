"""Prefill and decode on different hosts: network namespaces joined by veth, KV over TCP on the veth.

The prefill server (PP=2) runs in one namespace, the decode server in another, the test client in the root
namespace; both hold the deployment key (authenticated side channel, signed kv_transfer_params). The deployment is
the default one: NIXL's UCX stays on each host's loopback, and the KV crosses the link over kvbridge's own channel
(authenticated with the key, AES-GCM frames): the prefill host's transmitted bytes are checked against the KV size,
and the decode's log names the channel. Then the
prefill host's link is cut in the middle of a request: the decode side recomputes within a bounded time, the
prefill side frees the held blocks when the lease expires, and requests succeed again once the link is back.
With the path to a decode host slowed (tc tbf, 4 Mbit/s) so that a READ takes seconds, a second decode server is
then killed while its READ is in flight, and last the prefill server is killed while one is: the decode side
answers by recompute with the aggregated tokens in bounded time, and no block stays held on either side. A link cut
while a READ is in flight has its own test (UCX can crash the prefill worker there: see UCX_TCP_PURGE_CRASH), in
`make e2e-long` (marker `long`).
"""

from __future__ import annotations

import random
import shutil
import subprocess
import threading
import time

import pytest

from kvbridge.serving.launcher import VllmServer, complete, kvbridge_config, metric_sum, metrics, running
from support.hosts import connector_on, network_hosts, server_on, slowed, when_sent

pytestmark = pytest.mark.vllm

LEASE_S = 8.0
if shutil.which("ip") is None:  # the Makefile installs iproute2; fail loudly rather than skip
    raise RuntimeError("these tests need iproute2 (`ip`)")


def server(model, host, role: str, pp: int, cores: str, log) -> VllmServer:
    """A server on `host`, authenticated with the deployment key (a side channel beyond loopback needs one)."""
    key = log.parent / "deployment.key"
    if not key.exists():
        key.write_bytes(b"cross-host-test-key-0123456789abcdef")
    extra = {**connector_on(host), "lease_s": LEASE_S, "auth_key_file": str(key)}
    if role == "kv_consumer":
        # dead_engine_s 2: a prefill found unreachable is known dead for 2 s, not 10, so that the request after
        # the link came back (seconds later) probes it again instead of failing at once
        extra.update(handshake_timeout_s=2.0, handshake_retries=1, transfer_timeout_s=10.0, dead_engine_s=2.0)
    return VllmServer(
        model,
        port=8000,
        pp=pp,
        cpu_bind=cores,
        **server_on(host),
        kv_transfer_config=kvbridge_config(role, "recompute", **extra),
        name=f"{role}-{host.name}",
        log_path=log,
    )


def test_kv_crosses_the_network_and_survives_a_cut_link(tmp_path, tiny_model):
    model = tiny_model
    with network_hosts("prefill", "decode", "doomed") as hosts:
        ph, dh, xh = hosts["prefill"], hosts["decode"], hosts["doomed"]
        prefill = server(model, ph, "kv_producer", 2, "0|0", tmp_path / "prefill.log")
        decode = server(model, dh, "kv_consumer", 1, "1", tmp_path / "decode.log")
        doomed = server(model, xh, "kv_consumer", 1, "1", tmp_path / "doomed.log")  # a decode killed mid-READ
        with running((prefill, decode, doomed)):
            rng = random.Random(11)
            kv_bytes_per_block = 4 * 4 * 128 * 64 * 4  # layers x KV heads x block tokens x (K+V) dims x fp32
            for n in (200, 300, 380):
                prompt = [rng.randrange(1, 1000) for _ in range(n)]
                params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                    "kv_transfer_params"
                ]
                assert params["remote_host"] == ph.ip, "the prefill side must advertise its reachable address"
                sent = ph.tx_bytes()
                t0 = time.monotonic()
                tokens = complete(decode.url, prompt, 8, kv_transfer_params=params)["choices"][0]["token_ids"]
                elapsed = time.monotonic() - t0
                over_link = ph.tx_bytes() - sent
                assert tokens == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
                kv = len(params["remote_block_ids"]) * kv_bytes_per_block
                assert over_link >= kv, f"only {over_link} bytes left the prefill host for {kv} bytes of KV"
                print(f"\n{n} tokens: {kv} KV bytes, {over_link} bytes over the veth, decode request {elapsed:.3f} s")
            m = metrics(decode.url)
            assert metric_sum(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 880
            assert "; kvbridge KV channel)" in decode.log_path.read_text(), "the KV did not take kvbridge's channel"

            # Cut the prefill host off between the prefill leg and the decode leg.
            baseline = prefill.kv_usage()
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            reference = complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
            deadline = time.monotonic() + 5  # vLLM publishes the usage gauge with its step's stats, maybe later
            while prefill.kv_usage() <= baseline and time.monotonic() < deadline:
                time.sleep(0.1)
            assert prefill.kv_usage() > baseline
            subprocess_ip("link", "set", ph.link, "down")
            try:
                t0 = time.monotonic()
                tokens = complete(decode.url, prompt, 8, kv_transfer_params=params, timeout=120)["choices"][0][
                    "token_ids"
                ]
                elapsed = time.monotonic() - t0
            finally:
                subprocess_ip("link", "set", ph.link, "up")
            assert tokens == reference, "the decode side must recompute when the prefill host is unreachable"
            assert elapsed < 30, f"a cut link held the request for {elapsed:.1f} s"
            print(f"cut link: recomputed in {elapsed:.1f} s")
            deadline = time.monotonic() + LEASE_S + 15
            while prefill.kv_usage() != baseline and time.monotonic() < deadline:
                time.sleep(0.5)
            assert prefill.kv_usage() == baseline, "the prefill host leaked the unread request's blocks"
            assert decode.kv_usage() == 0.0

            # The link is back: transfers work again.
            prompt = [rng.randrange(1, 1000) for _ in range(250)]
            before = metric_sum(
                metrics(decode.url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            )
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            tokens = complete(decode.url, prompt, 8, kv_transfer_params=params)["choices"][0]["token_ids"]
            assert tokens == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
            after = metric_sum(metrics(decode.url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            assert after - before == len(prompt), "after the link came back the KV should be transferred again"

            # A decode server killed (SIGKILL) while its READ is in flight: the prefill frees the blocks once the
            # claim's pin ends, and the other decode server is unaffected.
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            answer, in_flight = mid_read(doomed, ph, xh, prompt, params, doomed.kill, lambda: None)
            print(f"decode killed mid-READ after {in_flight} bytes")
            assert 200_000 <= in_flight < kv_bytes_per_block * 3, f"the kill came at {in_flight} bytes, not mid-READ"
            assert "error" in answer, answer  # its client saw the server die
            t0 = time.monotonic()
            while prefill.kv_usage() != baseline and time.monotonic() - t0 < 10 + 5 + LEASE_S + 15:
                time.sleep(0.5)
            print(f"decode killed mid-READ: the prefill freed its blocks {time.monotonic() - t0:.1f} s later")
            assert prefill.kv_usage() == baseline, "the prefill host leaked a killed reader's blocks"
            healthy = [rng.randrange(1, 1000) for _ in range(200)]
            params = complete(prefill.url, healthy, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            tokens = complete(decode.url, healthy, 8, kv_transfer_params=params)["choices"][0]["token_ids"]
            assert tokens == complete(prefill.url, healthy, 8)["choices"][0]["token_ids"]

            # Last: the prefill server killed (SIGKILL) while a READ from it is in flight.
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            reference = complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
            answer, in_flight = mid_read(decode, ph, dh, prompt, params, prefill.kill, lambda: None)
            print(f"prefill killed mid-READ after {in_flight} bytes: answered in {answer.get('seconds', -1):.1f} s")
            assert 200_000 <= in_flight < kv_bytes_per_block * 3, f"the kill came at {in_flight} bytes, not mid-READ"
            assert "error" not in answer, answer
            assert answer["tokens"] == reference, "a READ from a killed prefill must be recomputed, never used"
            assert answer["seconds"] < 40, answer
            assert decode.kv_usage() == 0.0, "the decode host leaked the request's blocks"
            assert complete(decode.url, prompt, 8)["choices"][0]["token_ids"] == reference  # still serving


UCX_TCP_PURGE_CRASH = (
    "a link cut mid-READ can kill the prefill worker: SIGSEGV in UCX (ucp_worker_progress -> uct_tcp_iface_progress"
    " -> ucp_worker_discard_uct_ep -> uct_tcp_ep_pending_purge -> ucp_request_memory_dereg, under NIXL's getNotifs)"
    " once the link is back, seen in 1 of 4 CI runs. bench/ucx_cut_stress.py reproduces it when the decode closes its"
    " endpoint with answers still queued at the prefill, and the decode now posts a flush READ first"
    " (docs/benchmarks/link-cut.md);"
    " what failed the endpoint in this test is not known (no endpoint is closed before its asserts), so the flush is"
    " not shown to cover it: 5 of 5 runs with the flush passed, too few against 1 in 4"
)


@pytest.mark.long  # a non-strict xfail: it cannot fail `make e2e`, so it runs in `make e2e-long`
@pytest.mark.xfail(reason=UCX_TCP_PURGE_CRASH, strict=False)
def test_a_link_cut_while_a_read_is_in_flight_is_recomputed(tmp_path, tiny_model):
    """The path to the decode host slowed to 4 Mbit/s (a 300-token READ then takes about 3 s), the prefill host cut
    off once 200 kB of the READ have left: the decode answers by recompute with the aggregated tokens within its
    transfer timeout, no block stays held on either host, and once the link is back the prefill server is alive and
    the next request is transferred."""
    model = tiny_model
    with network_hosts("prefill", "decode") as hosts:
        ph, dh = hosts["prefill"], hosts["decode"]
        prefill = server(model, ph, "kv_producer", 1, "0", tmp_path / "prefill.log")
        decode = server(model, dh, "kv_consumer", 1, "1", tmp_path / "decode.log")
        with running((prefill, decode)):
            rng = random.Random(12)
            kv_bytes_per_block = 4 * 4 * 128 * 64 * 4
            for server_ in (prefill, decode):
                complete(server_.url, [rng.randrange(1, 1000) for _ in range(20)], 2)
            baseline = prefill.kv_usage()
            # Cut the link while a READ is in flight: the path to the decode host is slowed to 4 Mbit/s (a 300-token
            # READ then takes about 3 s), and the prefill host is cut off once 200 kB of it have left.
            prompt = [rng.randrange(1, 1000) for _ in range(300)]
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            reference = complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
            cut = lambda: subprocess_ip("link", "set", ph.link, "down")  # noqa: E731
            answer, in_flight = mid_read(
                decode, ph, dh, prompt, params, cut, lambda: subprocess_ip("link", "set", ph.link, "up")
            )
            print(f"cut mid-READ after {in_flight} bytes: answered in {answer.get('seconds', -1):.1f} s")
            assert 200_000 <= in_flight < kv_bytes_per_block * 3, f"the cut came at {in_flight} bytes, not mid-READ"
            assert "error" not in answer, answer
            assert answer["tokens"] == reference, "a READ cut in flight must be recomputed, never used"
            assert answer["seconds"] < 40, answer
            deadline = time.monotonic() + 10 + 5 + LEASE_S + 15  # a claimed read is pinned transfer timeout + 5 s
            while prefill.kv_usage() != baseline and time.monotonic() < deadline:
                time.sleep(0.5)
            assert prefill.kv_usage() == baseline, "the prefill host leaked the cut request's blocks"
            assert decode.kv_usage() == 0.0, "the decode host leaked the cut request's blocks"
            prompt = [rng.randrange(1, 1000) for _ in range(250)]
            params = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})[
                "kv_transfer_params"
            ]
            tokens = complete(decode.url, prompt, 8, kv_transfer_params=params)["choices"][0]["token_ids"]
            assert tokens == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]

            assert complete(prefill.url, prompt, 4)["choices"][0]["token_ids"]  # the prefill server survived


def mid_read(decode, ph, dh, prompt, params, act, undo) -> tuple[dict, int]:
    """The decode leg of `params` with the path to the decode host slowed to 4 Mbit/s (a 300-token READ takes
    about 3 s); `act()` once 200 kB of the READ have been delivered to the decode host, `undo()` after. (answer,
    bytes delivered when it acted): answer has "tokens" or "error", and "seconds". Counted where they arrive, after
    the shaper: a sender with a wide TCP window (the KV channel's pooled connections) hands the link its whole
    part at once, most of it dropped by the shaper and sent again, so what left the prefill host says little."""
    answer: dict = {}

    def decode_leg() -> None:
        t0 = time.monotonic()
        try:
            got = complete(decode.url, prompt, 8, kv_transfer_params=params, timeout=120)
            answer["tokens"] = got["choices"][0]["token_ids"]
        except Exception as exc:  # the caller asserts on it
            answer["error"] = exc
        answer["seconds"] = time.monotonic() - t0

    leg = threading.Thread(target=decode_leg)
    try:
        with slowed(dh):
            try:
                leg.start()
                in_flight = when_sent(dh.rx_bytes, 200_000, act)
                leg.join(90)
            finally:
                undo()
    finally:
        leg.join(90)
    return answer, in_flight


def subprocess_ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)
