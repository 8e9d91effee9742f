"""The proxy's routing: the prefix index (its bounds under Hypothesis), the choice of instance (longest held prefix,
within the load bound), the direct-or-disaggregated decision and its threshold learned from metrics, and over HTTP
with fake backends: a request sent straight to a decode instance is the client's request, logged and counted."""

from __future__ import annotations

import logging

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.serving.proxy import Balancer, ProxyConfig
from kvbridge.serving.proxy.costs import (
    PREFILL_TIME,
    SERIES,
    SOURCE,
    TRANSFER_COUNT,
    TRANSFER_SUM,
    TRANSFERS,
    CostLearner,
)
from kvbridge.serving.proxy.prefix_index import PrefixIndex, prompt_blocks
from kvbridge.serving.proxy.router import NoBackendError, Router
from support.proxy import BODY, FakeBackend, prompt_key, proxy_for, running, wait_for

# --- the prefix index -----------------------------------------------------------------------------------------


def keys(prompt: list[int], block: int = 4, salt: str | None = None) -> tuple[bytes, ...]:
    body = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
    return prompt_blocks(body, False, block).keys


def test_block_keys_name_the_whole_prefix_and_the_salt():
    a = keys(list(range(10)))
    assert len(a) == 2  # full blocks only
    assert keys([*range(8), 99, 98, 97, 96])[:2] == a  # same first two blocks, then its own
    assert keys([9, *range(1, 10)])[1] != a[1]  # block 1 is the same tokens, its prefix is not
    assert keys(list(range(10)), salt="s") != a
    assert len(keys([2**64, *range(9)])) == 2  # an id beyond 64 bits is keyed by its text
    text = prompt_blocks({"prompt": "x" * 70}, False, 4)
    assert (len(text.keys), text.tokens) == (4, 18)  # 16 characters a block, 4 a token
    turn1 = [{"role": "user", "content": "hello " * 20}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    k1 = prompt_blocks({"messages": turn1}, True, 4).keys
    k2 = prompt_blocks({"messages": turn2}, True, 4).keys
    assert k1 and k2[: len(k1) - 1] == k1[:-1]  # the next turn extends the previous one's text


def test_index_matches_the_longest_routed_prefix_and_expires():
    index = PrefixIndex(max_blocks=100, ttl_s=10)
    index.add(keys(list(range(40))), now=0)
    assert index.match(keys(list(range(40))), now=1) == 10
    assert index.match(keys([*range(20), 7, 7, 7, 7]), now=1) == 5
    assert index.match(keys(list(range(40)), salt="other"), now=1) == 0
    assert index.match(keys(list(range(40))), now=10) == 0 and len(index) == 0


prompts = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=24), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(1, 12), st.lists(st.floats(0, 5), min_size=30, max_size=30))
def test_index_stays_within_its_bounds_and_forgets_prompts_from_their_end(batch, max_blocks, gaps):
    """Small alphabets make prompts share prefixes. After any sequence of adds: at most max_blocks keys; nothing
    older than ttl matches; and every prompt ever added is held as a prefix (its held keys are its first ones)."""
    index = PrefixIndex(max_blocks=max_blocks, ttl_s=3)
    now = 0.0
    added: list[tuple[tuple[bytes, ...], float]] = []
    for prompt, gap in zip(batch, gaps, strict=False):
        now += gap
        k = keys(prompt, block=2)
        index.add(k, now)
        added.append((k, now))
        assert len(index) <= max_blocks
        if len(k) <= max_blocks:
            assert index.match(k, now) == len(k)  # what was just routed is held
        for old, _when in added:
            held = [key in index._expiry for key in old]
            assert held == sorted(held, reverse=True), "a block kept while its prefix was forgotten"
    later = now + 3  # the ttl after the last add: everything has expired
    assert all(index.match(k, later) == 0 for k, _ in added) and len(index) == 0


# --- choosing instances and the path --------------------------------------------------------------------------


def router(prefill: int = 1, decode: int = 2, **config) -> Router:
    cfg = ProxyConfig(
        prefill=tuple(f"http://p{i}" for i in range(prefill)),
        decode=tuple(f"http://d{i}" for i in range(decode)),
        prefix_block_tokens=4,
        **config,
    )
    return Router(cfg, Balancer(cfg.prefill, cfg.decode))


