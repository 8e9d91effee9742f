"""End to end in real vLLM (CPU): a model kvbridge cannot serve is refused when the server starts, never request by
request: the server exits before it is ready, and its log has one line from kvbridge naming what is unsupported.

A Mamba2 hybrid (tiny NemotronH, `M*M*M*M*`): with kvbridge's `SupportsHMA` vLLM keeps its hybrid KV-cache manager
on, which gives the Mamba layers their own KV-cache group of state pages (`MambaSpec`), and kvbridge moves attention
KV only: the connector refuses the group when vLLM creates it, naming the spec.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import ServerError, VllmServer, free_base_port, free_port, kvbridge_config, running
from kvbridge.serving.tiny_model import build_tiny_nemotron_h

pytestmark = pytest.mark.vllm


def refusal(server: VllmServer) -> list[str]:
    """Start `server`, which must exit before it is ready; the lines of its log in which kvbridge refuses."""
    with pytest.raises(ServerError, match="exited with code"), running([server], timeout=240):
        pass
    assert server.process is not None and server.process.poll() not in (None, 0)
    return [x for x in server.log_path.read_text().splitlines() if "ConfigError: kvbridge: " in x]


def test_a_mamba_hybrid_is_refused_at_startup_naming_the_spec(tmp_path):
    model = build_tiny_nemotron_h(tmp_path / "nemotron-h")
    server = VllmServer(
        model,
        port=free_port(),
        cpu_bind="0",
        extra_args=("--no-enable-prefix-caching",),
        kv_transfer_config=kvbridge_config("kv_both", side_channel_port=free_base_port(1)),
        name="refuse-mamba",
        log_path=tmp_path / "mamba.log",
    )
    lines = refusal(server)
    assert lines, server.log_tail(60)
    assert all("MambaSpec" in x for x in lines), lines
