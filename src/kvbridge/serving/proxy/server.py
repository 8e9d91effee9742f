"""Running the proxy: the command line (`kvbridge proxy ...`), the listening socket and uvicorn."""

from __future__ import annotations

import argparse
import logging
import resource
import socket
from typing import Any

from kvbridge.core.errors import ConfigError
from kvbridge.serving.proxy.app import Proxy
from kvbridge.serving.proxy.balancer import KINDS
from kvbridge.serving.proxy.config import ProxyConfig
from kvbridge.serving.proxy.connections import bounded_protocol
from kvbridge.serving.proxy.flags import add_config_arguments, config_from_namespace

log = logging.getLogger("kvbridge.serving.proxy")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kvbridge proxy`'s flags: where it listens and logs, then one flag per `ProxyConfig` field (flags.py)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    add_config_arguments(p.add_argument_group("settings (ProxyConfig)"))


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return config_from_namespace(args, ProxyConfig)


def uvicorn_config(proxy: Proxy, log_level: str = "info", access_log: bool = False) -> Any:
    """uvicorn's settings for `proxy`, with its client-facing bounds."""
    import uvicorn

    cfg = proxy.config
    return uvicorn.Config(
        proxy.app(),
        http=bounded_protocol(cfg.head_timeout_s, cfg.max_header_bytes, cfg.max_connections_per_client),
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=cfg.keepalive_timeout_s,
        limit_concurrency=cfg.max_client_connections,
    )


def _raise_fd_limit(needed: int) -> None:
    """Client and backend connections each take a file descriptor: raise the soft limit towards `needed`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < needed:
        log.warning("open file limit %d is below the %d connections configured", want, needed)


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM (uvicorn handles both and shuts down gracefully)."""
    import uvicorn

    config = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(config)
    proxy.load_key()
    _raise_fd_limit(config.max_client_connections + config.max_connections + 64)
    sock = bind_socket(args.host, args.port)
    server = uvicorn.Server(uvicorn_config(proxy, args.log_level, args.access_log))
    print(f"kvbridge proxy listening on {socket_url(sock)}", flush=True)
    for kind in KINDS:  # names are what clients and /metrics see; the URLs behind them only here and in the log
        print(f"  {kind}: {', '.join(f'{b.name}={b.url}' for b in proxy.balancer.backends(kind))}", flush=True)
    if config.auth_key_file is None:
        log.warning(
            "no --auth-key-file: releases of prefill KV are not sealed, so servers with a deployment key ignore "
            "them (their blocks stay held until the lease ends); give the servers' key file"
        )
    try:
        server.run(sockets=[sock])  # after a graceful shutdown on a signal, uvicorn raises that signal again
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    return 0
