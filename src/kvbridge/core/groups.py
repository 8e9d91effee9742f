"""Several KV-cache groups (vLLM's hybrid KV-cache manager, HMA): which blocks of each group a request moves.

With HMA on, vLLM splits a hybrid model's layers into KV-cache groups (e.g. the sliding-window layers and the
full-attention layers of a Llama/Gemma with alternating `layer_types`). Every group has its own block table per
request, and the groups' tensors alias one pool: block id b of group 0 and block id b of group 1 are the same
bytes, which is why a block id belongs to one group at a time. So each layer must be copied with its own
group's block ids, never another's.

A sliding-window group keeps only the blocks its window still needs; vLLM puts the null block (id 0) in place of
the others, always at the start of the list (`SlidingWindowManager`). Both sides use vLLM's rule: after
`num_tokens` computed tokens, the first `max(0, num_tokens - window + 1) // block_size` blocks are null.

- Prefill side (`prefill_lists`): per group, the prompt's blocks with the leading null blocks dropped: the
  in-window tail of a sliding-window group, every block of a full-attention group.
- Decode side (`load_pairs`): per group, each block position the load writes whose local block is not null,
  paired with the remote block at that position (the remote list is aligned to the prompt's end). A position the
  decode needs that the prefill no longer holds is refused, never read from another block.
- State groups (Mamba2's conv + SSM state, vLLM's `MambaSpec` with `mamba_cache_mode` "none"): a request holds one
  running-state block (then vLLM's speculative scratch blocks), whatever its length: the state after the request's
  computed tokens, not per-token KV. So it is published and loaded whole, as one block, and the token accounting
  changes (`computed_tokens`): vLLM recomputes the last prompt token on the decode side, which must not be applied
  to a state twice, so the prefill computes the first N-1 prompt tokens and the decode loads those N-1.
- Worker side: one load carries each group's pairs as a list of its own (`pair_lists`: per group, the remote ids
  and the local ids), and `core.descriptors.group_descriptors` copies each layer with its group's lists: a block
  id is only ever read together with its group, never packed with it into one number. A one-group model's load
  is one list on each side, as it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.core.errors import LayoutError, RequestParamsError

NULL_BLOCK = 0
"""vLLM's null block: the placeholder for a block a sliding-window group no longer holds."""

