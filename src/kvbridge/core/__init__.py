"""The pure core: layouts, plans, memory and descriptor math, leases, configuration.

Nothing here does I/O or imports vLLM, NIXL, torch, ZMQ or anything else of kvbridge outside `core`
(`tests/test_layers.py` enforces it): frozen dataclasses and functions, property-tested.
"""
