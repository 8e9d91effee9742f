"""Checks on a client's body before any leg is sent, so that a decode leg never fails for a reason known up front.

The prefill leg carries the client's fields except those the PD split changes (`max_tokens`, `min_tokens`,
`stream`, `stream_options`, `n`, `best_of`, `echo`), so the prefill server validates everything else by vLLM's
own rules before it holds any KV. The changed fields reach only the decode server; their rules are checked here
(vLLM 0.32, `CompletionRequest` / `ChatCompletionRequest` / `SamplingParams`), and so are the fan-out bounds.
A failure is `InvalidRequest` naming the field: a 400 with OpenAI's `param`.

Not checkable here: `max_tokens` against the context left after a text prompt (the proxy does not tokenize) and
`logprobs` above the server's `max_logprobs` (the prefill checks that one). A decode leg refused for such a reason
releases its prefill's KV at once (flow.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.serving.proxy.errors import InvalidRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5
"""A temperature under this is greedy sampling (vLLM's _SAMPLING_EPS), which vLLM serves with n=1 only."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's `CompletionRequest.max_tokens` default (also what `null` becomes)."""

Prompt = str | list[int]


@dataclass(frozen=True)
class Shape:
    """What the checks found: the prompts one by one (None for chat: its one prompt is `messages`) and `n`."""

    prompts: tuple[Prompt, ...] | None
    n: int

    @property
    def num_prompts(self) -> int:
        return 1 if self.prompts is None else len(self.prompts)


def check(body: Mapping[str, Any], chat: bool, max_prompts: int, max_n: int) -> Shape:
    """The body's prompts and `n`; raises InvalidRequest naming the first field that cannot be served."""
    prompts = None if chat else _prompts(body, max_prompts)
    if chat:
        _messages(body)
    n = _n(body, chat, max_n)
    fanout = n * (1 if prompts is None else len(prompts))
    if fanout > max(max_prompts, max_n):  # each is a prefill leg that pins KV for its lease
        raise InvalidRequest(f"{fanout} prompts x choices exceed {max(max_prompts, max_n)}", "n")
    _best_of(body, n)
    if body.get("use_beam_search"):
        raise InvalidRequest("beam search is not supported through the PD proxy", "use_beam_search")
    _seed(body, n)
    _flag(body, "stream")
    _flag(body, "echo")
    _stream_options(body)
    _token_counts(body, chat)
    return Shape(prompts, n)


def computes_prompt_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
    """True when the decode server will compute prompt logprobs (`prompt_logprobs`, or `echo` with logprobs;
    in chat `echo` alone, since vLLM then asks for `top_logprobs`, default 0). vLLM skips loading external KV for
    such requests (`SamplingParams.skip_reading_prefix_cache`), so a prefill leg would only pin KV nobody reads."""
    if body.get("prompt_logprobs") is not None:
        return True
    if not body.get("echo"):
        return False
    return body.get("top_logprobs", 0) is not None if chat else body.get("logprobs") is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: Mapping[str, Any], name: str, minimum: int, *, nullable: bool = True) -> int | None:
    if name not in body or (body[name] is None and nullable):
        return None
    value = body[name]
    if not _is_int(value):
        raise InvalidRequest(f"`{name}` must be an integer, got {_kind(value)}", name)
    if value < minimum:
        raise InvalidRequest(f"`{name}` must be at least {minimum}, got {value}", name)
    return value


def _flag(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"`{name}` must be a boolean, got {_kind(value)}", name)


def _all_ints(value: list[Any]) -> bool:
    """Every item is an int (not a bool). `type` is taken in C, item by item in Python only on a mix: a prompt of
    thousands of token ids costs tens of microseconds, not milliseconds."""
    return set(map(type, value)) <= {int}


def _token_ids(value: list[Any]) -> bool:
    return _all_ints(value) and (not value or min(value) >= 0)


def _prompts(body: Mapping[str, Any], max_prompts: int) -> tuple[Prompt, ...]:
    """A string, a list of token ids (one prompt), a list of strings or a list of lists of token ids."""
    if body.get("prompt_embeds") is not None:
        raise InvalidRequest("`prompt_embeds` is not supported through the PD proxy", "prompt_embeds")
    prompt = body.get("prompt")
    shapes = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if prompt is None:
        raise InvalidRequest("`prompt` is required", "prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"`prompt` must be {shapes} (not empty), got {_kind(prompt)}", "prompt")
    if _all_ints(prompt):
        if min(prompt) < 0:
            raise InvalidRequest("`prompt` token ids must be non-negative", "prompt")
        return (prompt,)
    if len(prompt) > max_prompts:
        raise InvalidRequest(f"`prompt` has {len(prompt)} prompts, at most {max_prompts} are served", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            if not ids or not _token_ids(ids):
                raise InvalidRequest(f"`prompt[{i}]` must be a non-empty list of non-negative token ids", "prompt")
        return tuple(prompt)
    raise InvalidRequest(f"`prompt` must be {shapes}; this list mixes kinds", "prompt")


def _messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"`messages` must be a non-empty list, got {_kind(messages)}", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"`messages[{i}]` must be an object, got {_kind(message)}", "messages")


def _n(body: Mapping[str, Any], chat: bool, max_n: int) -> int:
    """`n`; above 1 not with greedy sampling, which vLLM refuses (each sub-request has n=1, so no leg would).
    A server whose generation config makes greedy the default is not seen here: its children are all greedy."""
    n = _int(body, "n", 1, nullable=chat)
    if n is None:
        return 1
    if n > max_n:
        raise InvalidRequest(f"`n` is {n}, at most {max_n} is served", "n")
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature < GREEDY_BELOW
    if n > 1 and greedy:
        raise InvalidRequest(f"n must be 1 with greedy sampling (temperature {temperature}), got {n}", "n")
    return n


def _best_of(body: Mapping[str, Any], n: int) -> None:
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of > 1 and best_of != n:
        raise InvalidRequest(f"`best_of` ({best_of}) other than `n` ({n}) is not supported", "best_of")


def _seed(body: Mapping[str, Any], n: int) -> None:
    seed = _int(body, "seed", INT64_MIN)
    if seed is not None and seed + n - 1 > INT64_MAX:
        raise InvalidRequest(f"`seed` + n - 1 must fit in int64 (child j samples with seed + j), got {seed}", "seed")


def _stream_options(body: Mapping[str, Any]) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise InvalidRequest(f"`stream_options` must be an object, got {_kind(options)}", "stream_options")
    if options and not body.get("stream"):
        raise InvalidRequest("`stream_options` can only be given with `stream: true`", "stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidRequest(f"`stream_options.{name}` must be a boolean, got {_kind(value)}", "stream_options")


def _token_counts(body: Mapping[str, Any], chat: bool) -> None:
    """`max_tokens` / `max_completion_tokens` / `min_tokens` as vLLM's SamplingParams checks them."""
    echo = bool(body.get("echo"))
    if chat:
        limit = _int(body, "max_completion_tokens", 1)
        max_tokens = _int(body, "max_tokens", 1)
        limit = limit if limit is not None else max_tokens  # None: the context left, unknown here
    else:
        max_tokens = _int(body, "max_tokens", 0)
        if max_tokens == 0 and not echo:
            raise InvalidRequest("`max_tokens` must be at least 1 (0 only with `echo`)", "max_tokens")
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max(max_tokens, 1)
    min_tokens = _int(body, "min_tokens", 0, nullable=False)
    if min_tokens is not None and limit is not None and min_tokens > limit:
        raise InvalidRequest(f"`min_tokens` ({min_tokens}) must not exceed the token limit ({limit})", "min_tokens")
