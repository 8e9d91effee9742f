"""End to end in real vLLM (CPU): a model or layout kvbridge cannot serve is refused when the server starts, never
request by request: the server exits before it is ready, and its log has one line from kvbridge naming what is
unsupported.

A Mamba2 hybrid (tiny NemotronH, `M*M*M*M*`): kvbridge moves its state pages (`MambaSpec`) only between equal TP
sizes (tests/e2e/test_e2e_mamba.py) and only with one running-state block per request (prefix caching off). A tp=2
server told its peers are tp=1 (`peer_tp`) is refused naming both layouts; a server with prefix caching on (vLLM's
`mamba_cache_mode` "align") is refused naming the mode.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import ServerError, VllmServer, free_base_port, free_port, kvbridge_config, running
from kvbridge.testing.tiny_models import build_tiny_nemotron_h

pytestmark = pytest.mark.vllm


def refusal(server: VllmServer) -> list[str]:
    """Start `server`, which must exit before it is ready; the lines of its log in which kvbridge refuses."""
    with pytest.raises(ServerError, match="exited with code"), running([server], timeout=240):
        pass
    assert server.process is not None and server.process.poll() not in (None, 0)
    return [x for x in server.log_path.read_text().splitlines() if "ConfigError: kvbridge: " in x]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_nemotron_h(tmp_path_factory.mktemp("refusals") / "nemotron-h")


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


def test_mamba_state_between_tp_sizes_is_refused_at_startup_naming_the_layouts(model, tmp_path):
    server = mamba_server(model, tmp_path, "mamba-tp", 2, "0|1", ("--no-enable-prefix-caching",), peer_tp=1)
    lines = refusal(server)
    assert lines, server.log_tail(60)
    want = "Mamba state (MambaSpec) moves only between equal TP sizes: this engine is pp=1,tp=2, its peers tp=1"
    assert all(want in x for x in lines), lines


def test_mamba_with_prefix_caching_is_refused_at_startup_naming_the_mode(model, tmp_path):
    server = mamba_server(model, tmp_path, "mamba-align", 1, "0", ("--enable-prefix-caching",))
    lines = refusal(server)
    assert lines, server.log_tail(60)
    assert all("mamba_cache_mode='align'" in x for x in lines), lines
