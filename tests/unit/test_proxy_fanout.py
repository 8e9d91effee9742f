"""The proxy's PD flow for every shape of request: a list of prompts and `n` become one prefill and one decode leg
per choice, each decode leg carrying its own prefill's kv_transfer_params, and the replies (JSON or SSE) are put
back together in OpenAI's order. Invalid bodies are refused before any leg.

Pure tests of the planning and the reassembly first, then the proxy over HTTP against the fakes of test_proxy.py.
Each reassembly check is also run on a reply put together the naive way (no index rewriting, every leg with the
first prompt's params) and must fail there: the negative controls.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from kvbridge.serving.proxy import InvalidRequest, add_arguments, config_from_args, plan, prefill_body
from kvbridge.serving.proxy.reassembly import StreamMerger, merge_replies
from support.proxy import BODY, FakeBackend, prompt_key, proxy_for, running

LIMITS = {"max_prompts": 64, "max_n": 16}


def split(body: dict[str, Any], chat: bool = False):
    return plan(body, chat, **LIMITS)


# --- planning (pure) --------------------------------------------------------------------------------------


def test_prompts_and_children_become_sub_requests_in_openai_order():
    p = split({"model": "m", "prompt": ["a", "b", "c"], "n": 2, "seed": 7, "max_tokens": 3})
    assert [(s.index, s.prompt, s.child) for s in p.subs] == [(i * 2 + j, i, j) for i in range(3) for j in range(2)]
    assert [s.body["prompt"] for s in p.subs] == ["a", "a", "b", "b", "c", "c"]
    assert [s.body["seed"] for s in p.subs] == [7, 8] * 3  # child j samples with seed + j, as vLLM's n does
    assert all("n" not in s.body and s.body["max_tokens"] == 3 for s in p.subs)
    assert (p.n, p.num_prompts, p.stream, p.direct) == (2, 3, False, False)


def test_a_list_of_token_ids_is_one_prompt_and_a_list_of_lists_is_several():
    assert [s.body["prompt"] for s in split({"prompt": [1, 2, 3]}).subs] == [[1, 2, 3]]
    assert [s.body["prompt"] for s in split({"prompt": [[1, 2], [3]]}).subs] == [[1, 2], [3]]
    assert [s.body["prompt"] for s in split({"prompt": "hello"}).subs] == ["hello"]


def test_chat_n_splits_into_children_without_a_seed_when_none_was_given():
    messages = [{"role": "user", "content": "hi"}]
    p = split({"messages": messages, "n": 3, "best_of": 3}, chat=True)
    assert [s.index for s in p.subs] == [0, 1, 2]
    assert all(s.body == {"messages": messages} for s in p.subs)  # best_of == n is n; no seed invented


def test_client_kv_transfer_params_are_never_forwarded():
    body = {"prompt": "x", "kv_transfer_params": {"remote_host": "10.9.9.9"}}
    body["vllm_xargs"] = {"kv_transfer_params": {"remote_host": "10.9.9.9"}, "other": 1}
    (sub,) = split(body).subs
    assert "kv_transfer_params" not in sub.body and sub.body["vllm_xargs"] == {"other": 1}
    assert prefill_body(sub.body, chat=False)["kv_transfer_params"] == {"do_remote_decode": True}


def test_prefill_leg_drops_what_it_cannot_take_and_keeps_what_the_prefill_should_check():
    body = {"prompt": "x", "echo": True, "min_tokens": 5, "max_tokens": 9, "stop": ["."]}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "n": 2, "best_of": 2, "seed": 1}
    sub = split(body).subs[1]
    leg = prefill_body(sub.body, chat=False)
    assert leg == {
        "prompt": "x",
        "max_tokens": 1,
        "stop": ["."],
        "stream": False,
        "seed": 2,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert sub.body["echo"] is True and sub.body["min_tokens"] == 5 and sub.body["stream_options"]  # decode: all
    # logprobs stay: the prefill server then checks them (max_logprobs), and one token's worth is cheap
    (sub,) = split({"prompt": "x", "logprobs": 2}).subs
    assert prefill_body(sub.body, chat=False)["logprobs"] == 2
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}
    (sub,) = split(chat, chat=True).subs
    assert prefill_body(sub.body, chat=True) | {"max_tokens": 0} == {
        **chat,
        "max_tokens": 0,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }


@pytest.mark.parametrize(
    ("body", "chat", "direct"),
    [
        ({"prompt": "x", "echo": True, "logprobs": 1}, False, True),
        ({"prompt": "x", "prompt_logprobs": 0}, False, True),
        ({"prompt": "x", "echo": True}, False, False),  # echo alone: vLLM computes no prompt logprobs
        ({"prompt": "x", "logprobs": 3}, False, False),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, True, True),  # top_logprobs defaults to 0
        ({"messages": [{"role": "user", "content": "x"}], "echo": True, "top_logprobs": None}, True, False),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, True, False),
    ],
)
def test_requests_computing_prompt_logprobs_skip_the_prefill(body, chat, direct):
    """vLLM does not read external KV for them (skip_reading_prefix_cache): a prefill would pin KV for nothing."""
    p = split({**body, "kv_transfer_params": {"x": 1}}, chat)
    assert p.direct is direct
    if direct:
        assert p.subs[0].body == body  # the whole request, less the client's params, to a decode server


INVALID = [
    ({}, False, "prompt"),
    ({"prompt": None}, False, "prompt"),
    ({"prompt": 5}, False, "prompt"),
    ({"prompt": []}, False, "prompt"),
    ({"prompt": [1, "a"]}, False, "prompt"),
    ({"prompt": [1, True]}, False, "prompt"),
    ({"prompt": [-1]}, False, "prompt"),
    ({"prompt": [[1], []]}, False, "prompt"),
    ({"prompt": [[1], [2, -3]]}, False, "prompt"),
    ({"prompt": ["x"] * 65}, False, "prompt"),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, False, "prompt_embeds"),
    ({"prompt": "x", "n": 0}, False, "n"),
    ({"prompt": "x", "n": 17}, False, "n"),
    ({"prompt": "x", "n": "2"}, False, "n"),
    ({"prompt": "x", "n": True}, False, "n"),
    ({"prompt": "x", "n": None}, False, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, False, "n"),  # vLLM: n must be 1 with greedy sampling
    ({"messages": [{"role": "user", "content": "x"}], "n": 2, "temperature": 0.0}, True, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, False, "best_of"),
    ({"prompt": "x", "best_of": 2}, False, "best_of"),
    ({"prompt": "x", "best_of": 0}, False, "best_of"),
    ({"prompt": "x", "use_beam_search": True}, False, "use_beam_search"),
    ({"prompt": "x", "seed": "1"}, False, "seed"),
    ({"prompt": "x", "seed": 2**63}, False, "seed"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, False, "seed"),
    ({"prompt": "x", "stream": "yes"}, False, "stream"),
    ({"prompt": "x", "echo": "true"}, False, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, False, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": []}, False, "stream_options"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": "8"}, False, "max_tokens"),
    ({"prompt": "x", "min_tokens": 17}, False, "min_tokens"),  # max_tokens defaults to 16
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 5}, False, "min_tokens"),
    ({"prompt": "x", "min_tokens": None}, False, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, False, "min_tokens"),
    ({}, True, "messages"),
    ({"messages": []}, True, "messages"),
    ({"messages": "hi"}, True, "messages"),
    ({"messages": ["hi"]}, True, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, True, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, True, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "min_tokens": 3}, True, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 17}, True, "n"),
]

VALID = [
    ({"prompt": "x", "n": 16, "seed": 2**63 - 16}, False),
    ({"prompt": "x", "n": 2, "temperature": 1.0, "top_k": 1}, False),  # greedy in effect, and vLLM takes it
    ({"prompt": "x", "n": 1, "temperature": 0.0}, False),
    ({"prompt": ["x"] * 64}, False),
    ({"prompt": "x", "n": 2, "best_of": 2}, False),
    ({"prompt": "x", "best_of": 1}, False),
    ({"prompt": "x", "max_tokens": 0, "echo": True}, False),
    ({"prompt": "x", "min_tokens": 16}, False),
    ({"prompt": "x", "max_tokens": None, "stream": None, "seed": None}, False),
    (
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
        False,
    ),
    ({"prompt": "x", "stream_options": None}, False),
    ({"prompt": "x", "seed": -(2**63)}, False),
    ({"messages": [{"role": "user", "content": "x"}], "n": None, "min_tokens": 1000}, True),  # limit: the context
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 2}, True),
]


@pytest.mark.parametrize(("body", "chat", "param"), INVALID)
def test_invalid_bodies_are_refused_naming_the_field(body, chat, param):
    with pytest.raises(InvalidRequest) as info:
        split(body, chat)
    assert info.value.param == param and info.value.status == 400
    error = json.loads(info.value.body())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(("body", "chat"), VALID)
def test_bodies_at_the_edges_are_accepted(body, chat):
    """Negative control for the table above: the same fields at their allowed edges pass."""
    assert split(body, chat).subs


def test_fan_out_bounds_come_from_the_config_and_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "http://p", "--decode", "http://d", "--max-prompts-per-request", "2"])
    config = config_from_args(parser.parse_args([*_argv(args), "--max-n", "3"]))
    assert (config.max_prompts_per_request, config.max_n) == (2, 3)
    with pytest.raises(InvalidRequest, match="3 prompts, at most 2"):
        plan({"prompt": ["a", "b", "c"]}, False, config.max_prompts_per_request, config.max_n)
    with pytest.raises(InvalidRequest, match="at most 3"):
        plan({"prompt": "a", "n": 4}, False, config.max_prompts_per_request, config.max_n)


def _argv(args: Any) -> list[str]:
    return ["--prefill", args.prefill[0], "--decode", args.decode[0], "--max-prompts-per-request", "2"]


# --- reassembly (pure) ------------------------------------------------------------------------------------


def sub_reply(prompt: str, child: int, prompt_tokens: int) -> dict[str, Any]:
    """What a decode server answers one sub-request with: one choice, at index 0."""
    choice = {"index": 0, "text": f"{prompt}/{child}", "finish_reason": "length"}
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}
    usage["prompt_tokens_details"] = {"cached_tokens": 1}
    return {"id": "cmpl-r", "object": "text_completion", "model": "m", "choices": [choice], "usage": usage}


def assert_openai_order(choices: list[dict[str, Any]], prompts: list[str], n: int) -> None:
    assert [c["index"] for c in choices] == list(range(len(prompts) * n))
    assert [c["text"] for c in choices] == [f"{p}/{j}" for p in prompts for j in range(n)]


def test_json_replies_are_merged_with_indexes_rewritten_and_usage_summed():
    prompts = ["a", "b"]
    p = split({"prompt": prompts, "n": 2})
    replies = [sub_reply(prompts[s.prompt], s.child, 10 * (s.prompt + 1)) for s in p.subs]
    merged = merge_replies(p, replies)
    assert_openai_order(merged["choices"], prompts, 2)
    # prompt tokens once per prompt (10 + 20), completion tokens over all four choices
    assert merged["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 12,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert merged["id"] == "cmpl-r" and merged["object"] == "text_completion"
    naive = [c for r in replies for c in r["choices"]]  # negative control: indexes not rewritten
    with pytest.raises(AssertionError):
        assert_openai_order(naive, prompts, 2)


def test_a_sub_reply_without_exactly_one_choice_is_a_bad_reply():
    from kvbridge.serving.proxy.reassembly import BadReply

    p = split({"prompt": "a", "n": 2})
    with pytest.raises(BadReply, match="exactly one choice"):
        merge_replies(p, [sub_reply("a", 0, 1), {"choices": []}])


def sse(chunk: dict[str, Any] | str) -> bytes:
    return b"data: " + (chunk.encode() if isinstance(chunk, str) else json.dumps(chunk).encode()) + b"\n\n"


def sub_stream(prompt: str, child: int, usage: bool) -> bytes:
    out = b"".join(sse({"id": "c", "choices": [{"index": 0, "text": f"{prompt}{child}{t}"}]}) for t in "xyz")
    if usage:
        out += sse({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
    return out + sse("[DONE]")


def parse_sse(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def check_merged_stream(events: list[Any], prompts: list[str], n: int, usage: dict[str, int] | None) -> None:
    """One `[DONE]`, last; every choice's text at its own index; one summed usage chunk (when asked for)."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    if usage is not None:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
        chunks = chunks[:-1]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    expected = {i * n + j: "".join(f"{p}{j}{t}" for t in "xyz") for i, p in enumerate(prompts) for j in range(n)}
    assert texts == expected


