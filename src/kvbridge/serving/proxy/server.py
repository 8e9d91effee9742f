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
from kvbridge.serving.proxy.connections import head_timeout_protocol

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
    d = ProxyConfig(prefill=("http://x",), decode=("http://y",))
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill backend (repeat)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode backend (repeat)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument(
        "--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S", help="connecting to a backend"
    )
    p.add_argument("--prefill-timeout", type=float, default=d.prefill_timeout_s, metavar="S", help="whole prefill leg")
    p.add_argument(
        "--decode-timeout",
        type=float,
        default=d.decode_timeout_s,
        metavar="S",
        help="longest wait for the decode backend's next bytes (the whole reply when not streaming)",
    )
    p.add_argument(
        "--health-interval", type=float, default=d.health_interval_s, metavar="S", help="probing backends that are down"
    )
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s, metavar="S", help="one /health probe")
    p.add_argument(
        "--connect-retries",
        type=int,
        default=d.connect_retries,
        metavar="N",
        help="other backends of the kind to try when connecting fails",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=d.max_inflight,
        metavar="N",
        help="client requests handled at once, more get 503 (0: no limit)",
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N", help="largest request body")
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, metavar="N", help="to all backends together"
    )
    p.add_argument(
        "--backend-keepalive",
        type=float,
        default=d.backend_keepalive_s,
        metavar="S",
        help="reuse idle backend connections for up to S seconds (0: a connection per leg; keep S well under the"
        " backends' keep-alive timeout)",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=d.max_prompts_per_request,
        metavar="N",
        help="prompts in one completions request (each has its own prefill leg)",
    )
    p.add_argument("--max-n", type=int, default=d.max_n, metavar="N", help="largest n (each choice has its own legs)")
    p.add_argument(
        "--auth-key-file",
        default=d.auth_key_file,
        metavar="PATH",
        help="the deployment key (as the connectors' auth_key_file): releases of prefill KV are sealed with it",
    )
    p.add_argument(
        "--release-timeout",
        type=float,
        default=d.release_timeout_s,
        metavar="S",
        help="longest wait for prefill workers to acknowledge a release",
    )
    p.add_argument(
        "--head-timeout", type=float, default=d.head_timeout_s, metavar="S", help="a client's request line and headers"
    )
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S", help="a client's whole body")
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=d.keepalive_timeout_s,
        metavar="S",
        help="an idle client connection between requests",
    )
    p.add_argument(
        "--max-header-bytes", type=int, default=d.max_header_bytes, metavar="N", help="request line plus headers"
    )
    p.add_argument(
        "--max-client-connections",
        type=int,
        default=d.max_client_connections,
        metavar="N",
        help="client connections served at once (more get 503)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=d.max_connections_per_client,
        metavar="N",
        help="client connections one address may hold at once, more get 429 (0: no limit)",
    )
    p.add_argument(
        "--max-json-depth", type=int, default=d.max_json_depth, metavar="N", help="deepest nesting in a request body"
    )
    p.add_argument(
        "--max-request-id-chars",
        type=int,
        default=d.max_request_id_chars,
        metavar="N",
        help="longer client x-request-ids are replaced by fresh ones",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    def urls(values: list[str]) -> tuple[str, ...]:
        return tuple(u for v in values for u in v.split(",") if u.strip())

    return ProxyConfig(
        prefill=urls(args.prefill),
        decode=urls(args.decode),
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_retries=args.connect_retries,
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        backend_keepalive_s=args.backend_keepalive,
        max_prompts_per_request=args.max_prompts_per_request,
        max_n=args.max_n,
        auth_key_file=args.auth_key_file,
        release_timeout_s=args.release_timeout,
        head_timeout_s=args.head_timeout,
        body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_header_bytes=args.max_header_bytes,
        max_client_connections=args.max_client_connections,
        max_connections_per_client=args.max_connections_per_client,
        max_json_depth=args.max_json_depth,
        max_request_id_chars=args.max_request_id_chars,
    )


def uvicorn_config(proxy: Proxy, log_level: str = "info", access_log: bool = False) -> Any:
    """uvicorn's settings for `proxy`, with its client-facing bounds."""
    import uvicorn

    cfg = proxy.config
    return uvicorn.Config(
        proxy.app(),
        http=head_timeout_protocol(cfg.head_timeout_s, cfg.max_connections_per_client),
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=cfg.keepalive_timeout_s,
        h11_max_incomplete_event_size=cfg.max_header_bytes,
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