def test_a_conversation_sticks_to_the_instance_holding_it():
    r = router()
    first = r.route({"prompt": list(range(40))}, False, now=0)
    second = r.route({"prompt": list(range(60))}, False, now=1)  # busier: first's counts are not released
    assert second.decode.backend is first.decode.backend and second.decode.why == "prefix"
    assert second.decode.held_tokens == 40 and second.new_tokens == 20
    other = r.route({"prompt": [7] * 40}, False, now=2)
    assert other.decode.backend is not first.decode.backend and other.decode.why == "least_loaded"


def test_a_hot_prefix_cannot_overload_one_instance():
    r = router(max_imbalance=2)
    routes = [r.route({"prompt": list(range(40))}, False, now=i) for i in range(8)]
    counts = [b.outstanding for b in r.balancer.backends("decode")]
    assert max(counts) - min(counts) <= 3, counts
    assert "overloaded" in {x.decode.why for x in routes}
    # the control: with no bound to speak of, every request follows the prefix
    r = router(max_imbalance=100)
    routes = [r.route({"prompt": list(range(40))}, False, now=i) for i in range(8)]
    assert len({x.decode.backend.name for x in routes}) == 1


def test_without_stickiness_a_prefix_only_breaks_ties():
    r = router(sticky=False)
    a = r.route({"prompt": list(range(40))}, False, now=0)
    b = r.route({"prompt": list(range(40))}, False, now=1)
    assert b.decode.backend is not a.decode.backend  # a's instance is busier
    r.balancer.release(b.decode.backend)
    r.balancer.release(a.decode.backend)
    c = r.route({"prompt": list(range(40))}, False, now=2)
    assert c.decode.why == "prefix"


def test_least_loaded_routing_ignores_prefixes():
    r = router(routing="least_loaded")
    a = r.route({"prompt": list(range(40))}, False, now=0)
    b = r.route({"prompt": list(range(40))}, False, now=1)
    assert a.decode.backend is not b.decode.backend and b.decode.why == "balancer"


def test_selective_goes_direct_below_the_threshold_and_says_why():
    r = router(disaggregation="selective", direct_below_tokens=16)
    long = r.route({"prompt": list(range(40))}, False, now=0)
    assert (long.path, long.reason, long.new_tokens) == ("disaggregated", "at_or_above_threshold", 40)
    assert long.prefill is not None
    r.balancer.release(long.decode.backend)
    r.balancer.release(long.prefill.backend)
    turn = r.route({"prompt": list(range(50))}, False, now=1)
    assert (turn.path, turn.reason, turn.new_tokens, turn.decode.held_tokens) == ("direct", "below_threshold", 10, 40)
    assert turn.prefill is None and r.balancer.backends("prefill")[0].outstanding == 0
    line = turn.line()
    for part in ("path=direct", "reason=below_threshold", "prompt=50", "new=10", "threshold=16", "held 40"):
        assert part in line, line
    always = router().route({"prompt": [1]}, False, now=0)
    assert (always.path, always.reason, always.threshold) == ("disaggregated", "always", None)
    logprobs = router().route({"prompt": list(range(40))}, False, now=0, force_direct=True)
    assert (logprobs.path, logprobs.reason) == ("direct", "prompt_logprobs")


def test_with_no_prefill_instance_up_selective_serves_straight_from_the_decode():
    """A long prompt that selective disaggregation would send through a prefill instance goes straight to its
    decode instance when none is up (the same output, not a 503); `always` still needs one (the control)."""
    r = router(disaggregation="selective", direct_below_tokens=16)
    (prefill,) = r.balancer.backends("prefill")
    r.balancer.mark_down(prefill, "test")
    down = r.route({"prompt": list(range(40))}, False, now=0)
    assert (down.path, down.reason, down.prefill) == ("direct", "no_prefill", None)
    always = router()
    always.balancer.mark_down(always.balancer.backends("prefill")[0], "test")
    with pytest.raises(NoBackendError):
        always.route({"prompt": list(range(40))}, False, now=0)


