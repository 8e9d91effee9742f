"""The project's own test hosts: network namespaces joined by veth pairs to a bridge, made and removed here.

    root namespace (the test client, the proxy): bridge <tag>br at 10.77.0.1/24
      └─ veth ─ namespace <tag>-<name>: device <tag>n<i> at 10.77.0.<10+i>/24, its own loopback

Only these addresses are used; everything is removed on exit, also on failure. Needs root and iproute2.

A READ in flight, shown rather than hoped: `slowed` limits the path to a host (tc tbf on its link's root side, so a
300-token READ of the tiny model takes seconds), and `when_sent` acts once a byte counter of a link has grown by a
given amount (`Host.tx_bytes`: sent by the host; `Host.rx_bytes`: delivered to it).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    device: str  # inside the namespace
    link: str  # its peer in the root namespace (take it down to cut the host off)

    def tx_bytes(self) -> int:
        """Bytes the host sent over its link (read on the root side, where they arrive). Under `slowed` this counts
        what the receiver's qdisc dropped and TCP sent again too: more than was delivered."""
        with open(f"/sys/class/net/{self.link}/statistics/rx_bytes") as f:
            return int(f.read())

    def rx_bytes(self) -> int:
        """Bytes delivered to the host over its link (after `slowed`'s qdisc: none counted twice)."""
        with open(f"/sys/class/net/{self.link}/statistics/tx_bytes") as f:
            return int(f.read())


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextmanager
def network_hosts(*names: str) -> Iterator[dict[str, Host]]:
    tag = f"kvb{os.getpid() % 100000}"
    bridge = f"{tag}br"
    made_ns: list[str] = []
    made_links: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = {}
        for i, name in enumerate(names):
            netns, link, device = f"{tag}-{name}", f"{tag}h{i}", f"{tag}n{i}"
            _ip("netns", "add", netns)
            made_ns.append(netns)
            _ip("link", "add", link, "type", "veth", "peer", "name", device)
            made_links.append(link)
            _ip("link", "set", device, "netns", netns)
            _ip("link", "set", link, "master", bridge)
            _ip("link", "set", link, "up")
            ip = f"{SUBNET}.{10 + i}"
            _ip("addr", "add", f"{ip}/24", "dev", device, netns=netns)
            _ip("link", "set", device, "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            hosts[name] = Host(name, netns, ip, device, link)
        yield hosts
    finally:
        for netns in made_ns:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for link in made_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)


@contextmanager
def slowed(host: Host, rate: str = "4mbit") -> Iterator[None]:
    """Traffic to `host` limited to `rate` (tc tbf on the root side of its link), removed on exit."""
    shape = ["tc", "qdisc", "add", "dev", host.link, "root", "tbf", "rate", rate, "burst", "16kb", "latency", "50ms"]
    subprocess.run(shape, check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", host.link, "root"], capture_output=True)


def when_sent(count: Callable[[], int], nbytes: int, act: Callable[[], object], timeout: float = 20.0) -> int:
    """`act()` once the byte counter `count` (e.g. `host.tx_bytes`) has grown by `nbytes` (or after `timeout`);
    returns its growth when it acted, for the caller to check that the act came mid-transfer."""
    since = count()
    deadline = time.monotonic() + timeout
    while count() - since < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = count() - since
    act()
    return sent


def server_on(host: Host, ucx_tcp: bool = False) -> dict:
    """VllmServer arguments that put a server on `host`. By default NIXL's UCX stays on the host's loopback (the
    launcher's UCX_NET_DEVICES=lo) and KV leaves the host over kvbridge's own channel; `ucx_tcp`: UCX limited to TCP
    on the host's own device (no shared memory or CMA across hosts), the opt-in deployment."""
    env = {"VLLM_HOST_IP": host.ip}
    if ucx_tcp:
        env.update(UCX_TLS="self,tcp", UCX_NET_DEVICES=host.device)
    return {"host": host.ip, "netns": host.netns, "env": env}


def connector_on(host: Host, ucx_tcp: bool = False) -> dict:
    """kvbridge connector settings for a server on `host`: its side channel (and KV channel) on the host's address;
    `ucx_tcp`: NIXL's UCX over tcp on the host's device too, which the operator must opt into."""
    out: dict = {"side_channel_host": host.ip, "side_channel_port": 5600}
    if ucx_tcp:
        out.update(ucx_net_devices=host.device, ucx_tcp_exposes_process_memory=True)
    return out
