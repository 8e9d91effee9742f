"""The project's own test hosts: network namespaces joined by veth pairs to a bridge, made and removed here.

    root namespace (the test client, the proxy): bridge <tag>br at 10.77.0.1/24
      └─ veth ─ namespace <tag>-<name>: device <tag>n<i> at 10.77.0.<10+i>/24, its own loopback

Only these addresses are used; everything is removed on exit, also on failure. Needs root and iproute2.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
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
        """Bytes the host sent over its link (read on the root side, where they arrive)."""
        with open(f"/sys/class/net/{self.link}/statistics/rx_bytes") as f:
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