MAX_GROUPS = 64
"""The most KV-cache groups one load carries (as the wire's params allow)."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: its block size and, for a sliding-window group, its window in tokens (0: full);
    `state`: a group of state pages (Mamba), one running-state block per request (see the module docstring)."""

    block_size: int
    sliding_window: int = 0
    state: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise LayoutError(f"a KV-cache group's block_size must be positive, got {self.block_size}")
        if self.sliding_window < 0:
            raise LayoutError(f"a sliding window must be non-negative, got {self.sliding_window}")
        if self.state and self.sliding_window:
            raise LayoutError("a state group has no sliding window")

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks of `num_tokens` tokens (the last one partial); a state group's one block."""
        if self.state:
            return 1 if num_tokens > 0 else 0
        return -(-num_tokens // self.block_size)

    def first_block(self, cached_tokens: int) -> int:
        """The first block position a load writes when `cached_tokens` are cached locally: a state group's block
        is always loaded whole (a state covers every token before it)."""
        return 0 if self.state else cached_tokens // self.block_size

    def skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks vLLM's sliding-window manager has freed (null) once `num_tokens` are computed:
        those wholly before the window of the next token (`SlidingWindowManager.get_num_skipped_tokens`)."""
        if not self.sliding_window:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def live_blocks(self, num_tokens: int) -> int:
        """Blocks of `num_tokens` tokens this group still holds (not null)."""
        return self.num_blocks(num_tokens) - min(self.skipped_blocks(num_tokens), self.num_blocks(num_tokens))


def has_state(groups: Sequence[CacheGroup]) -> bool:
    return any(g.state for g in groups)


def computed_tokens(groups: Sequence[CacheGroup], num_prompt: int) -> int:
    """Prompt tokens a prefill computes and a decode loads, of a prompt of `num_prompt` tokens: all of them, or
    with a state group all but the last (vLLM's decode recomputes the last prompt token after a load, which would
    apply it to the state twice). 0: nothing is moved (a one-token prompt with state: the decode computes it)."""
    return num_prompt - 1 if has_state(groups) else num_prompt


def check_groups(groups: Sequence[CacheGroup]) -> None:
    """LayoutError unless `groups` can be carried in one load (at least one, at most MAX_GROUPS)."""
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise LayoutError(f"{len(groups)} KV-cache groups: kvbridge moves 1 to {MAX_GROUPS}")


def prefill_lists(groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
    """What a prefill instance publishes per group for a prompt of `num_tokens` tokens: its blocks of the prompt
    (vLLM may hand one more) with the leading null blocks dropped. RequestParamsError if a null block is not
    leading, or a group holds fewer blocks than vLLM's rule says it must."""
    if len(block_ids) != len(groups):
        raise RequestParamsError(f"{len(block_ids)} block lists for {len(groups)} KV-cache groups")
    out = []
    for index, (group, ids) in enumerate(zip(groups, block_ids, strict=True)):
        ids = list(ids[: group.num_blocks(num_tokens)])
        start = 0
        while start < len(ids) and ids[start] == NULL_BLOCK:
            start += 1
        tail = ids[start:]
        if NULL_BLOCK in tail:
            raise RequestParamsError(f"KV-cache group {index}: a null block after a live one")
        if len(tail) < group.live_blocks(num_tokens):
            raise RequestParamsError(
                f"KV-cache group {index} holds {len(tail)} blocks of the prompt, its window needs "
                f"{group.live_blocks(num_tokens)}"
            )
        out.append(tail)
    return out


def check_remote_lists(groups: Sequence[CacheGroup], remote: Sequence[Sequence[int]], num_tokens: int) -> None:
    """RequestParamsError unless a prefill's published lists fit a prompt of `num_tokens` tokens: one list per
    group, each at least the group's live blocks and at most the prompt's blocks, no null block."""
    if len(remote) != len(groups):
        raise RequestParamsError(
            f"remote block lists name {len(remote)} KV-cache groups, this engine has {len(groups)}"
        )
    for index, (group, ids) in enumerate(zip(groups, remote, strict=True)):
        if not group.live_blocks(num_tokens) <= len(ids) <= group.num_blocks(num_tokens):
            raise RequestParamsError(
                f"KV-cache group {index}: {len(ids)} remote blocks, the prompt needs "
                f"{group.live_blocks(num_tokens)} to {group.num_blocks(num_tokens)}"
            )
        if NULL_BLOCK in ids:
            raise RequestParamsError(f"KV-cache group {index}: the null block in the remote block list")


def load_pairs(
    group: CacheGroup, local: Sequence[int], remote: Sequence[int], num_tokens: int, first: int
) -> tuple[list[int], list[int]]:
    """(remote ids, local ids) one group loads for a prompt of `num_tokens` tokens, from block position `first`
    (those before are cached locally) to the prompt's last block.

    `local` is the decode's block list of the group by position (null where vLLM's manager holds nothing);
    `remote` the prefill's published list, aligned to the prompt's last block. A local null block is not
    loaded; a live local block whose position the remote list does not cover is refused (RequestParamsError)."""
    last = group.num_blocks(num_tokens)
    offset = last - len(remote)  # position of remote[0]
    if offset < 0:
        raise RequestParamsError(f"{len(remote)} remote blocks for a prompt of {last} blocks")
    if len(local) < last:
        raise RequestParamsError(f"{len(local)} local blocks for a prompt of {last} blocks")
    src: list[int] = []
    dst: list[int] = []
    for pos in range(first, last):
        if local[pos] == NULL_BLOCK:
            continue
        if pos < offset:
            raise RequestParamsError(
                f"block {pos} of the prompt is needed here but the prefill holds only blocks {offset}-{last - 1}"
            )
        src.append(int(remote[pos - offset]))
        dst.append(int(local[pos]))
    return src, dst


def pair_lists(
    groups_pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """One load's (remote, local) block lists per group, from each group's (remote ids, local ids): group g's
    remote list pairs with its local list position by position. RequestParamsError unless every group's two lists
    have one length; LayoutError unless there are 1 to MAX_GROUPS groups."""
    check_groups(groups_pairs)
    for group, (s, d) in enumerate(groups_pairs):
        if len(s) != len(d):
            raise RequestParamsError(f"KV-cache group {group}: {len(s)} remote blocks for {len(d)} local blocks")
    remote = tuple(tuple(int(b) for b in s) for s, _ in groups_pairs)
    local = tuple(tuple(int(b) for b in d) for _, d in groups_pairs)
    return remote, local
