"""A load's phases (`Load.durations`): on the CUDA IPC path the block-id checks are a phase of their own, which
overlaps the claim when they ran while the claim was on the wire, and the post's launch part is what follows."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvbridge.runtime.ipc_reads import IpcReads
from kvbridge.runtime.load import Load, LoadJob


def ipc_load(**marks: float) -> Load:
    load = Load(LoadJob("r", None, (), ()), queued=10.0, deadline=40.0)
    for name, t in {"connected": 10.001, "claim_sent": 10.001, "claimed": 10.003, "landed": 10.006, **marks}.items():
        setattr(load, name, t)
    return load


def test_checks_made_during_the_claim_are_their_own_phase():
    load = ipc_load(checks_began=10.0012, checked=10.0015, started=10.0031, launched=10.0034, posted=10.0035)
    phases = load.durations(reported=10.007)
    assert phases["checks"] == pytest.approx(0.3e-3)  # inside the claim (10.001 -> 10.003), not clipped to 0
    assert phases["claim"] == pytest.approx(2e-3)
    assert phases["post"] == pytest.approx(0.4e-3)
    assert phases["post_launch"] == pytest.approx(0.3e-3)  # started -> launched: the checks are not in it
    assert "post_checks" not in phases


def test_checks_made_in_the_post_are_counted_there_once():
    """The control: checks not made ahead run in the post; post_launch then starts when they end."""
    load = ipc_load(started=10.0031, checks_began=10.0031, checked=10.0033, launched=10.0035, posted=10.0036)
    phases = load.durations(reported=10.007)
    assert phases["checks"] == pytest.approx(0.2e-3)
    assert phases["post_launch"] == pytest.approx(0.2e-3)
    assert phases["post"] == pytest.approx(0.5e-3)


def test_a_nixl_load_has_no_check_phases():
    load = ipc_load(started=10.0031, posted=10.0035)
    assert not {"checks", "post_launch", "post_checks"} & set(load.durations(reported=10.007))


class _Reader:
    stream = None

    def launch(self, live, remote, local):
        return object(), object()


def test_the_ipc_path_stamps_its_checks_where_they_run():
    """prepare() (the claiming thread, claim on the wire) stamps the checks before `started`; the launch then
    checks nothing again and the checks do not reach into post_launch."""
    ipc = IpcReads(None, None, (), loaded=lambda *a: None, failed=lambda *a: pytest.fail(str(a)))
    ipc.reader = _Reader()
    load = Load(LoadJob("r", None, (), ()), queued=1.0, deadline=1e12)
    load.engine = SimpleNamespace(kernels={}, peers={})
    load.connected = load.claim_sent = 1.0
    ipc.prepare(load)
    assert 0 < load.checks_began <= load.checked
    checked = load.checked
    load.claimed = load.started = time.monotonic()
    ipc.launch(load)
    assert load.checked == checked  # not checked again
    load.landed = load.posted
    phases = load.durations(reported=load.landed)
    assert phases["checks"] == pytest.approx(checked - load.checks_began)
    assert phases["post_launch"] == pytest.approx(load.launched - load.started)
