"""The official `openai` Python client against `kvbridge proxy` in front of real vLLM prefill and decode servers.

The tiny model gets its byte-level BPE tokenizer (tiny_model.write_tokenizer), so vLLM serves text prompts and
chat without `--skip-tokenizer-init`. The prefill server is kv_both, so it is also the aggregated (non-PD)
reference: every answer through the proxy must equal its answer to the same request (greedy, and seeded sampling
for n=2, where child j samples with seed + j as vLLM's own n does). Each test also checks that the decode
server's `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` grew by at least the prompt tokens
it served: the KV moved, it was not recomputed (the decode server runs kv_load_failure_policy=recompute, so that
an n=2 request sent straight to it with one prefill's params is answered: its second child's params are refused as
a replay and it prefills itself; that test checks the KV moved exactly once). Two tests check, with real prefill
workers, that no prefill KV stays held when a decode leg fails or never happens (the proxy's release, acknowledged
by the worker).

Prompts are distinct across tests (seeded word salad of the corpus' words), so no test is helped by another's
prefix cache on the decode server. Heavy (marked vllm): two vLLM servers, shared by the tests of this module;
run them under the machine's vLLM lock. The tokenizer test needs no server.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model
from support.proxy import dead_url, proxy_process

needs_servers = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed"),
]


def heavy(test: Any) -> Any:
    for mark in needs_servers:
        test = mark(test)
    return test


MAX_TOKENS = 8


class TextServer(VllmServer):
    """A VllmServer that serves the model's tokenizer (the launcher always passes `--skip-tokenizer-init`)."""

    def command(self) -> list[str]:
        return [arg for arg in super().command() if arg != "--skip-tokenizer-init"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import openai

    tmp = tmp_path_factory.mktemp("openai")
    model = build_tiny_model(tmp / "model", tokenizer=True)
    base = free_base_port(2)
    prefill = TextServer(
        model,
        port=free_port(),
        cpu_bind="0",
        kv_transfer_config=kvbridge_config("kv_both", side_channel_port=base, lease_s=30),
        name="openai-prefill",
        log_path=tmp / "prefill.log",
    )
    decode = TextServer(
        model,
        port=free_port(),
        cpu_bind="1",
        # recompute: params refused before any load (a replay, as the second child of an n=2 sent straight here)
        # are prefilled locally; the tests' KV-moved checks still catch a load that silently fell back
        kv_transfer_config=kvbridge_config("kv_consumer", "recompute", side_channel_port=base + 1, lease_s=30),
        name="openai-decode",
        log_path=tmp / "decode.log",
    )
    with running((prefill, decode), timeout=600):
        cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill.url, "--decode", decode.url]
        with proxy_process([*cmd, "--port", "0", "--log-level", "warning", "--prefill-timeout", "120"]) as url:
            yield {
                "model": str(model),
                "pd": openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180),
                "ref": openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0, timeout=180),
                "decode_url": decode.url,
                "url": url,
                "prefill": prefill,
            }