def learned(r: Router, rate: float = 1e4, transfer: float | None = 0.0, hop: float | None = 0.0) -> Router:
    costs = r.learner.costs
    costs.prefill_tokens_per_s, costs.transfer_s_per_token, costs.hop_s = rate, transfer, hop
    return r


def test_an_idle_decode_computes_what_the_prefill_would_compute_as_much_of():
    """A decode instance running nothing serves a prompt itself when the prefill instance holds no more of it: the
    prefill would compute as many tokens and add the hop and the transfer. Whatever the costs, known or not."""
    for r in (router(disaggregation="selective"), learned(router(disaggregation="selective"), hop=1e-6)):
        first = r.route({"prompt": list(range(400))}, False, now=0)
        assert (first.path, first.reason, first.new_tokens, first.prefill_new) == ("direct", "decode_idle", 400, 400)
        assert "reason=decode_idle" in first.line() and "prefill_new=400" in first.line()
    # the control: the same prompt on a busy decode instance is decided by the threshold (initial: 256)
    r = router(disaggregation="selective", decode=1)
    r.route({"prompt": [7] * 40}, False, now=0)  # not released: the decode instance runs it
    busy = r.route({"prompt": list(range(400))}, False, now=1)
    assert (busy.path, busy.reason, busy.threshold) == ("disaggregated", "at_or_above_threshold", 256)
    # and a fixed threshold is the operator's: no idle rule
    fixed = router(disaggregation="selective", direct_below_tokens=16).route({"prompt": list(range(400))}, False, 0)
    assert (fixed.path, fixed.reason) == ("disaggregated", "at_or_above_threshold")


def test_the_prefill_instances_missing_prefix_counts_against_disaggregating():
    """A conversation held by its decode instance and not by the prefill instance: disaggregating its next turn
    would recompute the whole conversation on the prefill instance, so the turn goes straight to the decode; the
    same turn is disaggregated when the prefill instance holds the conversation too."""

    def busy_turn(prefill_holds: bool) -> Router:
        r = learned(router(disaggregation="selective", decode=1), hop=0.001)
        if prefill_holds:
            r.indexes[r.balancer.backends("prefill")[0]].add(keys(list(range(400))), 0)
        r.indexes[r.balancer.backends("decode")[0]].add(keys(list(range(400))), 0)
        r.route({"prompt": [7] * 40}, False, now=1)  # the decode instance runs another request
        return r

    # the decode has 40 tokens queued: direct is (40 + new) / rate; disaggregated 1 ms + prefill_new / rate
    lacking = busy_turn(prefill_holds=False).route({"prompt": list(range(560))}, False, now=2)
    assert (lacking.new_tokens, lacking.prefill_new) == (160, 560)
    assert lacking.threshold == pytest.approx((0.001 + (560 - 40) / 1e4) / (1 / 1e4))  # 530 tokens
    assert (lacking.path, lacking.reason) == ("direct", "below_threshold")
    holding = busy_turn(prefill_holds=True).route({"prompt": list(range(560))}, False, now=2)
    assert (holding.new_tokens, holding.prefill_new) == (160, 160)
    assert holding.threshold == pytest.approx((0.001 + (160 - 40) / 1e4) / (1 / 1e4))  # 130 tokens
    assert (holding.path, holding.reason) == ("disaggregated", "at_or_above_threshold")


def test_each_request_goes_where_its_first_token_comes_first_and_the_queues_balance():
    """The router keeps, per instance, the tokens routed there and not computed yet: a request is disaggregated
    while the prefill instance's queue and what it lacks come to less than the decode's queue and its new tokens
    (plus the hop and the transfer), and goes straight to the decode once the prefill's queue is the longer."""
    r = learned(router(disaggregation="selective", decode=1))  # 10,000 tokens/s, no hop, no transfer cost
    prefill, decode = r.balancer.backends("prefill")[0], r.balancer.backends("decode")[0]
    first = r.route({"prompt": [7] * 400}, False, now=0)
    assert (first.reason, first.queued, r.queued[decode]) == ("decode_idle", 0, 400)
    b = r.route({"prompt": [5] * 300}, False, now=1)  # prefill: 0 + 300 ahead; decode: 400 + 300
    assert (b.path, b.queued, b.threshold) == ("disaggregated", 0, pytest.approx(-100))
    c = r.route({"prompt": [6] * 300}, False, now=2)  # prefill: 300 + 300; decode: 400 + 300
    assert (c.path, c.queued, c.threshold) == ("disaggregated", 300, pytest.approx(200))
    d = r.route({"prompt": [8] * 300}, False, now=3)  # prefill: 600 + 300; decode: 400 + 300
    assert (d.path, d.reason, d.queued, d.threshold) == ("direct", "below_threshold", 400, pytest.approx(500))
    assert (r.queued[prefill], r.queued[decode]) == (600, 700)
    assert "queued=400" in d.line()
    for route in (first, b, c, d, b):  # settling twice counts once
        r.settle(route)
    assert (r.queued[prefill], r.queued[decode]) == (0, 0)


