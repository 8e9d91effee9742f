"""What the proxy takes from a client before the PD flow: a strict, bounded JSON object and a plain request id.

Python's json module accepts NaN and Infinity, turns 1e999 into inf (which httpx then cannot send: a 500 before
this check), and recurses once per nesting level; a 100,000-deep body is a RecursionError. Here each of those
is a 400 naming the problem, and nesting is bounded well below the interpreter's limit.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from kvbridge.serving.proxy.errors import InvalidRequest

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]+")


def request_id(given: str | None, max_chars: int) -> str:
    """The client's x-request-id if it is short and plain, else a fresh one."""
    if given and len(given) <= max_chars and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def parse_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object: strict JSON (no NaN or Infinity, no number that overflows to one), nested at
    most `max_depth` deep; InvalidRequest (400) otherwise."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise InvalidRequest(f"the body is nested more than {max_depth} deep", None) from None
    except ValueError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", None)
    if _depth_over(body, max_depth):
        raise InvalidRequest(f"the body is nested more than {max_depth} deep", None)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def _depth_over(value: Any, max_depth: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        if _CONTAINERS.isdisjoint(map(type, children)):  # a flat list (token ids) in C, not item by item
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


_CONTAINERS = frozenset((dict, list))
"""What json.loads nests: dicts and lists, never their subclasses."""
