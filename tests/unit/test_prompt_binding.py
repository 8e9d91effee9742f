"""The prompt hash binds everything that shapes a prompt's KV, as vLLM's own prefix cache keys a block: the token
ids, and the LoRA adapter, the cache salt, multimodal inputs and prompt embeddings (`kv_extras`). Params computed
for one request are refused for another that differs only in one of those; the same request passes (the control).
The real-vLLM version for cache_salt is in test_e2e_trust.py."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from kvbridge.core.errors import ParamsRefused
from kvbridge.wire.params import PrefillDone, check_binding, kv_extras, prompt_hash

KEY = b"k" * 32
TOKENS = list(range(200, 264))


def request(**fields) -> SimpleNamespace:
    """The attributes of a vLLM 0.32 `Request` that `kv_extras` reads, plain by default."""
    base = {
        "prompt_token_ids": TOKENS,
        "lora_request": None,
        "cache_salt": None,
        "mm_features": [],
        "prompt_embeds": None,
        "prompt_is_token_ids": None,
    }
    return SimpleNamespace(**{**base, **fields})


def lora(name: str, path: str = "/adapters/a") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def image(identifier: str, offset: int = 8, length: int = 16) -> SimpleNamespace:
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def params_for(req: SimpleNamespace) -> PrefillDone:
    """What the prefill's scheduler side returns for `req` (scheduler_side.request_finished), signed."""
    done = PrefillDone(
        remote_engine_id="p",
        remote_request_id="req",
        remote_block_ids=[1, 2, 3, 4],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=1,tp=1",
        remote_num_tokens=len(req.prompt_token_ids),
        remote_prompt_hash=prompt_hash(req.prompt_token_ids, kv_extras(req)),
        remote_token="t" * 32,
        remote_expires=2000.0,
    )
    return done.signed(KEY)


def check(done: PrefillDone, req: SimpleNamespace, extras: tuple | None = None) -> None:
    """What the decode's scheduler side runs (scheduler_side._check)."""
    extras = kv_extras(req) if extras is None else extras
    check_binding(done, req.prompt_token_ids, key=KEY, now=1000.0, max_workers=64, extras=extras)


# (prefill request, decode request): same tokens, one KV-shaping input differs
SWAPS = {
    "cache_salt": ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
    "salt_dropped": ({"cache_salt": "tenant-a"}, {}),
    "salt_added": ({}, {"cache_salt": "tenant-b"}),
    "lora_name": ({"lora_request": lora("sql")}, {"lora_request": lora("chat")}),
    "lora_path": ({"lora_request": lora("sql", "/a/v1")}, {"lora_request": lora("sql", "/a/v2")}),
    "lora_dropped": ({"lora_request": lora("sql")}, {}),
    "mm_content": ({"mm_features": [image("cat")]}, {"mm_features": [image("dog")]}),
    "mm_position": ({"mm_features": [image("cat", 8)]}, {"mm_features": [image("cat", 24)]}),
    "mm_dropped": ({"mm_features": [image("cat")]}, {}),
}


@pytest.mark.parametrize("case", list(SWAPS))
def test_params_of_a_request_are_refused_for_one_that_differs_only_in_what_shapes_the_kv(case):
    prefill, decode = (request(**fields) for fields in SWAPS[case])
    done = params_for(prefill)
    check(done, prefill)  # the control: the request they were computed for passes
    with pytest.raises(ParamsRefused) as err:
        check(done, decode)
    assert err.value.reason == "prompt_hash"


@pytest.mark.parametrize("case", list(SWAPS))
def test_negative_control_a_tokens_only_hash_would_take_the_other_requests_params(case):
    """What the hash was before: token ids only. Every swap above then passes, so the test above can tell."""
    prefill, decode = (request(**fields) for fields in SWAPS[case])
    done = msgspec.structs.replace(params_for(prefill), remote_prompt_hash=prompt_hash(TOKENS)).signed(KEY)
    check(done, decode, extras=())


def test_prompt_embeddings_are_bound_by_content():
    torch = pytest.importorskip("torch")
    embeds = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mask = [True] * (len(TOKENS) - 3) + [False] * 3
    prefill = request(prompt_embeds=embeds, prompt_is_token_ids=mask)
    done = params_for(prefill)
    check(done, request(prompt_embeds=embeds.clone(), prompt_is_token_ids=mask))  # same content: passes
    for other in (
        request(prompt_embeds=embeds + 1, prompt_is_token_ids=mask),
        request(prompt_embeds=embeds, prompt_is_token_ids=mask[::-1]),
        request(),
    ):
        with pytest.raises(ParamsRefused):
            check(done, other)


def test_a_plain_prompt_keeps_the_tokens_only_hash_and_extras_are_unambiguous():
    assert kv_extras(request()) == ()
    assert prompt_hash(TOKENS, kv_extras(request())) == prompt_hash(TOKENS)
    salted = prompt_hash(TOKENS, kv_extras(request(cache_salt="s")))
    assert salted != prompt_hash(TOKENS)
    assert salted == prompt_hash(tuple(TOKENS), (("cache_salt", "s"),))  # pinned to what kv_extras builds
    # the token count is hashed too: moving a token between the ids and the extras changes the hash
    assert prompt_hash([1, 2], (("cache_salt", "s"),)) != prompt_hash([1], (("cache_salt", "s"),))


def test_block_ids_beyond_any_kv_cache_are_refused_when_parsed():
    """Block id 2**63 is refused by the parser, not an OverflowError in the transfer thread."""
    from kvbridge.core.errors import RequestParamsError
    from kvbridge.wire.params import parse_prefill_done

    fields = params_for(request()).to_dict()
    assert parse_prefill_done({**fields, "remote_block_ids": [0, (1 << 31) - 1]})  # the control: large but sane
    for bad in (1 << 31, 2**63, 10**30):
        with pytest.raises(RequestParamsError, match="remote_block_ids"):
            parse_prefill_done({**fields, "remote_block_ids": [1, bad]})
