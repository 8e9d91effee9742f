"""`kvbridge serve`: one vLLM OpenAI server with KVBridgeConnector, in the foreground.

    kvbridge serve --role prefill --model DIR --pp 2 --port 8100 --side-channel-port 5600
    kvbridge serve --role decode --model DIR --tp 2 --port 8200 -- --max-model-len 4096
    kvbridge serve --role decode --model DIR --dry-run        # print the environment and command only

`--role` picks the connector's kv_role (prefill: kv_producer, decode: kv_consumer, both: kv_both); the
`--kv-transfer-config` is built from the flags (`--side-channel-port`, `--lease-s`, `--kv-extra KEY=VALUE` for any
other `kv_connector_extra_config` key, checked before vLLM starts). Arguments after `--` go to vLLM unchanged.
Transport settings are added only where the environment leaves them unset: `VLLM_HOST_IP` (the `--host`,
unless it is a wildcard: vLLM then picks this machine's address, which the connector advertises),
`UCX_NET_DEVICES=lo` when `--host` is a loopback address (the default: everything stays on this machine), and on
vLLM's CPU build `UCX_TLS=self,sm,cma,tcp` (on GPUs the connector's `ucx_tls: auto` lets UCX pick
cuda_ipc/cuda_copy). To serve other hosts, name this host's address on the network they reach:
`--host 10.0.0.1 --kv-extra side_channel_host=10.0.0.1` (a wildcard also needs `advertise_host`), with the
deployment key below: the KV then leaves the host over kvbridge's authenticated channel, NIXL staying on loopback;
with RDMA, name the devices (`--kv-extra ucx_net_devices=mlx5_0:1`); UCX over tcp only with
`--kv-extra ucx_tcp_exposes_process_memory=true` (docs/deployment-transports.md says what that exposes).
On vLLM's CPU build the defaults of `kvbridge.serving.launcher` apply: `--enforce-eager` for one pipeline stage,
the eager-backend compilation config for PP > 1 (vLLM's eager PP bug on CPU), unless the vLLM arguments choose;
`--cpu-bind` and `--kv-cache-gib` set `VLLM_CPU_OMP_THREADS_BIND` and `VLLM_CPU_KVCACHE_SPACE`.

A deployment key is always used unless asked otherwise: `--auth-key-file PATH` (an existing file), by default
this user's `~/.config/kvbridge/deployment.key` (created with a fresh random key, owner-only, if missing), so
that servers started one by one on this machine share it; give the same file to `kvbridge proxy --auth-key-file`
and copy it to every other host of the deployment. `--kv-extra auth_key_file=...` works too.
`--keyless-exposes-kv-to-local-processes` runs without one, with a loud warning: the side channel then answers
anyone on this machine (and refuses to listen beyond loopback).

The process handling is `kvbridge.serving.launcher.VllmServer`'s: the server runs in its own session with its output
in a log file, which is echoed here; Ctrl-C or SIGTERM stops its whole process tree.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError
from kvbridge.serving.launcher import (
    INSECURE_WARNING,
    PP_COMPILATION_CONFIG,
    VllmServer,
    default_key_file,
    ensure_key_file,
    key_file_warning,
)

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
DEFAULT_PORTS = {"prefill": 8100, "decode": 8200, "both": 8000}
CPU_UCX_TLS = "self,sm,cma,tcp"  # tcp is what lets UCX detect a dead peer
# vLLM options that `kvbridge serve` sets from its own flags.
OWN_OPTIONS = {
    "--model": "--model",
    "--host": "--host",
    "--port": "--port",
    "--pipeline-parallel-size": "--pp",
    "-pp": "--pp",
    "--tensor-parallel-size": "--tp",
    "-tp": "--tp",
    "--kv-transfer-config": "--role, --side-channel-port, --lease-s and --kv-extra",
}
COMPILE_OPTIONS = ("--enforce-eager", "--compilation-config", "-cc", "-O")
_WILDCARDS = {"", "0.0.0.0", "::"}


@dataclass(frozen=True)
class ServeSpec:
    """What to run: validated at construction, turned into a command and environment by pure methods."""

    role: str
    model: str
    pp: int = 1
    tp: int = 1
    host: str = "127.0.0.1"
    port: int | None = None
    """Default: 8100 prefill, 8200 decode, 8000 both."""
    side_channel_port: int | None = None
    lease_s: float | None = None
    kv_extra: Mapping[str, Any] = field(default_factory=dict)
    """More kv_connector_extra_config keys."""
    kv_load_failure_policy: str | None = "recompute"
    """vLLM's, for a decode whose KV load failed: "recompute" (default here: a dead prefill costs latency, not an
    error) computes the prompt locally from the first block not loaded; "fail" ends the request with an error;
    None: vLLM's own default (fail)."""
    dtype: str | None = None
    platform: str = "cpu"
    """"cpu" (vLLM's CPU build: CPU environment and compilation defaults) or "gpu"."""
    cpu_bind: str | None = None
    kv_cache_gib: float | None = None
    vllm_args: tuple[str, ...] = ()
    auth_key_file: str | None = None
    """The deployment key's file, added to the extra config (unless `kv_extra` names a key itself); None: none."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.pp < 1 or self.tp < 1:
            raise ConfigError(f"--pp and --tp must be >= 1, got pp={self.pp} tp={self.tp}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"--port must be 1-65535, got {self.port}")
        if self.platform not in ("cpu", "gpu"):
            raise ConfigError(f"platform must be cpu or gpu, got {self.platform!r}")
        for arg in self.vllm_args:
            option = arg.split("=", 1)[0]
            if option in OWN_OPTIONS:
                raise ConfigError(f"{option} after -- is set by kvbridge serve itself: use its {OWN_OPTIONS[option]}")
        extra = self.extra_config()
        config = BridgeConfig.from_extra(extra)  # refuse bad keys and values before vLLM starts
        if self.role in ("prefill", "both"):  # a side channel beyond loopback without a key: refused up front
            config.check_exposure(bool(extra.keys() & {"auth_key", "auth_key_file"}))

    @property
    def listen_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.role]

    @property
    def url(self) -> str:
        """Where this machine reaches the server."""
        host = "127.0.0.1" if self.host in _WILDCARDS else self.host
        return f"http://[{host}]:{self.listen_port}" if ":" in host else f"http://{host}:{self.listen_port}"

    def extra_config(self) -> dict[str, Any]:
        extra = dict(self.kv_extra)
        if self.auth_key_file is not None and not extra.keys() & {"auth_key", "auth_key_file"}:
            extra["auth_key_file"] = self.auth_key_file
        if not extra.keys() & {
            "auth_key",
            "auth_key_file",
        }:  # --keyless-exposes-kv-to-local-processes: the connector needs the flag
            extra.setdefault("keyless_exposes_kv_to_local_processes", True)
        if self.side_channel_port is not None:
            extra["side_channel_port"] = self.side_channel_port
        if self.lease_s is not None:
            extra["lease_s"] = self.lease_s
        return extra

    def kv_transfer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": ROLES[self.role],
            "kv_connector_extra_config": self.extra_config(),
        }
        if self.kv_load_failure_policy is not None:
            config["kv_load_failure_policy"] = self.kv_load_failure_policy
        return config

    def command(self, python: str = sys.executable) -> list[str]:
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.listen_port),
            "--pipeline-parallel-size",
            str(self.pp),
            "--tensor-parallel-size",
            str(self.tp),
            "--distributed-executor-backend",
            "mp",  # every PP stage reports finished transfers (PLATFORM.md); Ray's compiled DAG does not
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config(), separators=(",", ":")),
        ]
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        chosen = any(a.split("=", 1)[0] in COMPILE_OPTIONS or a.startswith("-O") for a in self.vllm_args)
        if self.platform == "cpu" and not chosen:
            if self.pp > 1:
                cmd += ["--compilation-config", json.dumps(PP_COMPILATION_CONFIG, separators=(",", ":"))]
            else:
                cmd.append("--enforce-eager")
        return cmd + list(self.vllm_args)

    def environment(self, current: Mapping[str, str]) -> dict[str, str]:
        """The variables to add to `current` (the user's own settings win)."""
        wanted = {} if self.host in _WILDCARDS else {"VLLM_HOST_IP": self.host}
        if _is_loopback(self.host):
            wanted["UCX_NET_DEVICES"] = "lo"
        wanted["PYTHONUNBUFFERED"] = "1"  # the log is echoed as it is written
        if self.platform == "cpu":
            wanted["UCX_TLS"] = CPU_UCX_TLS
            if self.cpu_bind is not None:
                wanted["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
            if self.kv_cache_gib is not None:
                wanted["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_gib:g}"
        return {k: v for k, v in wanted.items() if k not in current}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def detect_platform() -> str:
    """ "cpu" when the installed vLLM is the `vllm-cpu` distribution, else "gpu"."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "gpu"
    return "cpu"


def shell_line(command: Sequence[str], env: Mapping[str, str]) -> str:
    """A copy-pasteable shell command: one `NAME=value` per line, then the command."""
    lines = [f"{name}={shlex.quote(value)}" for name, value in env.items()]
    return " \\\n".join([*lines, shlex.join(command)])


class _ServeProcess(VllmServer):
    """`VllmServer`'s process handling (own session, log file, readiness, stopping the whole tree) with the
    command and environment of a `ServeSpec` instead of the test defaults."""

    def __init__(self, spec: ServeSpec, python: str, log_path: str | None) -> None:
        super().__init__(
            spec.model, port=spec.listen_port, pp=spec.pp, tp=spec.tp, log_path=log_path, name=spec.role, python=python
        )
        self.spec = spec

    @property
    def url(self) -> str:
        return self.spec.url

    def command(self) -> list[str]:
        return self.spec.command(self.python)

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.spec.environment(os.environ)}


class _LogEcho:
    """Copies what is appended to a log file to a stream."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path = path
        self.out = out
        self.offset = 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data.decode(errors="replace"))
            self.out.flush()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", required=True, choices=sorted(ROLES), help="prefill (kv_producer), decode, both")
    p.add_argument("--model", required=True, help="model directory (or name) for vLLM")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--host", default="127.0.0.1", help="address vLLM listens on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="default: 8100 prefill, 8200 decode, 8000 both")
    p.add_argument(
        "--side-channel-port",
        type=int,
        metavar="B",
        help="base port of the prefill workers' side channels (kvbridge's default 5600; the instance uses dp*pp*tp "
        "ports from B)",
    )
    p.add_argument("--lease-s", type=float, metavar="S", help="seconds a prefill instance holds finished requests' KV")
    p.add_argument(
        "--kv-extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another kv_connector_extra_config entry (VALUE parsed as JSON when it can be), e.g. "
        "side_channel_host=0.0.0.0 (repeat)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        default="recompute",
        help="vLLM's, for a decode request whose KV load failed: recompute (default) computes the prompt on the "
        "decode instead (a dead prefill costs latency, not an error); fail ends the request with an error",
    )
    p.add_argument("--dtype", help="vLLM --dtype (default: vLLM's)")
    p.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto", help="auto: cpu with vllm-cpu")
    p.add_argument("--cpu-bind", help="CPU build: VLLM_CPU_OMP_THREADS_BIND, one core list per worker ('0|1')")
    p.add_argument("--kv-cache-gib", type=float, help="CPU build: VLLM_CPU_KVCACHE_SPACE")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--auth-key-file",
        metavar="PATH",
        help="the deployment key, the same file on every instance and the proxy (default "
        f"{default_key_file()}, created if missing)",
    )
    key.add_argument(
        "--keyless-exposes-kv-to-local-processes",
        action="store_true",
        help="no deployment key: anyone on this machine can read every user's KV (loopback only)",
    )
    p.add_argument("--log-file", help="vLLM's output (default: a new file in the temp dir); echoed here")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, start nothing")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS", help="more vLLM arguments, after --")


