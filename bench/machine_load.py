"""What else ran on the CPUs while a bench measured: the CPU seconds of processes outside the bench's own tree.

On two cores another job's busy loop halves a server's core, and the load average cannot tell the bench's own
servers from someone else's work. `OtherLoad` reads the machine's busy time (/proc/stat) and every process's CPU
time (/proc/<pid>/stat) when a measured span starts and when it ends:

    other CPU s  =  the machine's user + nice + system time over the span
                    - that of the bench's tree (this process and its descendants, children it reaped included)

so processes that ran only inside the span count too. The busiest other processes are named from their own
times (those alive at the end). Interrupt time is left out (the bench's own loopback traffic lands there). A child
of the bench reaped inside the span brings its whole life's time into its parent's: the other figure is then low,
never high (it is floored at 0).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

TICKS_PER_S = os.sysconf("SC_CLK_TCK")

SUSPECT_SHARE = 0.05
"""Above this share of the cores used by other processes over a span, its timings are suspect (said so)."""


@dataclass(frozen=True)
class Process:
    ppid: int
    name: str
    ticks: int  # user + system CPU time, all threads
    reaped: int = 0  # user + system CPU time of its children it waited for
    start: int = 0  # when it started (ticks after boot): a pid reused meanwhile is another process


def process(stat: str) -> Process | None:
    """One process from the text of its /proc/<pid>/stat (None: too short to read)."""
    head, _, rest = stat.rpartition(")")  # the name may hold ")" itself: the last one ends it
    f = rest.split()
    if len(f) < 20:
        return None
    # after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime
    # cstime priority nice num_threads itrealvalue starttime
    return Process(int(f[1]), head.partition("(")[2], int(f[11]) + int(f[12]), int(f[13]) + int(f[14]), int(f[19]))


def processes(proc: str = "/proc") -> dict[int, Process]:
    """Every process readable under `proc`: pid -> its parent, name and CPU ticks so far."""
    out: dict[int, Process] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc}/{entry.name}/stat", "rb") as f:
                p = process(f.read().decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if p is not None:
            out[int(entry.name)] = p
    return out


def busy_ticks(proc: str = "/proc") -> int:
    """The machine's user + nice + system ticks since boot, all CPUs."""
    with open(f"{proc}/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
    return int(fields[1]) + int(fields[2]) + int(fields[3])


def descendants(root: int, *snapshots: dict[int, Process]) -> set[int]:
    """`root` and every process whose chain of parents reaches it in any of `snapshots`."""
    children: dict[int, set[int]] = {}
    for snapshot in snapshots:
        for pid, p in snapshot.items():
            children.setdefault(p.ppid, set()).add(pid)
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def cores() -> int:
    """The CPUs this process may run on (its affinity), which is what the bench shares."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        return os.cpu_count() or 1


@dataclass
class OtherLoad:
    """A measured span: `OtherLoad.start()`, then `stop()` for its figures."""

    root: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.monotonic)
    busy: int = field(default_factory=busy_ticks)
    before: dict[int, Process] = field(default_factory=processes)

    @classmethod
    def start(cls) -> OtherLoad:
        return cls()

    def _used(self, pid: int, p: Process, with_reaped: bool) -> float:
        """Ticks `p` used over the span (all its life if it started inside it, or if its pid was reused)."""
        old = self.before.get(pid)
        if old is None or old.start != p.start:
            old = Process(p.ppid, p.name, 0, 0, p.start)
        used = p.ticks - old.ticks + (p.reaped - old.reaped if with_reaped else 0)
        return max(used, 0)

    def stop(self) -> dict:
        """{"wall_s", "other_cpu_s", "other_share_of_cores", "busiest_others": [[name, pid, cpu s], ...],
        "suspect"}: what processes outside the bench's tree used over the span."""
        after = processes()
        busy = busy_ticks() - self.busy
        wall = max(time.monotonic() - self.started, 1e-9)
        ours = descendants(self.root, self.before, after)
        mine = sum(self._used(pid, p, True) for pid, p in after.items() if pid in ours)
        other = max(busy - mine, 0) / TICKS_PER_S
        share = other / (wall * cores())
        named = ((p.name, pid, round(self._used(pid, p, False) / TICKS_PER_S, 2)) for pid, p in after.items())
        busiest = sorted((n for n in named if n[1] not in ours and n[2] >= 0.05), key=lambda n: -n[2])
        return {
            "wall_s": round(wall, 2),
            "other_cpu_s": round(other, 2),
            "other_share_of_cores": round(share, 3),
            "busiest_others": [list(b) for b in busiest[:3]],
            "suspect": share > SUSPECT_SHARE,
        }


def describe(load: dict) -> str:
    """One line for a bench's output."""
    line = f"other processes used {load['other_share_of_cores']:.1%} of the cores ({load['other_cpu_s']} CPU s)"
    if load["busiest_others"]:
        line += ", busiest: " + ", ".join(f"{n} (pid {p}, {s} s)" for n, p, s in load["busiest_others"])
    return line + ("; timings suspect" if load["suspect"] else "")