def test_a_cost_not_measured_yet_counts_as_none_once_the_prefill_rate_is_known():
    r = learned(router(disaggregation="selective", direct_initial_tokens=7), transfer=None, hop=None)
    assert r.threshold(1000) == pytest.approx(1000)  # the prefill's 1000 tokens ahead against the decode's new
    r.learner.costs.prefill_tokens_per_s = None
    assert r.threshold(1000) == 7  # the rate unknown: the initial threshold


def samples(**values: float) -> list:
    names = {
        "computed": (SOURCE, {"source": "local_compute"}),
        "loaded": (SOURCE, {"source": "external_kv_transfer"}),
        "prefill_s": (PREFILL_TIME, {}),
        "transfer_s": (TRANSFER_SUM, {}),
        "loads": (TRANSFER_COUNT, {}),
        "transfers": (TRANSFERS, {}),
    }
    return [(names[k][0], names[k][1], v) for k, v in values.items()]


def test_the_threshold_is_learned_from_metrics_and_the_hop():
    learner = CostLearner()
    assert learner.costs.threshold() is None
    learner.prefill_read("p", samples(computed=10, prefill_s=1.0))  # since start: too few tokens to tell
    assert learner.costs.prefill_tokens_per_s is None
    learner.prefill_read("p", samples(computed=10010, prefill_s=2.0))  # 10,000 tokens in 1 s
    learner.decode_read("d", samples(loaded=4000, transfer_s=0.08, loads=4, transfers=4))  # 20 ms a 1000-token load
    learner.prefill_leg(0.15, 1000)  # 0.1 s of compute: a 50 ms hop
    costs = learner.costs
    assert costs.prefill_tokens_per_s == pytest.approx(10000)
    assert costs.transfer_s_per_token == pytest.approx(20e-6)
    assert costs.hop_s == pytest.approx(0.05)
    assert costs.threshold() == pytest.approx(0.05 / (1e-4 - 2e-5))  # 625 tokens
    assert costs.threshold(1000) == pytest.approx((0.05 + 0.1) / (1e-4 - 2e-5))  # the prefill computes 1000 more
    assert costs.threshold(-1000) == pytest.approx((0.05 - 0.1) / (1e-4 - 2e-5))  # the decode's queue is longer
    learner.decode_read("d", samples(loaded=10, transfer_s=0, loads=0, transfers=0))  # a restart: no measurement
    assert costs.transfer_s_per_token == pytest.approx(20e-6)
    slow = CostLearner()
    slow.costs.prefill_tokens_per_s, slow.costs.transfer_s_per_token, slow.costs.hop_s = 1000, 2e-3, 0.01
    assert slow.costs.threshold() == float("inf")  # transferring costs more than computing


def test_costs_are_read_from_prometheus_text():
    from kvbridge.serving.proxy.scrape import parse_samples

    def text(computed: float, seconds: float) -> str:
        return (
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n"
            "# TYPE vllm:prompt_tokens_by_source_total counter\n"
            f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}} {computed}\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 99.0\n'
            "# HELP vllm:request_prefill_time_seconds Prefill time.\n"
            "# TYPE vllm:request_prefill_time_seconds histogram\n"
            f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} 3.0\n'
            f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {seconds}\n'
            f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} 3.0\n'
        )

    for names in (None, SERIES):  # every series, and only those the costs read
        learner = CostLearner()
        learner.prefill_read("p", parse_samples(text(10, 0.5), names))
        learner.prefill_read("p", parse_samples(text(2010, 0.75), names))
        assert learner.costs.prefill_tokens_per_s == pytest.approx(8000)
    picked = parse_samples(text(10, 0.5), SERIES)
    assert sorted(name for name, _, _ in picked) == sorted([PREFILL_TIME, SOURCE, SOURCE])  # no bucket, no count


