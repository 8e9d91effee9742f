"""Test layout: `unit/` (pure code, fakes, no NIXL agent), `nixl/` (real NIXL between processes), `e2e/` (real vLLM
servers), `gpu/` (CUDA, on the device machine). Shared code lives in the `support` package beside this file, which
pytest puts on `sys.path` (its prepend import mode inserts this folder when it loads this conftest)."""