def test_sub_streams_are_merged_whatever_the_chunk_boundaries():
    prompts, n = ["a", "b"], 2
    p = split({"prompt": prompts, "n": n, "stream": True, "stream_options": {"include_usage": True}})
    streams = [bytearray(sub_stream(prompts[s.prompt], s.child, usage=True)) for s in p.subs]
    rng = random.Random(3)
    merger, out = StreamMerger(p), bytearray()
    while any(streams):  # interleave the sub-streams, cut at arbitrary bytes
        k = rng.choice([i for i, s in enumerate(streams) if s])
        cut = rng.randint(1, 40)
        piece, streams[k][:cut] = bytes(streams[k][:cut]), b""
        out += merger.feed(k, piece)
        if not streams[k]:
            out += merger.end(k)
    out += merger.finish()
    assert not merger.failed
    check_merged_stream(
        parse_sse(bytes(out)), prompts, n, {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
    )
    naive = b"".join(sub_stream(prompts[s.prompt], s.child, usage=True) for s in p.subs)  # negative control
    with pytest.raises(AssertionError):
        check_merged_stream(parse_sse(naive), prompts, n, None)


def test_an_error_event_in_a_sub_stream_marks_the_merge_failed():
    p = split({"prompt": ["a", "b"], "stream": True})
    merger = StreamMerger(p)
    assert b'"index": 1' not in merger.feed(1, sse({"choices": [{"index": 0, "text": "t"}]}))
    out = merger.feed(0, sse({"error": {"message": "boom", "code": 500}}))
    assert merger.failed and json.loads(out[6:])["error"]["message"] == "boom"
    garbage = StreamMerger(p)
    assert b"not a JSON object" in garbage.feed(0, b"data: {nope\n\n") and garbage.failed


# --- over HTTP --------------------------------------------------------------------------------------------


def assert_own_params(decode_requests: list[dict[str, Any]]) -> None:
    """Every decode leg carries the params of the prefill of its own prompt, and no two share a prefill."""
    for body in decode_requests:
        assert body["kv_transfer_params"]["prompt_key"] == prompt_key(body), body
    requests = [b["kv_transfer_params"]["remote_request_id"] for b in decode_requests]
    assert len(set(requests)) == len(requests), requests


def decodes(backend: FakeBackend) -> list[dict[str, Any]]:
    return [b for _, b in backend.requests if "do_remote_decode" not in b["kv_transfer_params"]]


def test_a_list_of_prompts_gets_one_prefill_per_prompt_and_choices_in_order():
    prompts = [[1, 2], [3, 4, 5], [6]]
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompts}, timeout=10)
        assert reply.status_code == 200, reply.text
        doc = reply.json()
    assert sorted(prompt_key(b) for _, b in p.requests) == sorted(json.dumps(x) for x in prompts)
    assert all(b["max_tokens"] == 1 and "n" not in b for _, b in p.requests)
    assert_own_params(decodes(d))
    served = [c["for"] for c in doc["choices"]]
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert [f["prompt"] for f in served] == [json.dumps(x) for x in prompts]
    assert all(f["params_prompt"] == f["prompt"] for f in served)
    prompt_tokens = sum(len(json.dumps(x)) for x in prompts)
    assert doc["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 9, "total_tokens": prompt_tokens + 9}
    # negative control: what the proxy used to send (every decode leg with prompt 0's params) fails the check
    same = [{**b, "kv_transfer_params": decodes(d)[0]["kv_transfer_params"]} for b in decodes(d)]
    with pytest.raises(AssertionError):
        assert_own_params(same)


def test_n_children_each_get_a_prefill_and_seed_plus_j():
    p, d = FakeBackend("p"), FakeBackend("d")
    body = {"model": "m", "prompt": "hi", "n": 3, "seed": 5, "max_tokens": 4}
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        doc = httpx.post(url + "/v1/completions", json=body, timeout=10).json()
    assert len(p.requests) == 3 and all(b["seed"] in (5, 6, 7) for _, b in p.requests)
    assert_own_params(decodes(d))
    assert [(c["index"], c["for"]["seed"]) for c in doc["choices"]] == [(0, 5), (1, 6), (2, 7)]
    assert doc["usage"]["prompt_tokens"] == len(json.dumps("hi"))  # one prompt, counted once


def test_streamed_list_and_n_are_merged_into_one_stream():
    prompts, n = ["a", "b"], 2
    p, d = FakeBackend("p"), FakeBackend("d", tokens=("x", "y", "z"), chunk_delay=0.01)
    body = {"model": "m", "prompt": prompts, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    with (
        running(p, d) as (ps, ds),
        proxy_for([ps.url], [ds.url]) as (url, _),
        httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as reply,
    ):
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(b"".join(reply.iter_raw()))
    assert_own_params(decodes(d))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    by_index: dict[int, list[dict]] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, choices in by_index.items():
        assert "".join(c["text"] for c in choices) == "xyz"
        assert {c["for"]["prompt"] for c in choices} == {json.dumps(prompts[index // n])}
    prompt_tokens = sum(len(json.dumps(x)) for x in prompts)
    assert events[-2] == {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                          "completion_tokens": 12, "total_tokens": prompt_tokens + 12}}  # fmt: skip


def test_chat_with_n_is_split_and_merged():
    p, d = FakeBackend("p"), FakeBackend("d")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_completion_tokens": 5}
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        doc = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()
    assert [path for path, _ in p.requests] == ["/v1/chat/completions"] * 2
    assert all(b["max_completion_tokens"] == 1 for _, b in p.requests)
    assert all(b["max_completion_tokens"] == 5 for b in decodes(d))
    assert_own_params(decodes(d))
    assert [c["index"] for c in doc["choices"]] == [0, 1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**BODY, "best_of": 3}, "best_of"),
        ({**BODY, "n": 100}, "n"),
        ({**BODY, "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({**BODY, "prompt": [[1], []]}, "prompt"),
        ({**BODY, "max_tokens": "4"}, "max_tokens"),
    ],
)
def test_invalid_bodies_never_reach_a_backend(body, param):
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=10)
        metrics = httpx.get(url + "/metrics", timeout=5).text
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert p.requests == [] and d.requests == []
    assert 'kvbridge_proxy_rejected_total{reason="invalid"} 1.0' in metrics


def test_prompt_logprobs_go_to_the_decode_server_alone():
    p, d = FakeBackend("p"), FakeBackend("d")
    body = {**BODY, "prompt": [[1, 2], [3]], "echo": True, "logprobs": 1, "kv_transfer_params": {"a": 1}}
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
    assert p.requests == []
    ((_, decode),) = d.requests
    assert decode == {k: v for k, v in body.items() if k != "kv_transfer_params"}


def test_one_failing_sub_request_fails_the_request_with_its_error():
    p, d = FakeBackend("p"), FakeBackend("d", status=400, fail_prompts=(json.dumps("b"),))
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]}, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["message"] == "d says no"
        stream = {**BODY, "prompt": ["a", "b", "c"], "stream": True}
        reply = httpx.post(url + "/v1/completions", json=stream, timeout=10)
        assert reply.status_code == 400, reply.text  # before every sub-stream began: a proper HTTP error


def test_prompts_times_choices_are_bounded_together():
    """Amplification: unbounded, 64 prompts x n=16 make 1,024 prefill legs from one 510-byte body.
    Prompts x choices may not exceed the larger of the two limits."""
    limits = {"max_prompts": 64, "max_n": 16}
    body = {"model": "m", "max_tokens": 4, "temperature": 1.0, "prompt": [[1, 2]] * 8, "n": 8}
    assert len(plan(body, False, **limits).subs) == 64
    with pytest.raises(InvalidRequest) as info:
        plan({**body, "n": 9}, False, **limits)
    assert info.value.param == "n" and info.value.status == 400
