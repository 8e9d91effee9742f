"""The scheduler-side half of the connector (vLLM's engine-core process): request bookkeeping only.

Decode role: accept a prefill instance's kv_transfer_params only for the prompt they were computed for (and,
with a deployment key, only as the prefill signed them, unexpired, once), before anything is connected or
allocated; otherwise prefill locally (kv_load_failure_policy=recompute) or fail the request at once without any
read (fail), and count why. Then ask vLLM for blocks and queue one load per request for the workers. Prefill
role: when a request asked for remote decode finishes, keep its blocks and answer with where they are, bound to
the prompt, with a secret token for the reader, signed.

A model with state (Mamba) moves the state after N-1 of a prompt's N tokens (`core.groups.computed_tokens`): the
prefill drops a remote-decode request's last prompt token when it arrives (`on_new_request`), and the params bind
the N-1 tokens it computed; the decode loads those and computes the last token itself.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvbridge.core.config import BridgeConfig, is_loopback
from kvbridge.core.errors import ParamsRefused, RequestParamsError
from kvbridge.core.groups import (
    check_remote_lists,
    computed_tokens,
    has_state,
    load_pairs,
    pair_lists,
    prefill_lists,
)
from kvbridge.core.token_runs import span_of
from kvbridge.runtime.decode_worker import LoadJob
from kvbridge.vllm.fingerprint import model_fingerprint
from kvbridge.vllm.metadata import KVBridgeMetadata
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.vllm_facts import advertised_host, cache_groups, engine_layout
from kvbridge.wire.hold_feed import HoldFeed, HoldNote
from kvbridge.wire.keys import load_keys, request_token
from kvbridge.wire.params import (
    PrefillDone,
    check_binding,
    kv_extras,
    parse_prefill_done,
    prompt_hash,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_warned_keyless: list[bool] = []


def _warn_keyless_consumer() -> None:
    """Once per process: a decode without a key reads only from loopback prefill instances."""
    if not _warned_keyless:
        _warned_keyless.append(True)
        logger.warning(
            "kvbridge: this decode instance has no auth key: kv_transfer_params are not verified, so it reads only "
            "from prefill instances on loopback (set auth_key_file in kv_connector_extra_config for remote ones)"
        )


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: BridgeConfig, kv_cache_config: KVCacheConfig | None = None):
        kv = vllm_config.kv_transfer_config
        self.config = config
        self.groups = cache_groups(kv_cache_config) if kv_cache_config is not None else ()
        """The KV-cache groups, when there are several (vLLM's hybrid KV-cache manager); else () (one group)."""
        if len(self.groups) == 1:
            self.groups = ()
        self.state = has_state(self.groups)
        """A group holds state (Mamba): N-1 prompt tokens are moved (`computed_tokens`)."""
        self._truncated: set[str] = set()  # prefill: requests whose last prompt token was dropped
        self.engine_id = str(kv.engine_id)
        self.layout, self.dp_rank = engine_layout(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = bool(kv.is_kv_producer)
        self.is_consumer = bool(kv.is_kv_consumer)
        config.check_role(self.is_producer, self.is_consumer)
        self.key = load_keys(config.auth_key, config.auth_key_file, config.auth_accepted_key_files)
        config.check_auth(self.key is not None)
        if self.is_producer:
            config.check_exposure(self.key is not None)  # refuses a non-loopback side channel without a key
        if self.is_consumer and self.key is None:
            _warn_keyless_consumer()
        self.model = model_fingerprint(vllm_config).digest
        """This engine's model fingerprint (`core.model_identity`): published in params, compared in theirs."""
        self.fail_refused = getattr(kv, "kv_load_failure_policy", "fail") == "fail"
        self.host = advertised_host(config)
        self._meta = KVBridgeMetadata()
        self._sources: dict[str, PrefillDone] = {}  # parsed once per request, between match and alloc
        self._refused: dict[str, ParamsRefused] = {}  # under policy fail: requests to fail without a read
        self._seen: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._refused_keys: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._stats = KVBridgeStats()
        self.feed = HoldFeed.open() if self.is_producer and config.hold_feed else None
        """Holds to this engine's workers as requests finish (`wire.hold_feed`), besides the metadata."""

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    def _moved(self, request: Request) -> int:
        """Prompt tokens a load of `request` covers (decode side): all, or N-1 with state."""
        return computed_tokens(self.groups, len(request.prompt_token_ids or ()))

    # -- prefill role (state) ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """With state (Mamba): a request asking for remote decode computes all but its last prompt token here, so
        that the published state covers N-1 tokens and the decode's recompute of the last one applies it once.
        vLLM's `Request` has no API to shorten a prompt: its token lists and count are cut in place, and it
        samples one token (from N-1 tokens; a prefill's sampled token is never used)."""
        params = request.kv_transfer_params
        if not (self.state and self.is_producer and wants_remote_decode(params)):
            return
        prompt = request.prompt_token_ids
        if prompt is None or len(prompt) < 2 or request.request_id in self._truncated:
            return  # prompt embeddings, or one token: nothing is published (request_finished)
        if getattr(request, "skip_reading_prefix_cache", False):
            return  # prompt logprobs: a decode computes the whole prompt
        del prompt[-1:]
        all_ids = getattr(request, "_all_token_ids", None)
        if all_ids is not None and all_ids is not prompt:
            del all_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        self._truncated.add(request.request_id)

    # -- decode role ---------------------------------------------------------------------------------

    def _source(self, request: Request) -> PrefillDone | None:
        """The request's validated prefill location, or None (then it is prefilled locally, or, under policy
        fail, `_refused` holds why it fails)."""
        params = request.kv_transfer_params
        if not (self.is_consumer and wants_remote_prefill(params)):
            return None
        cached = self._sources.get(request.request_id)
        if cached is not None:
            return cached
        source = None
        try:
            source = parse_prefill_done(params, self.config.max_remote_blocks)
            self._check(request, source)
        except RequestParamsError as exc:
            if source is not None:  # refused params must not be released either: they may be someone else's
                self._remember((source.remote_engine_id, source.remote_request_id), source, self._refused_keys)
            reason = exc.reason if isinstance(exc, ParamsRefused) else "malformed"
            self._stats.record_rejected(reason)
            fail = self.fail_refused and isinstance(exc, ParamsRefused)
            logger.warning(
                "kvbridge: request %s %s: %s", request.request_id, "fails" if fail else "prefills locally", exc
            )
            if fail:
                self._refused[request.request_id] = exc
                return None
            params["do_remote_prefill"] = False
            return None
        key = (source.remote_engine_id, source.remote_request_id)
        self._seen[key] = (request.request_id, source.remote_expires or time.time() + 2 * self.config.lease_s)
        while len(self._seen) > self.config.max_seen_params:
            self._seen.popitem(last=False)
        self._sources[request.request_id] = source
        return source

    def _remember(self, key: tuple[str, str], source: PrefillDone, book: OrderedDict) -> None:
        book[key] = ("", source.remote_expires or time.time() + 2 * self.config.lease_s)
        while len(book) > self.config.max_seen_params:
            book.popitem(last=False)

    def _check(self, request: Request, source: PrefillDone) -> None:
        """Everything that can be known before a connection: the params are this prompt's, signed, fresh, used
        once, with sane sizes (ParamsRefused otherwise)."""
        if self.key is None and not is_loopback(source.remote_host):
            # Unsigned params name any address: a keyless decode would connect where a client says and trust
            # whatever answers there (another user's KV, SSRF). Only a key lets it trust a remote prefill.
            raise ParamsRefused(
                "address", f"remote_host {source.remote_host!r} is not loopback and this decode has no auth key"
            )
        now = time.time()
        check_binding(
            source,
            (request.prompt_token_ids or ())[: self._moved(request)],
            key=self.key,
            now=now,
            max_workers=self.config.max_remote_workers,
            window_s=self.config.auth_window_s,
            check_prompt=self.config.check_prompt,
            extras=kv_extras(request),
            model=self.model,
        )
        while self._seen and next(iter(self._seen.values()))[1] + self.config.auth_window_s < now:
            self._seen.popitem(last=False)
        seen = self._seen.get((source.remote_engine_id, source.remote_request_id))
        if seen is not None and seen[0] != request.request_id:
            raise ParamsRefused("replayed", f"kv_transfer_params of {source.remote_request_id} were used already")
        remote_size = source.remote_block_size or self.block_size
        if self.groups or source.remote_group_block_ids:
            if remote_size != self.block_size:
                raise ParamsRefused(
                    "blocks", f"remote_block_size {remote_size} differs from {self.block_size} with KV-cache groups"
                )
            if not self.groups:
                raise ParamsRefused("blocks", "remote_group_block_ids: several KV-cache groups, this engine has one")
            try:
                check_remote_lists(self.groups, source.group_block_ids, self._moved(request))
            except RequestParamsError as exc:
                raise ParamsRefused("blocks", str(exc)) from None
            return
        needed = -(-len(request.prompt_token_ids or ()) // remote_size)
        if not needed <= len(source.remote_block_ids) <= needed + 1:
            raise ParamsRefused(
                "blocks", f"remote_block_ids has {len(source.remote_block_ids)} blocks, the prompt needs {needed}"
            )

    def _release_source(self, params: dict[str, Any]) -> PrefillDone | None:
        """Where to send a release (an Abort with the params' token): only params the prefill signed (with a key),
        since a release goes to the address they name. No prompt check: nothing is read."""
        try:
            source = parse_prefill_done(params, self.config.max_remote_blocks)
        except RequestParamsError:
            return None
        if self.key is not None and not source.verify(self.key):
            return None
        if self.key is None and not is_loopback(source.remote_host):
            return None
        layout = source.layout
        if layout.dp * layout.workers_per_engine > self.config.max_remote_workers:
            return None
        if (source.remote_engine_id, source.remote_request_id) in self._refused_keys:
            return None  # refused here (another prompt's, a replay): its owner may still read it
        return source

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens a load brings beyond those computed here: all of them, or with state all but the
        last (the decode computes it on top of the loaded state: `computed_tokens`)."""
        if self._source(request) is None:
            if request.request_id in self._refused:  # policy fail: a load that fails at once, reading nothing
                count = max(self._moved(request), 1) - num_computed_tokens
                return (count, True) if count > 0 else (0, False)
            return 0, False
        count = self._moved(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        refused = self._refused.pop(request.request_id, None)
        if refused is not None:
            request.kv_transfer_params["do_remote_prefill"] = False
            self._meta.loads.append(LoadJob(request.request_id, None, (), (), refused=str(refused)))
            return
        source = self._source(request)
        if source is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request
        self._sources.pop(request.request_id, None)
        if self.groups:
            self._load_groups(request, source, blocks, num_external_tokens)
            return
        block_ids = blocks.get_block_ids()[0]
        prompt = len(request.prompt_token_ids or ())
        remote_size = source.remote_block_size or self.block_size
        if remote_size != self.block_size:  # the prompt's tokens from the first uncached one, not block pairs
            src, dst, span = span_of(prompt, prompt - num_external_tokens, remote_size, self.block_size)
            local, remote = tuple(block_ids[dst.start : dst.stop]), tuple(source.remote_block_ids[src.start : src.stop])
            self._meta.loads.append(
                LoadJob(request.request_id, source, (local,), (remote,), span=span, remote_block_size=remote_size)
            )
            return
        first = (prompt - num_external_tokens) // self.block_size  # blocks already cached here
        last = -(-prompt // self.block_size)
        local = tuple(block_ids[first:last])
        remote = tuple(source.remote_block_ids[first:last])
        self._meta.loads.append(LoadJob(request.request_id, source, (local,), (remote,)))

    def _load_groups(self, request: Request, source: PrefillDone, blocks: KVCacheBlocks, num_external: int) -> None:
        """Several KV-cache groups: each group's blocks the decode's manager holds (not null) from the prompt's
        first uncached block on, paired with the prefill's at the same position: one job of per-group lists.
        A block needed here that the prefill no longer holds fails the load (and frees the prefill's blocks)."""
        local = blocks.get_block_ids()
        prompt = self._moved(request)
        try:
            pairs = [
                load_pairs(group, local[i], remote, prompt, group.first_block(prompt - num_external))
                for i, (group, remote) in enumerate(zip(self.groups, source.group_block_ids, strict=True))
            ]
            remote_ids, local_ids = pair_lists(pairs)
        except RequestParamsError as exc:
            logger.warning("kvbridge: request %s: its blocks cannot be loaded: %s", request.request_id, exc)
            self._meta.loads.append(LoadJob(request.request_id, None, (), (), refused=str(exc)))
            self._meta.releases.append(LoadJob(request.request_id, source, (), (), report=False))
            return
        self._meta.loads.append(LoadJob(request.request_id, source, local_ids, remote_ids))

    # -- both roles ----------------------------------------------------------------------------------

    def build_connector_meta(self) -> KVBridgeMetadata:
        meta, self._meta = self._meta, KVBridgeMetadata()
        if self.feed is not None:
            meta.hold_feed = self.feed.address
        return meta

    def tell_workers_dead(self, dead: dict[tuple, str]) -> None:
        """Prefill engines a worker found gone or unreachable: in the next step's metadata, for every worker."""
        self._meta.dead.update(dead)

    def take_stats(self) -> KVBridgeStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVBridgeStats()
        return out

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV-cache manager hands every group's blocks; with one group, `request_finished`."""
        if not self.groups:
            return self.request_finished(request, block_ids[0] if block_ids else [])
        return self.request_finished(request, [b for ids in block_ids for b in ids], all_groups=block_ids)

    def request_finished(
        self, request: Request, block_ids: list[int], all_groups: tuple[list[int], ...] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """`all_groups`: each KV-cache group's blocks (several groups; `block_ids` is then only tested for being
        empty); the params then carry per group its prompt blocks without the null blocks."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if self.is_consumer and wants_remote_prefill(params):
            # Finished (aborted, or rejected by vLLM's front end: a pre-aborted one-token request carrying the
            # params) before its load was scheduled: the prefill side still holds the blocks; free them now.
            source = self._sources.pop(request.request_id, None) or self._release_source(params)
            self._refused.pop(request.request_id, None)
            params["do_remote_prefill"] = False
            if source is not None:
                self._meta.releases.append(LoadJob(request.request_id, source, (), (), report=False))
            return False, None
        if not (self.is_producer and wants_remote_decode(params)):
            return False, None
        if self.state and request.request_id not in self._truncated:
            return False, None  # its state covers every prompt token: a decode would apply the last one twice
        self._truncated.discard(request.request_id)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        prompt = request.prompt_token_ids
        if not block_ids or prompt is None or request.num_computed_tokens < len(prompt):
            return False, None  # nothing held, or no token ids to bind the KV to (prompt embeddings)
        group_lists: list[list[int]] = []
        if all_groups is not None:
            try:
                group_lists = prefill_lists(self.groups, all_groups, len(prompt))
            except RequestParamsError as exc:
                logger.warning("kvbridge: request %s: its KV is not published: %s", request.request_id, exc)
                return False, None
            block_ids = []
        now = time.time()
        done = PrefillDone(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=list(block_ids),
            remote_group_block_ids=group_lists,
            remote_host=self.host,
            remote_port=self.config.side_channel_port,
            remote_dp_rank=self.dp_rank,
            remote_layout=str(self.layout),
            remote_num_tokens=len(prompt),
            remote_block_size=self.block_size,
            tp_size=self.layout.tp,
            pp_size=self.layout.pp,
            remote_prompt_hash=prompt_hash(prompt, kv_extras(request)),
            remote_token=secrets.token_hex(16)
            if self.key is None
            else request_token(self.key, self.engine_id, request.request_id, secrets.token_bytes(8)),
            remote_expires=round(now + self.config.lease_s, 3),
            remote_model=self.model,
            remote_issued=round(now, 3) - 0.001,  # rounded down: never after the true time
        )
        if self.key is not None:
            done = done.signed(self.key)
        held = tuple(tuple(ids) for ids in done.group_block_ids)  # per group, as decode workers claim them
        hold = (request.request_id, held, done.remote_token, done.remote_prompt_hash, time.monotonic())
        self._meta.holds.append(hold)
        if self.feed is not None:  # the workers hold it now: the metadata brings it only a step or two later
            self.feed.send(HoldNote(*hold))
        return True, done.to_dict()
