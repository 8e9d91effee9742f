"""Processes of their own for tests, forked from one server process that imported torch once.

A spawned process imports torch anew: seconds each on a busy 2-core host, and the NIXL tests start dozens. The fork
server imports only libraries (no NIXL agent, socket or thread of a test exists there), so each process still builds
its own workers and agents after the fork. `start` runs the target with the caller's environment as it is at the
start (a test's UCX settings), as a spawned process would see it; the server's own environment is the one it was
started with.

`transfers_forked` (a fixture) has `kvbridge.testing.transfer_scenario.run_transfer` start its worker processes
this way too, where it would spawn them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import types

import pytest

PRELOAD = ["torch", "numpy", "msgspec", "zmq"]


def context():
    """The fork server's multiprocessing context (queues, pipes and events for its processes come from it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _in_environment(env: dict[str, str], target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def start(target, *args):
    """A started daemon process running target(*args) in the caller's current environment."""
    proc = context().Process(target=_in_environment, args=(dict(os.environ), target, args), daemon=True)
    proc.start()
    return proc


class _Context:
    """A multiprocessing context whose processes start from the fork server, in the caller's environment."""

    def __getattr__(self, name: str):
        return getattr(context(), name)

    @staticmethod
    def Process(target, args=(), daemon=None):  # multiprocessing's name
        return context().Process(target=_in_environment, args=(dict(os.environ), target, tuple(args)), daemon=daemon)


@pytest.fixture
def transfers_forked(monkeypatch):
    """run_transfer's worker processes started from the fork server instead of spawned (each still a process of
    its own, with its own NIXL agent, built after the fork)."""
    from kvbridge.testing import transfer_scenario

    monkeypatch.setattr(transfer_scenario, "mp", types.SimpleNamespace(get_context=lambda method: _Context()))
