"""The core and the proxy work without vLLM, torch or NIXL installed (pyproject: the base and `proxy` extras).

A child interpreter whose import system refuses vllm, torch, nixl and triton imports the core, plans a layout and
starts the proxy's app: a hidden import of any of them fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"vllm", "torch", "nixl", "triton", "transformers"}:
                raise ImportError(f"{name} is not installed (test)")
            return None
    sys.meta_path.insert(0, Refuse())
    """
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_core_and_plan_cli_without_vllm():
    out = run(
        """
        import kvbridge
        from kvbridge.core.plan import make_plan
        from kvbridge.core.topology import KVGeometry, ParallelLayout
        plan = make_plan(ParallelLayout.parse("pp=2"), ParallelLayout.parse("tp=2"), KVGeometry(4, 4, 32))
        assert plan.reads
        from kvbridge.serving import cli
        assert cli.main(["plan", "--prefill", "pp=2", "--decode", "tp=2", "--num-layers", "4",
                         "--num-kv-heads", "4"]) == 0
        """
    )
    assert out.returncode == 0, out.stderr


def test_proxy_without_vllm():
    out = run(
        """
        from kvbridge.serving import proxy
        from starlette.testclient import TestClient
        app = proxy.Proxy(proxy.ProxyConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",))).app()
        with TestClient(app) as client:
            assert client.get("/metrics").status_code == 200
        """
    )
    assert out.returncode == 0, out.stderr


def test_the_block_really_refuses():
    """Negative control: the same child cannot import vLLM."""
    out = run("import vllm")
    assert out.returncode != 0 and "not installed (test)" in out.stderr
