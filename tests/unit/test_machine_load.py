"""bench/machine_load.py: other processes' CPU is counted, the bench's own tree's is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from machine_load import TICKS_PER_S, OtherLoad, Process, descendants, describe, process, processes

MARK = "kvbridge-machine-load-spinner"
SPIN = f"# {MARK}\nimport time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"
BUSY_S = 0.3  # CPU a spinner must have used before the span ends


def spin_child() -> subprocess.Popen:
    """A busy loop that is this process's child (30 s at most)."""
    return subprocess.Popen([sys.executable, "-c", SPIN])


def spin_orphan() -> int:
    """A busy loop that is not this process's descendant: forked by a child that exits at once (30 s at most)."""
    code = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    null = os.open(os.devnull, os.O_RDWR)\n"
        "    for fd in (0, 1, 2):\n"
        "        os.dup2(null, fd)\n"
        f"    exec({SPIN!r})\n"
        "    os._exit(0)\n"
        "print(pid, flush=True)\n"
    )
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def cpu_s(pid: int) -> float:
    return process(Path(f"/proc/{pid}/stat").read_text()).ticks / TICKS_PER_S


def measured(start_spinner) -> tuple[int, float, dict]:
    """(the spinner's pid, its CPU s, the span's figures): the span ends once the spinner used BUSY_S."""
    load = OtherLoad.start()
    spinner = start_spinner()
    pid = spinner if isinstance(spinner, int) else spinner.pid
    handle = os.pidfd_open(pid)  # signals go to this process, even once its pid is reused
    try:
        deadline = time.monotonic() + 20
        while MARK.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():  # empty until its exec is done
            assert time.monotonic() < deadline, "not the spinner started here"
            time.sleep(0.01)
        while cpu_s(pid) < BUSY_S and time.monotonic() < deadline:
            time.sleep(0.05)
        used = cpu_s(pid)
        return pid, used, load.stop()
    finally:
        signal.pidfd_send_signal(handle, signal.SIGKILL)
        os.close(handle)
        if not isinstance(spinner, int):
            spinner.wait()


def test_a_busy_process_outside_the_bench_is_counted_and_named():
    pid, used, load = measured(spin_orphan)
    assert used >= BUSY_S, f"the spinner got no CPU: {used} s"
    named = [b for b in load["busiest_others"] if b[1] == pid]
    assert named and named[0][2] >= 0.2, load
    assert load["other_cpu_s"] >= 0.2 and load["other_share_of_cores"] > 0, load
    assert f"pid {pid}" in describe(load)


def test_negative_control_the_benchs_own_child_is_not_counted():
    pid, used, load = measured(spin_child)
    assert used >= BUSY_S, f"the spinner got no CPU: {used} s"  # else nothing was there to leave out
    assert all(b[1] != pid for b in load["busiest_others"]), load


def test_descendants_follow_parents_across_both_ends_of_the_span():
    before = {10: Process(1, "bench", 0), 11: Process(10, "server", 0)}
    after = {10: Process(1, "bench", 0), 12: Process(11, "worker", 0), 13: Process(1, "other", 0)}
    assert descendants(10, before, after) == {10, 11, 12}


def test_a_name_holding_a_parenthesis_is_read_whole(tmp_path):
    (tmp_path / "42").mkdir()
    fields = ["S", "7"] + ["0"] * 9 + ["150", "50", "3", "4"] + ["0"] * 4 + ["999"] + ["0"] * 5
    (tmp_path / "42" / "stat").write_text(f"42 (a) b) {' '.join(fields)}\n")
    (tmp_path / "self").mkdir()
    assert processes(str(tmp_path)) == {42: Process(7, "a) b", 200, 7, 999)}
