"""A load's phases (`Load.durations`): on the CUDA IPC path the block-id checks and the launch are the two parts of
its post; a load whose kernels went out during its claim counts as `claim` only what the claim took beyond them."""

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


def test_checks_made_in_the_post_are_counted_there_once():
    load = ipc_load(started=10.0031, checks_began=10.0031, checked=10.0033, launched=10.0035, posted=10.0036)
    phases = load.durations(reported=10.007)
    assert phases["claim"] == pytest.approx(2e-3)
    assert phases["checks"] == pytest.approx(0.2e-3)
    assert phases["post_launch"] == pytest.approx(0.2e-3)  # after the checks: they are not counted twice
    assert phases["post"] == pytest.approx(0.5e-3)


def test_a_load_launched_during_its_claim_counts_only_the_claims_excess():
    """Kernels out at 10.0015, done at 10.0045; the claim answered at 10.006: 1.5 ms of claim beyond the kernels."""
    load = ipc_load(
        launched_in_claim=True,
        started=10.0012,
        checks_began=10.0012,
        checked=10.0013,
        launched=10.0015,
        posted=10.0015,
        kernels_landed=10.0045,
        claimed=10.0059,
        landed=10.006,
    )
    phases = load.durations(reported=10.007)
    assert phases["queue"] == pytest.approx(0.2e-3)
    assert phases["post"] == pytest.approx(0.3e-3)
    assert phases["wire"] == pytest.approx(3e-3)
    assert phases["claim"] == pytest.approx(1.5e-3)
    assert phases["hop"] == pytest.approx(5e-3)  # claim sent -> data in and claim granted
    assert sum(phases[p] for p in ("handshake", "queue", "post", "wire", "claim", "report")) == pytest.approx(
        phases["total"]
    )


def test_a_claim_answered_before_the_kernels_finish_adds_nothing():
    load = ipc_load(launched_in_claim=True, started=10.0012, posted=10.0015, kernels_landed=10.0058, landed=10.0058)
    assert load.durations(reported=10.007)["claim"] == 0.0


def test_a_nixl_load_has_no_check_phases():
    load = ipc_load(started=10.0031, posted=10.0035)
    assert not {"checks", "post_launch", "post_checks"} & set(load.durations(reported=10.007))


class _Reader:
    stream = None

    def launch(self, live, remote, local):
        return object(), object()


def test_the_ipc_path_stamps_its_checks_in_the_launch():
    ipc = IpcReads(None, None, (), loaded=lambda *a: None, failed=lambda *a: pytest.fail(str(a)))
    ipc.reader = _Reader()
    load = Load(LoadJob("r", None, (), ()), queued=1.0, deadline=1e12)
    load.engine = SimpleNamespace(kernels={}, peers={})
    load.connected = load.claim_sent = 1.0
    load.claimed = load.started = time.monotonic()
    ipc.launch(load)
    assert load.started <= load.checks_began <= load.checked <= load.launched <= load.posted
    load.landed = load.posted
    phases = load.durations(reported=load.landed)
    assert phases["checks"] == pytest.approx(load.checked - load.checks_began)
    assert phases["post_launch"] == pytest.approx(load.launched - load.checked)


def test_the_claim_wait_starts_when_the_claim_is_sent_so_it_never_exceeds_the_hop():
    """Building the claim (digests, checks) after the handshake belongs to `handshake`: `claim` is sent -> granted,
    within `hop` (sent -> landed). Negative control: measured from the handshake, the claim would exceed the hop."""
    load = ipc_load(claim_sent=10.0015, claimed=10.003, started=10.0031, posted=10.0032, landed=10.0032)
    phases = load.durations(reported=10.004)
    assert phases["handshake"] == pytest.approx(1.5e-3)
    assert phases["claim"] == pytest.approx(1.5e-3) and phases["hop"] == pytest.approx(1.7e-3)
    assert phases["claim"] <= phases["hop"] < load.claimed - load.connected
    assert sum(phases[p] for p in ("handshake", "claim", "queue", "post", "wire", "report")) == pytest.approx(
        phases["total"]
    )


def test_a_load_launched_during_its_claim_also_counts_the_claims_building_in_the_handshake():
    load = ipc_load(
        launched_in_claim=True,
        claim_sent=10.0015,
        started=10.0016,
        posted=10.002,
        kernels_landed=10.004,
        claimed=10.0039,
        landed=10.004,
    )
    phases = load.durations(reported=10.005)
    assert phases["handshake"] == pytest.approx(1.5e-3) and phases["queue"] == pytest.approx(0.1e-3)
    assert phases["claim"] == 0.0 and phases["hop"] == pytest.approx(2.5e-3)
