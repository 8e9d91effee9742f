"""Where one sub-request goes: which decode instance, whether a prefill leg first (and on which prefill instance),
and why, in one `Route` whose `line()` explains it (pure: the balancer's counts, the prefix indexes, the costs;
the caller passes the clock).

Picking an instance of a kind (`routing`):
- `least_loaded`: the balancer's choice (fewest outstanding requests, then the least recently picked).
- `cache_aware`: the instance whose prefix index holds the longest prefix of the prompt, as long as its outstanding
  requests exceed the least loaded instance's by at most `max_imbalance` (so one hot prefix cannot pile onto one
  instance); ties and no match at all: the least loaded. With `sticky` (the default) any held prefix keeps a
  conversation where it is within that bound; without it a held prefix only breaks ties between instances
  equally loaded.

Deciding the path (`disaggregation`): `always` sends every sub-request through a prefill instance; `selective`
estimates the tokens the chosen decode instance would compute itself (the prompt less the prefix it likely holds)
and sends the request straight to it when that is below the threshold (`direct_below_tokens`, or learned:
costs.py, which weighs what the prefill instance the request would go to lacks of the prompt). With the learned
threshold, a decode instance running nothing serves the request itself when the prefill instance holds no more of
the prompt than it does (`decode_idle`): the prefill would compute as much, plus the hop and the transfer. A
request vLLM would not read transferred KV for (prompt logprobs) goes straight to the decode instance in every mode.
Straight to the decode is the client's sub-request unchanged, so the choice never changes an output.

Every instance a request is routed to learns the prompt's blocks: the decode instance of either path, the prefill
instance of a disaggregated one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.serving.proxy.balancer import DECODE, PREFILL, Backend, Balancer, NoBackendError
from kvbridge.serving.proxy.config import ProxyConfig
from kvbridge.serving.proxy.costs import CostLearner
from kvbridge.serving.proxy.prefix_index import PrefixIndex, PromptBlocks, prompt_blocks

DIRECT = "direct"
DISAGGREGATED = "disaggregated"
DIRECT_REASONS = ("below_threshold", "decode_idle", "no_prefill", "prompt_logprobs")
"""Reasons a sub-request goes straight to its decode instance."""


@dataclass(frozen=True)
class Pick:
    """One instance chosen for a leg, and why."""

    backend: Backend
    held_tokens: int
    """Tokens of the prompt the instance likely holds (its prefix index)."""
    why: str
    """`prefix` (it holds the longest prefix), `least_loaded` (no better holder), `overloaded` (a holder was over
    `max_imbalance`), `balancer` (least_loaded routing)."""

    def describe(self) -> str:
        return f"{self.backend.name}({self.why}, held {self.held_tokens})"


@dataclass
class Work:
    """Tokens routed to an instance for it to compute, counted in its queue until settled."""

    backend: Backend
    tokens: int
    open: bool = True


@dataclass(frozen=True)
class Route:
    decode: Pick
    prefill: Pick | None
    """None: straight to the decode instance."""
    prompt_tokens: int
    new_tokens: int
    """Tokens the decode instance would compute itself (the prompt less what it holds)."""
    threshold: float | None
    """Below it: direct (for the prefill instance picked, or the least loaded one when direct). None when not
    deciding (`always`, prompt logprobs)."""
    prefill_new: int | None
    """Tokens the prefill instance would compute (the prompt less what it holds); None when not deciding."""
    reason: str
    """below_threshold, decode_idle, at_or_above_threshold, always, prompt_logprobs."""
    costs: str
    queued: int = 0
    """Tokens queued ahead of this request at the instance that computes it (the prefill instance when
    disaggregated, else the decode instance): routed there and not computed yet."""
    work: Work | None = None
    """This request's own tokens in that instance's queue, until `Router.settle`."""

    @property
    def computed_first(self) -> int:
        """Tokens the instance computing the request computes before its first token: those queued ahead of it
        and its own."""
        return self.queued + (self.work.tokens if self.work is not None else 0)

    @property
    def path(self) -> str:
        return DIRECT if self.prefill is None else DISAGGREGATED

    def line(self) -> str:
        """The decision in one log line."""
        threshold = "-" if self.threshold is None else f"{self.threshold:.0f}"
        prefill_new = "" if self.prefill_new is None else f" prefill_new={self.prefill_new}"
        prefill = "" if self.prefill is None else f" prefill={self.prefill.describe()}"
        return (
            f"path={self.path} reason={self.reason} decode={self.decode.describe()}{prefill} "
            f"prompt={self.prompt_tokens} new={self.new_tokens}{prefill_new} threshold={threshold} "
            f"queued={self.queued} running={self.decode.backend.outstanding - 1} [{self.costs}]"
        )


class Router:
    def __init__(self, config: ProxyConfig, balancer: Balancer) -> None:
        self.config = config
        self.balancer = balancer
        self.learner = CostLearner()
        self.indexes = {b: PrefixIndex(config.prefix_index_blocks, config.prefix_ttl_s) for b in balancer.backends()}
        self.queued = dict.fromkeys(balancer.backends(), 0)
        """Per instance, the tokens routed to it for computing whose compute has not ended (`settle`)."""

    def threshold(self, ahead: int = 0) -> float | None:
        """The current threshold when the prefill instance would compute `ahead` tokens more than the decode
        instance before the request's first token (costs.py; None: `always`)."""
        cfg = self.config
        if cfg.disaggregation == "always":
            return None
        if cfg.direct_below_tokens is not None:
            return float(cfg.direct_below_tokens)
        learned = self.learner.costs.threshold(ahead)
        return float(cfg.direct_initial_tokens) if learned is None else learned

    def route(self, body: Mapping[str, Any], chat: bool, now: float, force_direct: bool = False) -> Route:
        """Choose and count (`Balancer.take`) the decode instance and, unless direct, the prefill instance; the
        caller releases each, and settles the route (`settle`) once the compute it queued has ended. NoBackendError
        when a kind needed has none up (nothing is counted then)."""
        cfg = self.config
        blocks = prompt_blocks(body, chat, cfg.prefix_block_tokens)
        decode = self._pick(DECODE, blocks, now)
        new = blocks.tokens - decode.held_tokens
        queued_decode = self.queued[decode.backend]
        prefill: Pick | None = None
        threshold = prefill_new = None
        if force_direct:
            reason = "prompt_logprobs"
        elif cfg.disaggregation == "always":
            reason = "always"
        else:
            try:
                prefill = self._pick(PREFILL, blocks, now)
            except NoBackendError:
                prefill = None  # no prefill instance up: only a direct decision can be served
            prefill_new = blocks.tokens - (prefill.held_tokens if prefill is not None else 0)
            queued_prefill = self.queued[prefill.backend] if prefill is not None else 0
            threshold = self.threshold(queued_prefill + prefill_new - queued_decode)
            learned = cfg.direct_below_tokens is None
            if learned and queued_decode == 0 and decode.backend.outstanding == 0 and new <= prefill_new:
                reason = "decode_idle"
            elif new < threshold:
                reason = "below_threshold"
            else:  # no prefill instance up: the decode instance serves it (the same output), not a 503
                reason = "at_or_above_threshold" if prefill is not None else "no_prefill"
        if reason in DIRECT_REASONS:
            prefill = None
        elif prefill is None:
            prefill = self._pick(PREFILL, blocks, now)  # raises before anything is counted
        self.balancer.take(decode.backend)
        self.indexes[decode.backend].add(blocks.keys, now)
        if prefill is not None:
            self.balancer.take(prefill.backend)
            self.indexes[prefill.backend].add(blocks.keys, now)
            work = Work(prefill.backend, blocks.tokens - prefill.held_tokens)
        else:
            work = Work(decode.backend, new)
        queued = self.queued[work.backend]
        self.queued[work.backend] += work.tokens
        costs = self.learner.costs.describe()
        return Route(decode, prefill, blocks.tokens, new, threshold, prefill_new, reason, costs, queued, work)

    def settle(self, route: Route) -> None:
        """The compute `route` queued has ended (its prefill leg returned, its first token came, or it failed):
        its tokens leave the instance's queue. Idempotent."""
        work = route.work
        if work is not None and work.open:
            work.open = False
            self.queued[work.backend] -= work.tokens

    def _pick(self, kind: str, blocks: PromptBlocks, now: float) -> Pick:
        least = self.balancer.pick(kind)  # NoBackendError when none is up
        if self.config.routing == "least_loaded":
            return Pick(least, self._held(least, blocks, now), "balancer")
        held = {b: self._held(b, blocks, now) for b in self.balancer.up(kind)}
        best = max(held.values())
        if best == 0:
            return Pick(least, 0, "least_loaded")
        bound = least.outstanding + self.config.max_imbalance
        if not self.config.sticky:
            bound = least.outstanding
        holders = [b for b in held if held[b] == best]
        fit = [b for b in holders if b.outstanding <= bound]
        if not fit:
            return Pick(least, held[least], "overloaded")
        chosen = min(fit, key=lambda b: (b.outstanding, b.last_pick, b.index))
        return Pick(chosen, best, "prefix")

    def _held(self, backend: Backend, blocks: PromptBlocks, now: float) -> int:
        return blocks.held_tokens(self.indexes[backend].match(blocks.keys, now))


__all__ = ["DIRECT", "DISAGGREGATED", "NoBackendError", "Pick", "Route", "Router", "Work"]
