"""vLLM servers shared by the end-to-end modules of one pytest run, keyed by their configuration.

A module asks for a layout (`ServerPool.layout`, the arguments of `e2e_support.layout_servers`); every server
whose configuration (model, parallel sizes, cores, vLLM arguments, connector config without its port, server
options) equals an idle one's is reused, the others are started. Leaving the `with` block hands the servers back
idle instead of stopping them, so that the next module finds them ready if it asks for the same configuration.

Idle servers hold their KV cache in memory and their workers sit on the cores the next servers are bound to, so
they are kept only for the next pooled module: idle servers a layout does not take are stopped before it starts
its own (`release_idle`), as they are before a module that starts servers outside the pool (tests/e2e/conftest.py),
and beyond `max_idle_workers` worker processes, least recently used first. A server that died or stopped
answering is never handed out again; every server is stopped when the run ends (`close`).

Modules whose tests kill, restart or reconfigure their servers start their own instead (`running`).
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvbridge.serving.launcher import VllmServer, stop_all
from support.e2e_support import FOUR, Place, layout_servers

PORT_FIELDS = ("side_channel_port",)
"""Connector fields that differ between two otherwise equal servers (chosen free at construction)."""


def server_key(model: Path, place: Place, args: tuple[str, ...], kv: Mapping[str, Any], server: Mapping) -> str:
    """What makes two servers interchangeable, as one string."""
    kv = {k: v for k, v in kv.items() if k not in PORT_FIELDS}
    fields = [str(model), place.pp, place.tp, place.cores, [*args, *place.args], kv, dict(server)]
    return json.dumps(fields, sort_keys=True, default=str)


class ServerPool:
    """Running vLLM servers by configuration: leased to one module at a time, idle in between."""

    def __init__(self, root: Path, max_idle_workers: int = 8) -> None:
        self.root = root
        self.max_idle_workers = max_idle_workers
        self._idle: OrderedDict[str, VllmServer] = OrderedDict()  # least recently used first
        self._leased: dict[str, VllmServer] = {}
        self.started = 0  # servers started, for the run's summary
        self.reused = 0

    @contextlib.contextmanager
    def layout(
        self,
        model: Path,
        places: Mapping[str, Place] = FOUR,
        prefix: str = "",
        args: tuple[str, ...] = (),
        kv: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
        **server: Any,
    ) -> Iterator[dict[str, VllmServer]]:
        """The layout's servers by place name, running (`layout_servers` for the arguments)."""
        extra = {"lease_s": 30.0, **(kv or {})}
        keys = {name: server_key(model, p, args, {**extra, **p.kv}, server) for name, p in places.items()}
        if len(set(keys.values())) < len(keys):
            raise ValueError(f"two places of one layout have the same configuration: {sorted(places)}")
        taken = {name: self._take(key) for name, key in keys.items()}
        self.release_idle()  # what this layout does not take would only compete with it for cores and memory
        missing = {name: p for name, p in places.items() if taken[name] is None}
        fresh = layout_servers(model, self.root, missing, prefix, args, kv, **server) if missing else {}
        servers = {name: taken[name] or fresh[name] for name in places}
        for name in places:
            self._leased[keys[name]] = servers[name]
        ok = False
        try:
            self._start(list(fresh.values()), timeout)
            ok = True
            yield servers
        finally:
            for name in places:
                self._give_back(keys[name], servers[name], healthy=ok)

    def release_idle(self) -> None:
        """Stop every idle server."""
        servers = list(self._idle.values())
        self._idle.clear()
        stop_all(servers)

    def close(self) -> None:
        """Stop every server (idle or still leased)."""
        servers = [*self._idle.values(), *self._leased.values()]
        self._idle.clear()
        self._leased.clear()
        stop_all(servers)

    # -- internals ------------------------------------------------------------------------------------

    def _take(self, key: str) -> VllmServer | None:
        if key in self._leased:
            raise RuntimeError("a server is leased twice: two fixtures hold the same configuration at once")
        server = self._idle.pop(key, None)
        if server is None:
            return None
        if server.process is None or server.process.poll() is not None or not server.is_healthy(timeout=5.0):
            server.stop()
            return None
        self.reused += 1
        return server

    def _start(self, servers: list[VllmServer], timeout: float) -> None:
        for server in servers:
            server.start()
            self.started += 1
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            list(pool.map(lambda s: s.wait_ready(timeout), servers))

    def _give_back(self, key: str, server: VllmServer, healthy: bool) -> None:
        self._leased.pop(key, None)
        if not healthy or server.process is None or server.process.poll() is not None:
            server.stop()
            return
        self._idle[key] = server
        while sum(s.num_workers for s in self._idle.values()) > self.max_idle_workers:
            _, oldest = self._idle.popitem(last=False)
            oldest.stop()
