"""The prefill side's bookkeeping of held requests: pure, torch-free, with the clock passed in.

A finished prefill request's blocks are held for the decode instance that was handed its kv_transfer_params:

    held --claim--> being read --all readers notified--> done (freed)
      |               |--read deadline passed-----------> expired (freed)
      |--lease_s------------------------------------------> expired (freed)
      |--abort (from the reader, or the proxy)-----------> done (freed now)

A claim pins the request for one reading engine: from then on the lease never frees it; only the readers'
notifications, an abort or the read deadline (the reader's own transfer timeout plus a margin, extended by each
claim of that engine's workers) do. Every claim, notification and abort must carry the request's secret token
(from the signed kv_transfer_params), so nobody else can free or pin a request; a claim must also name the
prompt hash, only blocks of the request (each KV-cache group's of that group), and the digest of the request's
block lists, per group, in the order its params published them (`groups_digest`): params whose blocks were
reordered, repeated, replaced or moved to another group would load KV into the wrong positions, also without a
deployment key to sign them. Notifications and aborts may arrive before the hold (without claims; the hold
comes with the next step's metadata when the scheduler's feed is late): a few are kept, briefly, and checked
against the token once the hold comes; an abort that matches frees the request as it is held. With a deployment key a
request's token is a MAC of its id (`wire.keys.request_token`) that `token_check` verifies before anything is
kept, so only key holders' notifications take room in that bounded table: a forged flood (NIXL notifications are
not sealed) cannot fill it and make a key holder's notification be refused.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

READ_MARGIN_S = 5.0
"""Added to a reader's transfer timeout before its claim's pin lapses: the reader fails its load at its own
deadline, so the margin only has to cover the time its abort or notification takes to arrive."""

MAX_READ_S = 600.0
"""The longest pin a claim gets (a reader's transfer timeout may not exceed it: config checks)."""

MAX_EARLY = 1024
"""Requests whose notifications are kept before their holds arrive (bounded: an unheld id costs a dict entry).
The default of `LeaseBook.max_early` and of config `max_early_notes`."""

EARLY_NOTES_PER_REQUEST = 64
"""Notifications kept per such request (config `early_notes_per_request`)."""

MAX_FREED = 4096
"""Requests freed here lately (read, aborted or expired) that are remembered with their tokens, so that a claim of
one that carries its token is refused at once instead of waiting for a hold that will not come (bounded: the
oldest is forgotten first)."""


def blocks_digest(blocks: Sequence[int]) -> str:
    """32 hex digits naming a block list and its order: SHA-256 of the ids as little-endian int64."""
    data = array("q", blocks)  # 8 bytes on every platform CPython supports
    if sys.byteorder == "big":  # pragma: no cover
        data.byteswap()
    return hashlib.sha256(data.tobytes()).hexdigest()[:32]


_GROUPS_TAG = b"kvbridge-groups-v1\0"


def groups_digest(groups: Sequence[Sequence[int]]) -> str:
    """32 hex digits naming a request's block lists per KV-cache group, each list's order and which group holds
    it: one group's is `blocks_digest` of its list (what one-group peers always sent); several groups' is SHA-256
    of a domain tag and, group by group, the list's length and ids (little-endian int64), so that no two
    different per-group lists share an input (a block id is below 2**31; the tag's first 8 bytes are not)."""
    if len(groups) == 1:
        return blocks_digest(groups[0])
    data = array("q")
    for ids in groups:
        data.append(len(ids))
        data.extend(ids)
    if sys.byteorder == "big":  # pragma: no cover
        data.byteswap()
    return hashlib.sha256(_GROUPS_TAG + data.tobytes()).hexdigest()[:32]


@dataclass
class _Entry:
    token: str
    prompt_hash: str
    blocks: tuple[frozenset[int], ...]  # per KV-cache group
    order: str  # groups_digest of the block lists as published
    expiry: float
    reader: str | None = None  # the decode engine that claimed it
    read_until: float | None = None
    first_claim: float | None = None
    expected: int | None = None
    readers: set[str] = field(default_factory=set)


@dataclass
class _Early:
    seen: float
    notes: list[tuple[str, str, str, int]] = field(default_factory=list)  # (token, engine, worker, expected)
    aborts: list[str] = field(default_factory=list)  # their tokens (in the table of early aborts)

    @property
    def count(self) -> int:
        return len(self.notes) + len(self.aborts)


def _within(held: tuple[frozenset[int], ...], blocks: Sequence[Iterable[int]]) -> bool:
    """Whether each group's `blocks` are blocks the request holds in that group (no group it does not have)."""
    return len(blocks) <= len(held) and all(h.issuperset(b) for h, b in zip(held, blocks, strict=False))


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass
class LeaseBook:
    lease_s: float
    early_ttl_s: float = 10.0
    check_blocks: bool = True  # False only in tests that show what wrong blocks do (config `check_blocks`)
    max_early: int = MAX_EARLY  # requests with early notifications kept at once (config `max_early_notes`)
    early_notes_per_request: int = EARLY_NOTES_PER_REQUEST
    token_check: Callable[[str, str], bool] | None = None
    """(request id, token) -> whether the token is one a key holder made for that request (`wire.keys`), checked
    before a notification for a request not held yet is kept; None (no key): any non-empty token is kept."""
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _early: OrderedDict[str, _Early] = field(default_factory=OrderedDict)
    _early_aborts: OrderedDict[str, _Early] = field(default_factory=OrderedDict)  # bounded as `_early`, apart
    _aborted: set[str] = field(default_factory=set)
    max_freed: int = MAX_FREED
    _freed: OrderedDict[str, str] = field(default_factory=OrderedDict)  # the last `max_freed` freed: their tokens
    expired_total: int = 0
    completed_total: int = 0
    aborted_total: int = 0
    refused_total: int = 0  # claims, notifications and aborts refused: a wrong token, or none kept (see _early_room)

    def hold(
        self,
        request_id: str,
        now: float,
        token: str = "",
        prompt_hash: str = "",
        blocks: Sequence[Sequence[int]] = (),
    ) -> None:
        """Hold `request_id`'s `blocks`: per KV-cache group, its list in the order the params publish it."""
        held = tuple(frozenset(ids) for ids in blocks)
        entry = _Entry(token, prompt_hash, held, groups_digest(blocks), now + self.lease_s)
        self._entries[request_id] = entry
        self._freed.pop(request_id, None)  # held again
        aborts = self._early_aborts.pop(request_id, None)
        early = self._early.pop(request_id, None)
        if aborts is not None and any(_same(token, t) for t in aborts.aborts):  # its reader gave up before the hold
            self._free_aborted(request_id, entry)
            return
        for note_token, engine, worker, expected in early.notes if early else ():
            self._note(entry, note_token, engine, worker, expected)

    def claim(
        self,
        request_id: str,
        token: str,
        prompt_hash: str,
        blocks: Sequence[Iterable[int]],
        reader: str,
        read_s: float,
        now: float,
        order: str = "",
    ) -> str | None:
        """Pin `request_id` for `reader` (a decode engine) for `read_s` more seconds; None if granted, else why not
        (one word: not_held, mismatch, other_reader). `blocks`: per KV-cache group, the blocks the reader reads;
        `order`: the `groups_digest` of the block lists the reader's params publish. A refusal says nothing of a
        request to one without its token."""
        entry = self._entries.get(request_id)
        if entry is None or not _same(entry.token, token) or self._lapsed(entry, now):
            self.refused_total += 1
            return "not_held"
        ordered = _same(entry.order, order) or not self.check_blocks
        if entry.prompt_hash != prompt_hash or not _within(entry.blocks, blocks) or not ordered:
            self.refused_total += 1
            return "mismatch"
        if entry.reader is not None and entry.reader != reader:
            self.refused_total += 1
            return "other_reader"
        entry.reader = reader
        if entry.first_claim is None:
            entry.first_claim = now
        # each claim of the reader's workers may extend the pin, never past MAX_READ_S after the first claim
        until = min(now + min(max(read_s, 1.0), MAX_READ_S), entry.first_claim + MAX_READ_S) + READ_MARGIN_S
        entry.read_until = max(entry.read_until or until, until)
        return None

    def reading(
        self, request_id: str, token: str, reader: str, blocks: Sequence[Iterable[int]], now: float
    ) -> float | None:
        """Until when `reader` may read `blocks` (per KV-cache group) of `request_id` (its claim's pin), or None:
        not held, a wrong token, no claim of this reader, or blocks not the request's. What the staged path asks
        before it copies."""
        entry = self._entries.get(request_id)
        if (
            entry is None
            or not _same(entry.token, token)
            or entry.reader != reader
            or entry.read_until is None
            or self._lapsed(entry, now)
            or not _within(entry.blocks, blocks)
        ):
            self.refused_total += 1
            return None
        return entry.read_until

    def still_reading(self, request_id: str, token: str, reader: str, now: float) -> bool:
        """Whether a read `reading` granted may go on: the request is still held, with this token, claimed by this
        reader and not lapsed. Its blocks are not compared again (constant cost: asked before every chunk)."""
        entry = self._entries.get(request_id)
        return not (
            entry is None
            or not _same(entry.token, token)
            or entry.reader != reader
            or entry.read_until is None
            or self._lapsed(entry, now)
        )

    def notified(self, request_id: str, token: str, engine: str, worker: str, expected: int, now: float) -> bool:
        """Decode worker `worker` of engine `engine` is done with `request_id`; repeats count once.
        False if the notification was not taken (wrong token, another engine's, nowhere to keep it)."""
        entry = self._entries.get(request_id)
        if entry is not None:
            return self._note(entry, token, engine, worker, expected)
        early = self._early_room(self._early, request_id, token, now)
        if early is None:
            return False
        early.notes.append((token, engine, worker, expected))
        return True

    def _early_room(self, table: OrderedDict[str, _Early], request_id: str, token: str, now: float) -> _Early | None:
        """Where in `table` (early notifications, or early aborts: apart, so that neither crowds out the other) to
        keep one of `request_id`, not held yet; None (counted as refused): not a key holder's token, or no room
        (`max_early` requests, `early_notes_per_request` each)."""
        if not token or (self.token_check is not None and not self.token_check(request_id, token)):
            self.refused_total += 1  # not a key holder's: never takes room that a key holder's may need
            return None
        early = table.get(request_id)
        if early is None:
            if len(table) >= self.max_early:
                self.refused_total += 1
                return None
            early = table[request_id] = _Early(now)
        if early.count >= self.early_notes_per_request:
            self.refused_total += 1
            return None
        return early

    def abort(self, request_id: str, token: str, now: float) -> bool:
        """The reader will not read (or finish reading): free now. Of a request not held yet, kept until its hold
        comes (`early_ttl_s`); of one freed lately with this token, nothing to do. False for a wrong token, or
        nowhere to keep it."""
        entry = self._entries.get(request_id)
        if entry is None:
            if self.freed(request_id, token):
                return True
            early = self._early_aborts.get(request_id)
            if early is None or not any(_same(token, t) for t in early.aborts):  # a repeat is kept once
                early = self._early_room(self._early_aborts, request_id, token, now)
                if early is None:
                    return False
                early.aborts.append(token)
            early.seen = now  # kept early_ttl_s from its latest abort
            self._early_aborts.move_to_end(request_id)
            return True
        if not _same(entry.token, token):
            self.refused_total += 1
            return False
        self._free_aborted(request_id, entry)
        return True

    def _free_aborted(self, request_id: str, entry: _Entry) -> None:
        self._entries.pop(request_id, None)
        self._aborted.add(request_id)
        self._remember_freed(request_id, entry.token)
        self.aborted_total += 1

    def _note(self, entry: _Entry, token: str, engine: str, worker: str, expected: int) -> bool:
        if not _same(entry.token, token) or (entry.reader is not None and entry.reader != engine):
            self.refused_total += 1
            return False
        entry.reader = engine
        entry.readers.add(worker)
        entry.expected = max(entry.expected or 0, expected)  # one worker cannot lower what the others must send
        return True

    def _lapsed(self, entry: _Entry, now: float) -> bool:
        if entry.read_until is not None:
            return now >= entry.read_until
        return now >= entry.expiry

    def due(self, now: float) -> tuple[set[str], set[str]]:
        """(requests to free now: read by all readers or aborted, requests whose lease or read deadline passed);
        both are forgotten."""
        done, expired = self._aborted, set()
        self._aborted = set()
        for request_id, entry in list(self._entries.items()):
            if entry.expected is not None and len(entry.readers) >= entry.expected:
                done.add(request_id)
            elif self._lapsed(entry, now):
                expired.add(request_id)
            else:
                continue
            del self._entries[request_id]
            self._remember_freed(request_id, entry.token)
        for table in (self._early, self._early_aborts):
            while table and now - next(iter(table.values())).seen > self.early_ttl_s:
                table.popitem(last=False)
        self.completed_total += len(done)
        self.expired_total += len(expired)
        return done, expired

    @property
    def held(self) -> int:
        return len(self._entries)

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is held (whatever its state: a claim of it is answered now, never kept waiting)."""
        return request_id in self._entries

    def knows(self, request_id: str, token: str) -> bool:
        """Whether `request_id` is held with `token`, or was and was freed lately: its hold came already."""
        entry = self._entries.get(request_id)
        return (entry is not None and _same(entry.token, token)) or self.freed(request_id, token)

    def freed(self, request_id: str, token: str) -> bool:
        """Whether `request_id` was held here with `token` and freed lately (read, aborted or expired; the last
        `max_freed`): a claim of it is refused at once, never kept waiting for a hold. False for a wrong token: a
        claim without it is treated as one of a request never held (its answer says nothing of the request)."""
        kept = self._freed.get(request_id)
        return kept is not None and _same(kept, token)

    def _remember_freed(self, request_id: str, token: str) -> None:
        self._freed[request_id] = token
        self._freed.move_to_end(request_id)
        while len(self._freed) > self.max_freed:
            self._freed.popitem(last=False)

    def next_expiry(self) -> float | None:
        expiries = [e.read_until if e.read_until is not None else e.expiry for e in self._entries.values()]
        return min(expiries) if expiries else None