def test_a_fixed_threshold_wins_over_the_learned_one_and_the_initial_one_stands_in():
    r = router(disaggregation="selective", direct_initial_tokens=7)
    assert r.threshold(0) == 7
    r.learner.costs.prefill_tokens_per_s, r.learner.costs.transfer_s_per_token, r.learner.costs.hop_s = 1e4, 0, 0.01
    assert r.threshold(0) == pytest.approx(100)
    assert router(disaggregation="selective", direct_below_tokens=3).threshold(0) == 3


# --- over HTTP with fake backends -----------------------------------------------------------------------------

SELECTIVE = {"disaggregation": "selective", "direct_below_tokens": 8, "prefix_block_tokens": 4}
CACHE = {**SELECTIVE, "routing": "cache_aware"}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [[5, 6, 7], [8, 9]]},
        {"n": 2, "temperature": 0.8, "seed": 11, "stop": ["x"]},
        {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "temperature": 0.8, "stream": True},
    ],
    ids=["plain", "stream", "usage", "prompts", "n_seed_stop", "prompts_n_stream"],
)
def test_a_request_sent_straight_to_the_decode_is_the_same_request(extra, caplog):
    """Each sub-request below the threshold reaches the decode fake as the PD flow's decode leg would carry it,
    less kv_transfer_params: the same fields, so the same output; the reply equals the always-PD proxy's."""
    body = {**BODY, **extra}
    prefill, decode = FakeBackend("p"), FakeBackend("d")
    with running(prefill, decode) as (p, d):
        with proxy_for([p.url], [d.url], disaggregation="always") as (url, _):
            pd = httpx.post(url + "/v1/completions", json=body, timeout=10)
        pd_decode_bodies = [b for _, b in decode.requests]
        decode.requests.clear()
        with caplog.at_level(logging.INFO, "kvbridge.serving.proxy"), proxy_for([p.url], [d.url], **SELECTIVE) as pr:
            direct = httpx.post(pr[0] + "/v1/completions", json=body, timeout=10)
            scraped = httpx.get(pr[0] + "/metrics").text
    assert pd.status_code == direct.status_code == 200
    assert prefill.prefills == len(pd_decode_bodies)  # the PD run's prefills; none since
    expected = sorted(({k: v for k, v in b.items() if k != "kv_transfer_params"} for b in pd_decode_bodies), key=str)
    assert sorted((b for _, b in decode.requests), key=str) == expected
    strip = (lambda t: t.replace('"params_prompt": ', "").split('"request"')[0]) if body.get("stream") else None
    if strip is None:
        got, want = direct.json(), pd.json()
        for choice in [*got["choices"], *want["choices"]]:
            choice["for"] = {k: v for k, v in choice["for"].items() if k in ("prompt", "seed")}
        assert got == want
    else:
        assert direct.text.count("data: ") == pd.text.count("data: ")
    lines = [r.getMessage() for r in caplog.records if "path=direct" in r.getMessage()]
    assert len(lines) == len(expected) and all("reason=below_threshold" in line for line in lines)
    count = f'kvbridge_proxy_decisions_total{{path="direct",reason="below_threshold"}} {float(len(expected))}'
    assert count in scraped


