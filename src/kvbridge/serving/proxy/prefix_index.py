"""What prefix of a prompt an instance likely holds in its prefix cache: hashes of a prompt's block prefixes, and
an index of them per instance, fed by what the proxy routed there (pure; the caller passes the clock).

A prompt is cut into blocks of `block` tokens (token-id prompts) or `block * CHARS_PER_TOKEN` characters (text
prompts, and chat messages as their JSON without its closing bracket, so that a conversation's next turn extends
the previous one's text). Block i's key hashes the key of block i-1 and block i's content, seeded by the request's
`cache_salt`, so a key names the whole prefix up to it, as vLLM's own block hashes do; only full blocks count.

The index is approximate by design: it does not see the instance's own evictions, and it forgets. It holds at most
`max_blocks` keys (least recently routed forgotten first) and each for `ttl_s` after it was last routed. A prompt's
keys are touched last block first, so that the oldest key of a prompt is its last block: the index forgets a
prompt from its end and never keeps a block whose prefix it forgot.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
"""Characters per token assumed for text prompts (the proxy does not tokenize)."""


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt as the index sees it: its full blocks' keys, its length in (estimated) tokens, the block size."""

    keys: tuple[bytes, ...]
    tokens: int
    block_tokens: int

    def held_tokens(self, blocks: int) -> int:
        """Tokens covered by the first `blocks` blocks."""
        return min(blocks * self.block_tokens, self.tokens)


def prompt_blocks(body: Mapping[str, Any], chat: bool, block_tokens: int) -> PromptBlocks:
    """The block keys of a sub-request's prompt (one prompt: `prompt` a string or token ids, or chat `messages`)."""
    salt = body.get("cache_salt")
    seed = hashlib.blake2b(str(salt).encode() if salt is not None else b"", digest_size=16).digest()
    if chat:
        text = json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)[:-1]
        return _text_blocks(text, seed, block_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _text_blocks(prompt, seed, block_tokens)
    if isinstance(prompt, list):
        return _token_blocks(prompt, seed, block_tokens)
    return PromptBlocks((), 0, block_tokens)


def _chain(seed: bytes, pieces: Sequence[bytes]) -> tuple[bytes, ...]:
    keys = []
    key = seed
    for piece in pieces:
        key = hashlib.blake2b(key + piece, digest_size=16).digest()
        keys.append(key)
    return tuple(keys)


def _token_blocks(ids: Sequence[int], seed: bytes, block: int) -> PromptBlocks:
    full = len(ids) // block
    try:  # 8 bytes a token id, packed in C: a few thousand ids in tens of microseconds
        packed = array("Q", ids[: full * block]).tobytes()
        width = 8 * block
        pieces = [packed[i * width : (i + 1) * width] for i in range(full)]
    except OverflowError:  # an id beyond 64 bits (vLLM refuses it): its text
        pieces = [",".join(map(str, ids[i * block : (i + 1) * block])).encode() for i in range(full)]
    return PromptBlocks(_chain(b"t" + seed, pieces), len(ids), block)


def _text_blocks(text: str, seed: bytes, block: int) -> PromptBlocks:
    chars = block * CHARS_PER_TOKEN
    full = len(text) // chars
    pieces = [text[i * chars : (i + 1) * chars].encode() for i in range(full)]
    return PromptBlocks(_chain(b"s" + seed, pieces), -(-len(text) // CHARS_PER_TOKEN), block)


class PrefixIndex:
    """Block keys routed to one instance, each with the time it expires."""

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        if max_blocks < 1 or ttl_s <= 0:
            raise ValueError(f"max_blocks must be >= 1 and ttl_s > 0, got {max_blocks} and {ttl_s}")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._expiry: OrderedDict[bytes, float] = OrderedDict()
        """Least recently routed first; with one ttl that is also soonest to expire first."""

    def __len__(self) -> int:
        return len(self._expiry)

    def match(self, keys: Sequence[bytes], now: float) -> int:
        """How many leading blocks of `keys` this instance likely holds."""
        self.prune(now)
        n = 0
        for key in keys:
            if key not in self._expiry:
                break
            n += 1
        return n

    def add(self, keys: Sequence[bytes], now: float) -> None:
        """`keys` were routed here at `now`: touch them, last block first; forget the least recent above the bound."""
        expiry = now + self.ttl_s
        for key in reversed(keys):
            self._expiry[key] = expiry
            self._expiry.move_to_end(key)
        while len(self._expiry) > self.max_blocks:
            self._expiry.popitem(last=False)
        self.prune(now)

    def prune(self, now: float) -> None:
        """Forget keys whose time is up."""
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                break
            del self._expiry[key]
