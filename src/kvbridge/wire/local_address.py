"""Whether an address belongs to this host's own network stack (loopback, or an address of one of its interfaces,
in this network namespace).

A peer at such an address is reached without a link: this host's kernel accepts the connect and acknowledges the
bytes whatever the peer's process does, so a connect that is late there only means this process was not scheduled
in time. Timeouts meant to find a host or link down (`link_timeout_s`) do not apply there.
"""

from __future__ import annotations

import functools
import ipaddress


@functools.lru_cache(maxsize=256)
def on_this_host(host: str) -> bool:
    """Whether `host` (an IP literal, bracketed or not, or `localhost`) is loopback or an address of one of this
    host's interfaces. Other names are not resolved (no DNS lookup on a load's path): False."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    if ip.is_loopback or (mapped is not None and mapped.is_loopback):
        return True
    return str(mapped or ip) in _interface_addresses()


@functools.cache
def _interface_addresses() -> frozenset[str]:
    """The IP addresses of this host's interfaces in this network namespace (empty without psutil, which vLLM
    installs), read once per process: an address added later is taken for another host's (its link timeout then
    applies, as it would to a remote prefill)."""
    try:
        import psutil
    except ImportError:
        return frozenset()
    return frozenset(
        str(ipaddress.ip_address(a.address.split("%", 1)[0]))
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if _is_ip(a.address.split("%", 1)[0])
    )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