def test_a_long_prompt_is_disaggregated_and_its_next_turn_goes_straight_to_the_same_decode():
    prefill = FakeBackend("p")
    decodes = [FakeBackend("d0"), FakeBackend("d1")]
    turn1 = {**BODY, "prompt": list(range(40))}
    turn2 = {**BODY, "prompt": list(range(44))}
    other = {**BODY, "prompt": [9] * 40}
    with running(prefill, *decodes) as (p, d0, d1), proxy_for([p.url], [d0.url, d1.url], **CACHE) as (url, _):
        for body in (turn1, other, turn2):
            assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        scraped = httpx.get(url + "/metrics").text
    assert prefill.prefills == 2  # turn 1 and the other conversation; turn 2 holds all but 4 tokens
    holder = next(d for d in decodes if any(prompt_key(b) == prompt_key(turn1) for _, b in d.requests))
    last = holder.requests[-1][1]
    assert prompt_key(last) == prompt_key(turn2) and "kv_transfer_params" not in last
    assert 'kvbridge_proxy_routed_total{backend="' in scraped and 'why="prefix"' in scraped
    assert 'kvbridge_proxy_decisions_total{path="disaggregated",reason="at_or_above_threshold"} 2.0' in scraped


def test_a_refused_direct_request_passes_the_error_through_and_releases_nothing():
    prefill, decode = FakeBackend("p"), FakeBackend("d", status=400)
    with running(prefill, decode) as (p, d), proxy_for([p.url], [d.url], **SELECTIVE) as (url, proxy):
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        scraped = httpx.get(url + "/metrics").text
    assert reply.status_code == 400 and "d says no" in reply.text
    assert prefill.requests == [] and "kvbridge_proxy_prefill_releases_total{" not in scraped
    assert [b.outstanding for b in proxy.balancer.backends()] == [0, 0]


def test_the_hop_is_the_disaggregated_paths_first_token_overhead_beyond_the_direct_ones():
    learner = CostLearner()
    learner.costs.prefill_tokens_per_s, learner.costs.transfer_s_per_token = 10000, 1e-5
    learner.prefill_leg(0.11, 1000)  # before any first token: the prefill leg's 10 ms beyond its compute
    assert learner.costs.hop_s == pytest.approx(0.01)
    learner.first_token("disaggregated", 0.2, 1000, 1000)  # 100 ms compute, 10 ms transfer: 90 ms overhead
    assert learner.costs.hop_s == pytest.approx(0.09)  # no direct request seen yet
    learner.first_token("direct", 0.015, 100, 100)  # 10 ms of compute: 5 ms overhead
    assert learner.overhead_s == pytest.approx({"direct": 0.005, "disaggregated": 0.09})
    assert learner.costs.hop_s == pytest.approx(0.085)
    learner.prefill_leg(0.11, 1000)  # once a disaggregated first token was seen, first tokens say what it costs
    assert learner.costs.hop_s == pytest.approx(0.085)


@pytest.mark.parametrize("status", [200, 400])
def test_the_queues_empty_whatever_ends_a_request(status):
    """Direct and disaggregated, streamed or not, one prompt or several, answered or refused by the decode: once
    every request has ended, no instance has tokens left in the router's queues."""
    prefill, decode = FakeBackend("p"), FakeBackend("d", status=status)
    bodies = [
        {**BODY, "prompt": prompt, **extra}
        for prompt in ([5, 6, 7], list(range(40)), [[5, 6, 7], list(range(40))])
        for extra in ({}, {"stream": True})
    ]
    with running(prefill, decode) as (p, d), proxy_for([p.url], [d.url], **SELECTIVE) as (url, proxy):
        replies = [httpx.post(url + "/v1/completions", json=body, timeout=10) for body in bodies]
        wait_for(lambda: set(proxy.router.queued.values()) == {0})  # the reply goes out before the proxy settles
    assert {r.status_code for r in replies} == {status}
    assert prefill.prefills > 0 and len(proxy.router.queued) == 2


def test_streamed_first_tokens_teach_the_router_by_path():
    prefill, decode = FakeBackend("p"), FakeBackend("d")
    with running(prefill, decode) as (p, d), proxy_for([p.url], [d.url], **SELECTIVE) as (url, proxy):
        proxy.router.learner.costs.prefill_tokens_per_s = 1e6
        for prompt in ([5, 6, 7], list(range(40))):  # direct, then disaggregated
            body = {**BODY, "prompt": prompt, "stream": True}
            assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        overhead = proxy.router.learner.overhead_s
    assert overhead["direct"] is not None and overhead["disaggregated"] is not None
    assert proxy.router.learner.costs.hop_s == pytest.approx(max(0.0, overhead["disaggregated"] - overhead["direct"]))
