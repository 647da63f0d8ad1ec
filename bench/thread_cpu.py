"""The CPU a process's threads burn, by thread name: utime + stime deltas of every thread in ``/proc/PID/task/*/stat``
over a window, as a fraction of one core (``bench/idle_cost.py``'s measure).
"""
from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (thread name, utime + stime in clock ticks) for every thread of ``pid`` now."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        found = _stat_ticks(f"/proc/{pid}/task/{tid}/stat")
        if found is not None:
            out[int(tid)] = found
    return out


def _stat_ticks(path: str) -> tuple[str, int] | None:
    """(name, utime + stime in clock ticks) from a ``stat`` file of proc(5); None once its task is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12])  # fields 14, 15 of stat


def cpu_by_thread(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Core fractions per thread name between two ``thread_ticks`` readings (threads alive at the end)."""
    out: dict[str, float] = {}
    for tid, (name, ticks) in after.items():
        start = before.get(tid, (name, 0))[1] if tid in before else 0
        out[name] = out.get(name, 0.0) + (ticks - start) / TICK / seconds
    return out


def measure(pids: dict[str, int], window_s: float) -> dict[str, dict[str, float]]:
    """Core fractions per thread name of each named process over ``window_s`` (all sampled in the same window)."""
    before = {key: thread_ticks(pid) for key, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(window_s)
    seconds = time.monotonic() - t0
    after = {key: thread_ticks(pid) for key, pid in pids.items()}
    return {key: cpu_by_thread(before[key], after[key], seconds) for key in pids}


def summary(cpu: dict[str, float]) -> dict[str, float]:
    """Total plus the threads that matter, rounded."""
    out = {"total": round(sum(cpu.values()), 4)}
    for name, frac in sorted(cpu.items(), key=lambda kv: -kv[1]):
        if frac >= 0.0005:
            out[name] = round(out.get(name, 0) + frac, 4)
    return out


def thread_cpu_ns(pid: int | None = None) -> dict[int, tuple[str, int]]:
    """tid -> (thread name, CPU nanoseconds) for every thread of ``pid`` (default: this process) now, read from each
    thread's CPU clock (``clock_gettime`` on the clock id Linux derives from a tid: nanoseconds, where the ``stat``
    ticks of ``thread_ticks`` are 10 ms); a thread that ended meanwhile is left out."""
    pid = os.getpid() if pid is None else pid
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in map(int, tids):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[tid] = (name, time.clock_gettime_ns((~tid << 3) | 6))   # CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD
        except (FileNotFoundError, ProcessLookupError, OSError):
            continue
    return out


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) that process ``pid`` has burnt so far, all its threads (0 once it is gone)."""
    found = _stat_ticks(f"/proc/{pid}/stat")
    return found[1] / TICK if found is not None else 0.0


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal): CPU seconds of every core of this machine since boot, from ``/proc/stat``; busy is all but idle,
    I/O wait and steal (what the hypervisor gave other machines while this one's threads were ready to run)."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (cpu + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / TICK, steal / TICK