def _announce_key(spec: ServeSpec) -> None:
    """Create the key file if needed and say which key is used, or warn loudly that none is."""
    if spec.auth_key_file is None:
        if not spec.kv_extra.keys() & {"auth_key", "auth_key_file"}:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
        return
    path, created = ensure_key_file(spec.auth_key_file)
    how = "created with a fresh random key" if created else "existing"
    print(
        f"kvbridge serve: deployment key file {path} ({how}): give the same file to every prefill and decode "
        "instance (--auth-key-file) and to kvbridge proxy --auth-key-file",
        flush=True,
    )
    warning = key_file_warning(path)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _parse_extra(items: Sequence[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--kv-extra takes KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    return extra


def key_file_from_args(args: argparse.Namespace, kv_extra: Mapping[str, Any]) -> str | None:
    """The key file `kvbridge serve` adds: --auth-key-file, else the user's default; None when the extra config
    names a key itself or with --keyless-exposes-kv-to-local-processes."""
    if kv_extra.keys() & {"auth_key", "auth_key_file"}:
        if args.auth_key_file:
            raise ConfigError("give --auth-key-file or --kv-extra auth_key_file/auth_key, not both")
        return None
    if args.keyless_exposes_kv_to_local_processes:
        return None
    if args.auth_key_file:  # a path the user names must exist: a typo must not make a second key
        path = Path(args.auth_key_file).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"--auth-key-file {path} does not exist (leave the option out to use {default_key_file()}, "
                "created if missing, or write one: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)"
            )
        return str(path)
    return str(default_key_file())


def spec_from_args(args: argparse.Namespace) -> ServeSpec:
    kv_extra = _parse_extra(args.kv_extra)
    return ServeSpec(
        role=args.role,
        model=args.model,
        pp=args.pp,
        tp=args.tp,
        host=args.host,
        port=args.port,
        side_channel_port=args.side_channel_port,
        lease_s=args.lease_s,
        kv_extra=kv_extra,
        kv_load_failure_policy=args.kv_load_failure_policy,
        dtype=args.dtype,
        platform=detect_platform() if args.platform == "auto" else args.platform,
        cpu_bind=args.cpu_bind,
        kv_cache_gib=args.kv_cache_gib,
        vllm_args=tuple(args.vllm_args),
        auth_key_file=key_file_from_args(args, kv_extra),
    )


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.dry_run:
        print(f"# kvbridge serve --role {spec.role}: added environment, then the command")
        if spec.auth_key_file is not None:
            print(f"# deployment key file {spec.auth_key_file} (created when the server starts, if missing)")
        print(shell_line(spec.command(), spec.environment(os.environ)))
        return 0
    _announce_key(spec)
    server = _ServeProcess(spec, sys.executable, args.log_file)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        assert server.process is not None and server.log_path is not None
        print(
            f"kvbridge serve: vLLM {spec.role} (pp={spec.pp}, tp={spec.tp}) pid {server.process.pid}, "
            f"log {server.log_path}",
            flush=True,
        )
        echo = _LogEcho(server.log_path, sys.stdout)
        ready = False
        while not stop.is_set():
            echo.pump()
            code = server.process.poll()
            if code is not None:
                echo.pump()
                print(f"kvbridge serve: vLLM exited with code {code}", file=sys.stderr, flush=True)
                return code or 1
            if not ready and server.is_healthy(timeout=1.0):
                ready = True
                print(f"kvbridge serve: ready at {spec.url}", flush=True)
            stop.wait(0.5)
        print("kvbridge serve: stopping vLLM", flush=True)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