def test_the_tokenizer_is_deterministic_fills_the_vocab_and_leaves_the_weights_alone(tmp_path):
    """Light (no server): two builds give the same tokenizer.json; the weights equal a token-id build's."""
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from kvbridge.serving.tiny_model import SPECIAL_TOKENS, write_tokenizer

    with_tok = build_tiny_model(tmp_path / "a", num_layers=1, tokenizer=True)
    plain = build_tiny_model(tmp_path / "b", num_layers=1)
    assert not (plain / "tokenizer.json").exists()
    a, b = load_file(with_tok / "model.safetensors"), load_file(plain / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    again = write_tokenizer(tmp_path / "c", 1024)
    assert (again / "tokenizer.json").read_bytes() == (with_tok / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(with_tok)
    assert len(tok) == 1024 and tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"
    ids = tok("The prefill computes the cache.")["input_ids"]
    assert tok.decode(ids) == "The prefill computes the cache." and max(ids) < 1024
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


WORDS = (
    *("cache", "block", "prefill", "decode", "layer", "head", "token", "stage", "rank", "engine", "worker"),
    *("lease", "request", "prompt", "answer", "river", "mountain", "weather", "recipe", "library", "science"),
    *("travel", "harbour", "robot", "letter", "morning", "evening", "golden", "window"),
)


def text(seed: int, words: int = 60) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def external_tokens(url: str) -> float:
    return metric_sum(metrics(url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def assert_kv_moved(url: str, before: float, at_least: int) -> None:
    deadline = time.monotonic() + 10
    while external_tokens(url) - before < at_least:
        assert time.monotonic() < deadline, f"decode loaded {external_tokens(url) - before} tokens, not {at_least}"
        time.sleep(0.2)


def texts(choices: list[Any]) -> list[str]:
    assert [c.index for c in choices] == list(range(len(choices)))
    return [c.text for c in choices]


def streamed_texts(stream: Any) -> tuple[list[str], Any]:
    """The text of each choice of a completions stream, by index, and the usage chunk's usage."""
    parts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert sorted(parts) == list(range(len(parts)))
    return [parts[i] for i in sorted(parts)], usage


@heavy
def test_completions_with_a_text_prompt(stack):
    pd, ref, model, decode = stack["pd"], stack["ref"], stack["model"], stack["decode_url"]
    args = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    before = external_tokens(decode)
    got = pd.completions.create(prompt=text(1), **args)
    expected = ref.completions.create(prompt=text(1), **args)
    assert texts(got.choices) == texts(expected.choices) and got.choices[0].text
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens > 16
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)
    before = external_tokens(decode)
    streamed, usage = streamed_texts(
        pd.completions.create(prompt=text(2), stream=True, stream_options={"include_usage": True}, **args)
    )
    expected = ref.completions.create(prompt=text(2), **args)
    assert streamed == texts(expected.choices)
    assert usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage.completion_tokens == expected.usage.completion_tokens
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)


@heavy
def test_completions_with_a_list_of_prompts(stack):
    pd, ref, model, decode = stack["pd"], stack["ref"], stack["model"], stack["decode_url"]
    args = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    prompts = [text(10), text(11, 40), text(12, 80)]
    before = external_tokens(decode)
    got = pd.completions.create(prompt=prompts, **args)
    expected = ref.completions.create(prompt=prompts, **args)
    assert texts(got.choices) == texts(expected.choices)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)
    prompts = [text(13), text(14, 50)]
    before = external_tokens(decode)
    streamed, usage = streamed_texts(
        pd.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **args)
    )
    expected = ref.completions.create(prompt=prompts, **args)
    assert streamed == texts(expected.choices)
    assert usage.prompt_tokens == expected.usage.prompt_tokens
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)


@heavy
def test_completions_with_n_2(stack):
    """Greedy n=2 as vLLM serves it (temperature 1 with top_k 1: vLLM refuses n > 1 at temperature 0, and so does
    the proxy), then seeded sampling, where child j samples with seed + j as in vLLM's own n."""
    import openai

    pd, ref, model, decode = stack["pd"], stack["ref"], stack["model"], stack["decode_url"]
    greedy = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 1.0, "n": 2, "extra_body": {"top_k": 1}}
    before = external_tokens(decode)
    got = pd.completions.create(prompt=text(20), **greedy)
    expected = ref.completions.create(prompt=text(20), **greedy)
    assert texts(got.choices) == texts(expected.choices) and got.choices[0].text == got.choices[1].text
    one = ref.completions.create(prompt=text(20), model=model, max_tokens=MAX_TOKENS, temperature=0.0)
    assert got.choices[0].text == one.choices[0].text  # top_k 1 is greedy
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens  # the prompt counted once
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)
    sampled = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 1.0, "n": 2, "seed": 1234}
    got = pd.completions.create(prompt=text(21), **sampled)
    expected = ref.completions.create(prompt=text(21), **sampled)
    assert texts(got.choices) == texts(expected.choices)
    assert got.choices[0].text != got.choices[1].text  # and the children really differ
    for client in (pd, ref):  # the same refusal from both
        with pytest.raises(openai.BadRequestError, match="n must be 1") as info:
            client.completions.create(prompt=text(22), model=model, max_tokens=4, temperature=0.0, n=2)
        assert info.value.status_code == 400


