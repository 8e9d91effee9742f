"""How one client request becomes sub-requests, and the bodies of their two legs.

A prefill's `kv_transfer_params` name one prompt's KV, read once by one decode request: vLLM returns the params of
the first prompt only for a list, and `n` children would all read (and complete) the same lease. So a request
with P prompts and `n` choices becomes P * n sub-requests of one prompt and n=1, each with its own prefill leg
and its own decode leg; the replies are put back together by `reassembly.py`. Sub-request (prompt i, child j)
answers choice `index = i * n + j`, OpenAI's order.

With a `seed`, child j samples with `seed + j`: what vLLM itself gives the j-th child of a request with `n`
(`ParentRequest`), so seeded outputs equal an aggregated server's.

A request for which the decode server computes prompt logprobs gets no prefill leg (`Plan.direct`): vLLM would not
read the transferred KV anyway (validation.computes_prompt_logprobs), so the body goes to a decode server alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.serving.proxy.validation import Shape, check, computes_prompt_logprobs

SPLIT_FIELDS = ("n", "best_of")
"""Dropped from every sub-request: each is one choice."""
PREFILL_DROPS = ("stream_options", "min_tokens", "echo", "prompt_logprobs")
"""Dropped from the prefill leg: vLLM refuses stream_options without stream and min_tokens above max_tokens=1;
echo and prompt logprobs would be computed for nothing."""


@dataclass(frozen=True)
class SubRequest:
    index: int
    """The choice index in the client's reply: prompt * n + child."""
    prompt: int
    child: int
    body: dict[str, Any]
    """One prompt, n=1: what both legs start from."""


@dataclass(frozen=True)
class Plan:
    subs: tuple[SubRequest, ...]
    n: int
    num_prompts: int
    stream: bool
    direct: bool = False
    """No prefill leg: the decode server prefills itself (prompt logprobs)."""

    @property
    def single(self) -> bool:
        """One sub-request: its reply is the client's, passed through unchanged."""
        return len(self.subs) == 1


def plan(body: Mapping[str, Any], chat: bool, max_prompts: int, max_n: int) -> Plan:
    """Check the body (InvalidRequest naming the field) and split it into sub-requests."""
    shape = check(body, chat, max_prompts, max_n)
    stream = bool(body.get("stream"))
    clean = _without_client_params(body)
    if computes_prompt_logprobs(body, chat):
        return Plan((SubRequest(0, 0, 0, clean),), shape.n, shape.num_prompts, stream, direct=True)
    return Plan(tuple(_split(clean, shape)), shape.n, shape.num_prompts, stream)


def _split(body: dict[str, Any], shape: Shape) -> list[SubRequest]:
    base = {k: v for k, v in body.items() if k not in SPLIT_FIELDS}
    prompts = shape.prompts if shape.prompts is not None else (None,)
    seed = body.get("seed")
    subs = []
    for i, prompt in enumerate(prompts):
        for j in range(shape.n):
            sub = dict(base)
            if prompt is not None:
                sub["prompt"] = prompt
            if seed is not None:
                sub["seed"] = seed + j
            subs.append(SubRequest(i * shape.n + j, i, j, sub))
    return subs


def _without_client_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body without any kv_transfer_params of its own: the legs set theirs, and vLLM would read one
    from `vllm_xargs` too."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"} or None
    return out


def prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's body: the sub-request's, generating one token, not streamed, asking to keep the KV.
    `logprobs` (and `top_logprobs`, `logprob_token_ids`) stay: one token's worth is cheap, and the prefill server
    then refuses values the decode server would refuse (its `max_logprobs`) before any KV is held."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS and k not in SPLIT_FIELDS}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if chat:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the sub-request's, plus what its own prefill leg returned."""
    return {**body, "kv_transfer_params": dict(kv_transfer_params)}
