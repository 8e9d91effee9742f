"""End to end in real vLLM (CPU): a model or layout kvbridge cannot serve is refused when the server starts, never
request by request: the server exits before it is ready, and its log has one line from kvbridge naming what is
unsupported.

A Mamba2 hybrid (tiny NemotronH, `M*M*M*M*`): kvbridge moves its state pages (`MambaSpec`) only between equal TP
sizes (tests/e2e/test_e2e_mamba.py) and only with one running-state block per request (prefix caching off). A tp=2
server told its peers are tp=1 (`peer_tp`) is refused naming both layouts; a server with prefix caching on (vLLM's
`mamba_cache_mode` "align") is refused naming the mode. Both servers start together (a module fixture).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.serving.launcher import ServerError, VllmServer, free_base_port, free_port, kvbridge_config, stop_all
from kvbridge.testing.tiny_models import build_tiny_nemotron_h

pytestmark = pytest.mark.vllm


def refusal(server: VllmServer, error: ServerError | None) -> list[str]:
    """`server` must have exited before it was ready (`error`: what its `wait_ready` raised); the lines of its log
    in which kvbridge refuses."""
    with pytest.raises(ServerError, match="exited with code"):
        if error is not None:
            raise error
    assert server.process is not None and server.process.poll() not in (None, 0)
    return [x for x in server.log_path.read_text().splitlines() if "ConfigError: kvbridge: " in x]


def exit_error(server: VllmServer, timeout: float = 240) -> ServerError | None:
    """What `server.wait_ready` raised (None if the server became ready)."""
    try:
        server.wait_ready(timeout)
    except ServerError as error:
        return error
    return None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_nemotron_h(tmp_path_factory.mktemp("refusals") / "nemotron-h")


@pytest.fixture(scope="module")
def refused(model, tmp_path_factory) -> dict[str, tuple[VllmServer, ServerError | None]]:
    """{name: (server, what its wait_ready raised)} for both servers, started together and stopped (also on
    failure) before the tests look at them."""
    root = tmp_path_factory.mktemp("refusal-logs")
    servers = {
        "mamba-tp": mamba_server(model, root, "mamba-tp", 2, "0|1", ("--no-enable-prefix-caching",), peer_tp=1),
        "mamba-align": mamba_server(model, root, "mamba-align", 1, "1", ("--enable-prefix-caching",)),
    }
    try:
        for server in servers.values():
            server.start()
        with ThreadPoolExecutor(len(servers)) as pool:
            errors = dict(zip(servers, pool.map(exit_error, servers.values()), strict=True))
    finally:
        stop_all(list(servers.values()))
    return {name: (server, errors[name]) for name, server in servers.items()}


def mamba_server(model, tmp_path, name: str, tp: int, cores: str, args: tuple[str, ...], **extra) -> VllmServer:
    return VllmServer(
        model,
        port=free_port(),
        tp=tp,
        cpu_bind=cores,
        max_model_len=1024,
        extra_args=args,
        kv_transfer_config=kvbridge_config("kv_both", side_channel_port=free_base_port(tp), **extra),
        name=f"refuse-{name}",
        log_path=tmp_path / f"{name}.log",
    )


def test_mamba_state_between_tp_sizes_is_refused_at_startup_naming_the_layouts(refused):
    server, error = refused["mamba-tp"]
    lines = refusal(server, error)
    assert lines, server.log_tail(60)
    want = "Mamba state (MambaSpec) moves only between equal TP sizes: this engine is pp=1,tp=2, its peers tp=1"
    assert all(want in x for x in lines), lines


def test_mamba_with_prefix_caching_is_refused_at_startup_naming_the_mode(refused):
    server, error = refused["mamba-align"]
    lines = refusal(server, error)
    assert lines, server.log_tail(60)
    assert all("mamba_cache_mode='align'" in x for x in lines), lines