def chat_texts(choices: list[Any]) -> list[str]:
    assert [c.index for c in choices] == list(range(len(choices)))
    return [c.message.content for c in choices]


@heavy
def test_chat_completions(stack):
    pd, ref, model, decode = stack["pd"], stack["ref"], stack["model"], stack["decode_url"]
    args = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}

    def messages(seed: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": text(seed, 30)}, {"role": "user", "content": text(seed + 1, 30)}]

    before = external_tokens(decode)
    got = pd.chat.completions.create(messages=messages(30), **args)
    expected = ref.chat.completions.create(messages=messages(30), **args)
    assert chat_texts(got.choices) == chat_texts(expected.choices)
    assert got.choices[0].message.role == "assistant"
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)

    before = external_tokens(decode)
    parts: dict[int, str] = {}
    for chunk in pd.chat.completions.create(messages=messages(40), stream=True, **args):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
    expected = ref.chat.completions.create(messages=messages(40), **args)
    assert [parts[i] for i in sorted(parts)] == chat_texts(expected.choices)
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)

    before = external_tokens(decode)
    greedy_n = {**args, "temperature": 1.0, "n": 2, "extra_body": {"top_k": 1}}
    got = pd.chat.completions.create(messages=messages(50), **greedy_n)
    expected = ref.chat.completions.create(messages=messages(50), **greedy_n)
    assert chat_texts(got.choices) == chat_texts(expected.choices)
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)


@heavy
def test_errors_come_back_as_openai_errors(stack):
    import openai

    pd, model = stack["pd"], stack["model"]
    with pytest.raises(openai.BadRequestError) as info:
        pd.completions.create(model=model, prompt="x", max_tokens=4, n=2, extra_body={"best_of": 3})
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as info:  # vLLM itself refuses it, on the prefill leg
        pd.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1.0)
    assert info.value.status_code == 400


def releases(url: str) -> dict[str, float]:
    out = {}
    for series, value in metrics(url).items():
        if series.startswith("kvbridge_proxy_prefill_releases_total"):
            out[series.split('outcome="')[1].split('"')[0]] = value
    return out


def wait_usage_back(prefill: VllmServer, baseline: float, t0: float) -> None:
    while prefill.kv_usage() > baseline:
        assert time.monotonic() - t0 < 10, f"prefill KV usage {prefill.kv_usage()} stays above {baseline}"
        time.sleep(0.2)


@heavy
def test_a_decode_leg_that_never_happens_releases_the_prefill_kv_at_once(stack):
    """A second proxy whose decode backend is down: the prefill leg holds the prompt's blocks, the decode leg
    cannot connect (502), and the proxy's Abort must free the blocks (a real prefill worker acknowledges it)
    well before the 30 s lease would."""
    model, prefill = stack["model"], stack["prefill"]
    cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill.url, "--decode", dead_url()]
    with proxy_process([*cmd, "--port", "0", "--log-level", "warning", "--connect-retries", "0"]) as url:
        baseline = prefill.kv_usage()
        body = {"model": model, "prompt": text(70, 200), "max_tokens": 4}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 502 and reply.json()["error"]["backend"] == "decode-0"
        t0 = time.monotonic()
        while releases(url).get("released", 0) < 1:
            assert time.monotonic() - t0 < 10, f"the proxy did not release the prefill: {releases(url)}"
            time.sleep(0.2)
        wait_usage_back(prefill, baseline, t0)


@heavy
def test_a_decode_refusal_leaves_no_prefill_kv_held(stack):
    """`max_tokens` beyond the context (4096) passes the prefill leg (max_tokens=1) and is refused by the decode
    server, which the proxy cannot foresee (it does not tokenize). The blocks must not stay held: the proxy sends
    its release (the decode server's connector may have freed them first: then no worker takes it)."""
    import openai

    pd, model, prefill, url = stack["pd"], stack["model"], stack["prefill"], stack["url"]
    baseline = prefill.kv_usage()
    before = sum(releases(url).values())
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        pd.completions.create(model=model, prompt=text(60, 200), max_tokens=5000)
    t0 = time.monotonic()
    while sum(releases(url).values()) < before + 1:
        assert time.monotonic() - t0 < 10, f"the proxy sent no release: {releases(url)}"
        time.sleep(0.2)
    assert releases(url).get("error", 0) == 0
    wait_usage_back(prefill, baseline, t0)


