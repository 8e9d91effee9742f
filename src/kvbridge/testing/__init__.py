"""Harnesses for tests and benchmarks only; nothing else in kvbridge imports this package
(`tests/test_layers.py` enforces it)."""
