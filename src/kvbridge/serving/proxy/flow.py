"""The PD flow of one client request: each sub-request (fanout.py) is routed (router.py: logged and counted) either
straight to a decode instance, unchanged, or through a prefill leg, then a decode leg carrying that prefill's
kv_transfer_params; the sub-requests run concurrently and their replies become the client's (reassembly.py).

- One sub-request: the decode reply is passed through as it arrives (SSE chunk by chunk, or the JSON).
- Several, not streamed: all must succeed; the first failure is the client's error and cancels the others.
- Several, streamed: the sub-streams are merged as their chunks arrive. The reply starts once every sub-stream
  has begun (a decode server refuses a request before its first chunk), so a refusal is a proper HTTP error;
  a failure after that is an error event and `[DONE]`.

Every prefill that succeeded and whose decode leg did not read its KV (failed, cancelled, never sent) is released
at once (releases.py). Backend counts: a sub-request takes one prefill and one decode backend before its prefill
leg, so that no prefill runs (and holds KV) while no decode backend is up. The router's queues (router.py) hold a
sub-request's tokens until its prefill leg returns or its first chunk comes (else until the client's request ends);
the prefill legs' durations and the first chunks teach it the costs (costs.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbridge.serving.proxy.balancer import DECODE, PREFILL, Backend, NoBackendError
from kvbridge.serving.proxy.call import Call, close_shielded
from kvbridge.serving.proxy.errors import LegFailed, error_json
from kvbridge.serving.proxy.fanout import Plan, SubRequest, decode_body, prefill_body
from kvbridge.serving.proxy.legs import Upstream
from kvbridge.serving.proxy.reassembly import DONE, BadReply, StreamMerger, merge_replies
from kvbridge.serving.proxy.releases import Hold, Releaser
from kvbridge.serving.proxy.router import Route, Router

if TYPE_CHECKING:
    import httpx

SSE = "text/event-stream"
log = logging.getLogger("kvbridge.serving.proxy")


class Flow:
    def __init__(self, upstream: Upstream, releaser: Releaser, router: Router) -> None:
        self.upstream = upstream
        self.releaser = releaser
        self.router = router
        self.balancer = upstream.balancer
        self.metrics = upstream.metrics
        self.config = upstream.config

    async def run(self, call: Call, plan: Plan) -> None:
        try:
            if plan.single:
                await self._single(call, plan.subs[0], plan)
            elif plan.stream:
                await self._merged_stream(call, plan)
            else:
                await self._merged_json(call, plan)
        except LegFailed as failure:
            await call.reply(failure.status, failure.body, failure.content_type)
        finally:  # whatever ended the request, nothing it queued is left in the router's queues
            for route in call.queued.values():
                self.router.settle(route)
            call.queued.clear()

    # the legs of one sub-request

    async def _begin(self, call: Call, sub: SubRequest, plan: Plan) -> tuple[dict[str, Any] | None, Backend]:
        """Route the sub-request (router.py: logged and counted) and run its prefill leg unless it goes straight to
        the decode instance. Returns the prefill's params (None: straight to the decode) and the decode backend,
        whose count the caller then owns. A streamed sub-request's first token teaches the costs
        (`_first_token`)."""
        try:
            route = self.router.route(sub.body, call.chat, time.monotonic(), force_direct=plan.direct)
        except NoBackendError as exc:
            raise LegFailed(503, error_json(503, "service_unavailable", str(exc))) from None
        call.queued[sub.index] = route  # first: whatever happens next, the request's queued tokens are settled
        self._account(call, sub, route)
        call.routed[sub.index] = (route, time.monotonic())
        decode = route.decode.backend
        if route.prefill is None:
            return None, decode
        started = time.monotonic()
        try:
            body = prefill_body(sub.body, call.chat)
            params = await self.upstream.prefill(route.prefill.backend, call.path, call.headers, body)
        except BaseException:
            self.balancer.release(decode)
            raise
        finally:
            self._settle(call, sub)
        self.router.learner.prefill_leg(time.monotonic() - started, route.computed_first)
        return params, decode

    def _settle(self, call: Call, sub: SubRequest) -> None:
        """The compute the sub-request queued has ended (or will not happen): out of the router's queues."""
        route = call.queued.pop(sub.index, None)
        if route is not None:
            self.router.settle(route)

    def _first_token(self, call: Call, sub: SubRequest) -> None:
        """A sub-request's first chunk arrived: its compute has ended; streamed, its time from routing, by path, to
        the learner."""
        self._settle(call, sub)
        routed = call.routed.pop(sub.index, None)
        if routed is None or not call.stream:
            return
        route, started = routed
        self.router.learner.first_token(route.path, time.monotonic() - started, route.computed_first, route.new_tokens)

    def _account(self, call: Call, sub: SubRequest, route: Route) -> None:
        """Every decision is logged (one line that explains it) and counted."""
        log.info("route %s choice %d: %s", call.request_id, sub.index, route.line())
        self.metrics.decisions.labels(route.path, route.reason).inc()
        picks = [(DECODE, route.decode)] + ([] if route.prefill is None else [(PREFILL, route.prefill)])
        for kind, pick in picks:
            self.metrics.routed.labels(kind, pick.backend.name, pick.why).inc()
            self.metrics.held_tokens.labels(kind).inc(pick.held_tokens)
        self.metrics.prompt_tokens.labels(route.path).inc(route.prompt_tokens)

    async def _decode(self, call: Call, decode: Backend, body: dict[str, Any]) -> tuple[Backend, httpx.Response]:
        return await self.upstream.leg(DECODE, decode, call.path, call.headers, body, self.config.decode_timeout_s)

    def _hold(
        self, call: Call, sub: SubRequest, params: dict[str, Any] | None
    ) -> contextlib.AbstractContextManager[Hold]:
        if params is None:  # straight to the decode: no prefill KV to release
            return contextlib.nullcontext(Hold({}))
        return self.releaser.hold(params, f"request {call.request_id} choice {sub.index}")

    @staticmethod
    def _decode_body(sub: SubRequest, params: dict[str, Any] | None) -> dict[str, Any]:
        """The decode leg's body: the sub-request itself when it goes straight to the decode instance."""
        return sub.body if params is None else decode_body(sub.body, params)

    # one sub-request: passed through

    async def _single(self, call: Call, sub: SubRequest, plan: Plan) -> None:
        params, decode = await self._begin(call, sub, plan)
        started = time.monotonic()
        with self._hold(call, sub, params) as held:
            backend, resp = await self._decode(call, decode, self._decode_body(sub, params))
            try:
                await self._relay(call, backend, resp, held, lambda: self._first_token(call, sub))
            finally:
                self.balancer.release(backend)
                await close_shielded(resp)
        if call.done and call.status < 300:
            self.metrics.leg_seconds.labels(DECODE).observe(time.monotonic() - started)

    async def _relay(
        self, call: Call, backend: Backend, resp: httpx.Response, held: Hold, first_token: Callable[[], None]
    ) -> None:
        """The decode reply to the client: chunk by chunk when streaming, whole otherwise."""
        import anyio
        import httpx

        content_type = resp.headers.get("content-type", "application/json")
        timeout = self.config.decode_timeout_s
        if not call.stream:
            held.consumed = True  # vLLM answers a request that is not streamed when it is done
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self.upstream.transport_failure(DECODE, backend, exc, timeout) from None
            self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
            await call.reply(resp.status_code, content, content_type)
            return
        chunks = resp.aiter_raw()
        try:
            try:  # the first chunk before the status: a decode leg failing this early still gets a proper error
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError as exc:
                raise self.upstream.transport_failure(DECODE, backend, exc, timeout) from None
            held.consumed = bool(first)
            first_token()
            await call.start_stream(resp.status_code, content_type)
            self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
            try:
                await call.write(first)
                async for chunk in chunks:
                    await call.write(chunk)
            except httpx.TransportError as exc:  # the reply has begun: end it with an error event
                failure = self.upstream.transport_failure(DECODE, backend, exc, timeout)
                await call.end(b"data: " + failure.body + b"\n\n")
                return
            await call.end()
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    # several sub-requests, not streamed

    async def _merged_json(self, call: Call, plan: Plan) -> None:
        import anyio

        replies: list[Any] = [None] * len(plan.subs)
        failures: list[LegFailed] = []

        async def one(sub: SubRequest, scope: anyio.CancelScope) -> None:
            try:
                replies[sub.index] = await self._sub_json(call, sub, plan)
            except LegFailed as failure:
                failures.append(failure)
                scope.cancel()  # the client gets this error: the siblings' work is for nothing

        async with anyio.create_task_group() as tasks:
            for sub in plan.subs:
                tasks.start_soon(one, sub, tasks.cancel_scope)
        if failures:
            raise failures[0]
        try:
            merged = merge_replies(plan, replies)
        except BadReply as exc:
            raise LegFailed(502, error_json(502, "bad_gateway", f"a decode backend's reply: {exc}")) from None
        self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
        await call.reply(200, json.dumps(merged, ensure_ascii=False).encode())

    async def _sub_json(self, call: Call, sub: SubRequest, plan: Plan) -> Any:
        import httpx

        params, decode = await self._begin(call, sub, plan)
        started = time.monotonic()
        with self._hold(call, sub, params) as held:
            backend, resp = await self._decode(call, decode, self._decode_body(sub, params))
            held.consumed = True
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self.upstream.transport_failure(DECODE, backend, exc, self.config.decode_timeout_s) from None
            finally:
                self.balancer.release(backend)
                await close_shielded(resp)
        self.metrics.leg_seconds.labels(DECODE).observe(time.monotonic() - started)
        try:
            return json.loads(content)
        except (ValueError, RecursionError):
            self.metrics.leg_failures.labels(DECODE, backend.name, "bad_reply").inc()
            msg = f"{backend.name} answered choice {sub.index} with a body that is not JSON"
            raise LegFailed(502, error_json(502, "bad_gateway", msg, backend.name)) from None

    # several sub-requests, streamed

    async def _merged_stream(self, call: Call, plan: Plan) -> None:
        import anyio

        merger = StreamMerger(plan)
        send, receive = anyio.create_memory_object_stream[tuple[int, Any]](len(plan.subs))
        begun: set[int] = set()  # sub-streams that sent their first chunk (or ended)
        early = bytearray()  # the merged stream until every sub-stream has begun
        async with anyio.create_task_group() as tasks:
            try:
                for sub in plan.subs:
                    tasks.start_soon(self._sub_stream, call, sub, plan, send.clone())
                send.close()
                async with receive:
                    async for k, item in receive:
                        if isinstance(item, LegFailed):
                            await self._fail_stream(call, item)
                            return
                        begun.add(k)
                        early += merger.end(k) if item is None else merger.feed(k, item)
                        if merger.failed or len(begun) == len(plan.subs):
                            await self._write(call, bytes(early))
                            early.clear()
                        if merger.failed:  # an error event went out
                            await call.end(DONE)
                            return
                await self._write(call, bytes(early))
                await call.end(merger.finish())
            finally:
                tasks.cancel_scope.cancel()

    async def _sub_stream(self, call: Call, sub: SubRequest, plan: Plan, send: Any) -> None:
        """Sub-stream `sub`'s chunks into `send` as (index, bytes), then (index, None); or (index, LegFailed)."""
        import anyio
        import httpx

        async with send:
            try:
                params, decode = await self._begin(call, sub, plan)
                started = time.monotonic()
                with self._hold(call, sub, params) as held:
                    backend, resp = await self._decode(call, decode, self._decode_body(sub, params))
                    chunks = resp.aiter_raw()
                    try:
                        async for chunk in chunks:
                            if chunk:
                                if not held.consumed:
                                    self._first_token(call, sub)
                                held.consumed = True
                                await send.send((sub.index, chunk))
                    except httpx.TransportError as exc:
                        timeout = self.config.decode_timeout_s
                        raise self.upstream.transport_failure(DECODE, backend, exc, timeout) from None
                    finally:
                        with anyio.CancelScope(shield=True):
                            await chunks.aclose()
                        self.balancer.release(backend)
                        await close_shielded(resp)
                self.metrics.leg_seconds.labels(DECODE).observe(time.monotonic() - started)
                await send.send((sub.index, None))
            except LegFailed as failure:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await send.send((sub.index, failure))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the merge is over (it failed or the client left)

    async def _write(self, call: Call, data: bytes) -> None:
        if not call.started:
            await call.start_stream(200, SSE)
            self.metrics.first_byte_seconds.observe(time.monotonic() - call.arrived)
        if data:
            await call.write(data)

    async def _fail_stream(self, call: Call, failure: LegFailed) -> None:
        if not call.started:
            await call.reply(failure.status, failure.body, failure.content_type)
            return
        body = failure.body
        if not failure.content_type.startswith("application/json"):
            body = error_json(failure.status, "bad_gateway", f"a decode backend answered HTTP {failure.status}")
        await call.end(b"data: " + body.strip() + b"\n\n" + DONE)