def rejected(url: str, reason: str) -> float:
    return metric_sum(metrics(url), "vllm:kvbridge_rejected_params_total", reason=reason)


@heavy
def test_n_2_sent_straight_to_a_decode_server_loads_the_kv_once(stack):
    """One prefill's params on an n=2 request sent to the decode server itself (no proxy): vLLM gives both
    children the same params. The first child loads them; the second is refused as a replay (the params name a
    request another child read) and computes its own prompt. Both choices equal the aggregated answer."""
    model, prefill, decode = stack["model"], stack["prefill"], stack["decode_url"]
    prompt = text(80)
    one = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    first = httpx.post(prefill.url + "/v1/completions", json=one, timeout=120).json()
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, first
    greedy = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "n": 2, "top_k": 1}
    expected = stack["ref"].completions.create(
        prompt=prompt, model=model, max_tokens=MAX_TOKENS, temperature=1.0, n=2, extra_body={"top_k": 1}
    )
    before, replayed = external_tokens(decode), rejected(decode, "replayed")
    reply = httpx.post(decode + "/v1/completions", json={**greedy, "kv_transfer_params": params}, timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == texts(expected.choices)
    prompt_tokens = expected.usage.prompt_tokens
    assert_kv_moved(decode, before, prompt_tokens)
    deadline = time.monotonic() + 10
    while rejected(decode, "replayed") < replayed + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # metrics of both children are in
    assert rejected(decode, "replayed") == replayed + 1
    assert external_tokens(decode) - before == prompt_tokens, "the prompt's KV must move once, not per child"


def logprob_rows(choice: Any) -> tuple[list[str], list[float], list[dict[str, float]]]:
    lp = choice.logprobs
    return list(lp.tokens), list(lp.token_logprobs), [dict(d) for d in lp.top_logprobs]


@heavy
def test_echo_logprobs_and_min_tokens_through_the_proxy_equal_the_aggregated_server(stack):
    """The fields the PD split changes: `echo` (the prefill leg drops it, the decode server
    prepends the prompt), `logprobs` (computed by the decode server on the loaded KV: token ids equal, values
    within 1e-4) and `min_tokens` (dropped from the prefill leg of max_tokens=1). Each on the PD path: the KV moved."""
    pd, ref, model, decode = stack["pd"], stack["ref"], stack["model"], stack["decode_url"]
    args = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}

    before = external_tokens(decode)
    got = pd.completions.create(prompt=text(90), echo=True, **args)
    expected = ref.completions.create(prompt=text(90), echo=True, **args)
    assert texts(got.choices) == texts(expected.choices) and got.choices[0].text.startswith(text(90))
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)

    before = external_tokens(decode)
    ids = {"return_tokens_as_token_ids": True}
    got = pd.completions.create(prompt=text(91), logprobs=3, extra_body=ids, **args)
    expected = ref.completions.create(prompt=text(91), logprobs=3, extra_body=ids, **args)
    assert texts(got.choices) == texts(expected.choices)
    tokens, values, tops = logprob_rows(got.choices[0])
    want_tokens, want_values, want_tops = logprob_rows(expected.choices[0])
    assert tokens == want_tokens and all(t.startswith("token_id:") for t in tokens)
    assert values == pytest.approx(want_values, abs=1e-4)
    assert [sorted(t) for t in tops] == [sorted(t) for t in want_tops]
    for top, want in zip(tops, want_tops, strict=True):
        assert [top[k] for k in sorted(top)] == pytest.approx([want[k] for k in sorted(want)], abs=1e-4)
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)

    before = external_tokens(decode)
    extra = {"min_tokens": MAX_TOKENS, "ignore_eos": False}
    got = pd.completions.create(prompt=text(92), extra_body=extra, **args)
    expected = ref.completions.create(prompt=text(92), extra_body=extra, **args)
    assert texts(got.choices) == texts(expected.choices)
    assert got.usage.completion_tokens == expected.usage.completion_tokens == MAX_TOKENS
    assert_kv_moved(decode, before, expected.usage.prompt_tokens)
