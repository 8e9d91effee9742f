"""How the sub-requests' decode replies become the client's one reply, JSON or SSE. Pure: no I/O.

Choice `index` is rewritten to the sub-request's (prompt * n + child); every sub-reply is for one choice, at
index 0. Usage is summed as vLLM sums it for one request: prompt tokens (and their details) once per prompt (from
child 0), completion tokens over every choice, and `total_tokens` their sum. The other top-level fields (`id`,
`created`, `model`, ...) come from sub-request 0: all sub-requests carry the client's x-request-id, which is
what vLLM builds `id` from.

A stream is merged event by event (`StreamMerger`): each sub-stream's chunks pass in the order they arrive with
their choice's index rewritten, the sub-streams' `[DONE]` and final usage chunks are held back, and the merged
stream ends with one summed usage chunk (if the sub-streams sent any) and one `[DONE]`. An error event from a
sub-stream passes through and marks the merge as failed (the flow then ends the stream).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvbridge.serving.proxy.errors import error_json
from kvbridge.serving.proxy.fanout import Plan, SubRequest

DONE = b"data: [DONE]\n\n"


class BadReply(ValueError):
    """A decode reply that is not one choice of a completion."""


def merge_replies(plan: Plan, replies: Sequence[Any]) -> dict[str, Any]:
    """The client's reply from the sub-requests' (replies[k] answers plan.subs[k])."""
    choices = []
    for sub, reply in zip(plan.subs, replies, strict=True):
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or len(reply["choices"]) != 1:
            raise BadReply(f"the decode reply for choice {sub.index} does not hold exactly one choice")
        (choice,) = reply["choices"]
        if not isinstance(choice, dict):
            raise BadReply(f"the decode reply for choice {sub.index} holds a choice that is not an object")
        choices.append({**choice, "index": sub.index})
    merged = dict(replies[0])
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    if any(isinstance(r.get("usage"), dict) for r in replies):
        merged["usage"] = merge_usage(plan.subs, [r.get("usage") for r in replies])
    return merged


def merge_usage(subs: Sequence[SubRequest], usages: Sequence[Any]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for sub, usage in zip(subs, usages, strict=True):
        if not isinstance(usage, dict):
            continue
        for key, value in usage.items():
            if key == "total_tokens" or (key.startswith("prompt") and sub.child != 0):
                continue
            total[key] = _add(total.get(key), value)
    prompt, completion = total.get("prompt_tokens"), total.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        total["total_tokens"] = prompt + completion
    return total


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        return a + b
    return a


class StreamMerger:
    """Feed each sub-stream's bytes as they arrive (`feed`), say when one ends (`end`); `finish` gives the tail."""

    def __init__(self, plan: Plan) -> None:
        self._subs = plan.subs
        self._buffers = [bytearray() for _ in plan.subs]
        self._usage: list[Any] = [None] * len(plan.subs)
        self._usage_chunk: dict[str, Any] | None = None
        self.failed = False
        """An error event went out: the merged stream must end."""

    def feed(self, k: int, data: bytes) -> bytes:
        buffer = self._buffers[k]
        buffer += data
        out = []
        while (end := buffer.find(b"\n\n")) >= 0:
            event = bytes(buffer[:end])
            del buffer[: end + 2]
            out.append(self._event(k, event))
        return b"".join(out)

    def end(self, k: int) -> bytes:
        """Sub-stream k is over: what is left of it (an event without its blank line)."""
        rest = bytes(self._buffers[k]).strip()
        self._buffers[k].clear()
        return self._event(k, rest) if rest else b""

    def finish(self) -> bytes:
        """The summed usage chunk (when the sub-streams sent usage) and the one `[DONE]`."""
        if self._usage_chunk is None:
            return DONE
        chunk = {**self._usage_chunk, "usage": merge_usage(self._subs, self._usage)}
        return _data(chunk) + DONE

    def _event(self, k: int, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        if not data:
            return event + b"\n\n"  # a comment or another field: nothing to rewrite
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            return b""
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            chunk = None
        if not isinstance(chunk, dict):
            self.failed = True
            msg = f"the decode stream for choice {self._subs[k].index} sent an event that is not a JSON object"
            return b"data: " + error_json(502, "bad_gateway", msg) + b"\n\n"
        if "error" in chunk:
            self.failed = True
            return b"data: " + payload + b"\n\n"
        choices = chunk.get("choices")
        if isinstance(choices, list):
            if not choices and isinstance(chunk.get("usage"), dict):  # the sub-stream's final usage chunk
                self._usage[k] = chunk["usage"]
                if self._usage_chunk is None:
                    self._usage_chunk = chunk
                return b""
            for choice in choices:
                if isinstance(choice, dict):
                    choice["index"] = self._subs[k].index
        return _data(chunk)


def _data(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
