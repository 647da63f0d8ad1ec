"""The CPU quota the benchmark's processes run under, and how often the kernel throttled them to it (cgroup v2 or v1).

A container with a CPU quota (``cpu.max``, or v1's ``cpu.cfs_quota_us``) that its processes exceed within a period
(100 ms by default) is stopped for the rest of that period: every thread of the worker, the broker and the bench at
once. Seen from the worker, that is a stall of up to tens of milliseconds in whichever step each thread was in; the
capacity windows record the throttled time alongside their latencies (``bench.stream_phases.latency_window``), so that
a tail of such stalls is not charged to the GPU or the broker alone (run CW, bench/README.md).
"""
from __future__ import annotations

from pathlib import Path

_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")


def _fields(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines() if line.strip())}
    except (OSError, ValueError):
        return {}


def throttling(root_v2: Path = _V2, root_v1: Path = _V1) -> dict | None:
    """The cgroup's counters now: {"periods", "throttled_periods", "throttled_ms"}; None where neither version's
    ``cpu.stat`` has them (no quota controller visible)."""
    v2 = _fields(root_v2 / "cpu.stat")
    if "nr_throttled" in v2 and "throttled_usec" in v2:
        return {"periods": v2.get("nr_periods", 0), "throttled_periods": v2["nr_throttled"],
                "throttled_ms": v2["throttled_usec"] / 1000}
    v1 = _fields(root_v1 / "cpu.stat")
    if "nr_throttled" in v1 and "throttled_time" in v1:
        return {"periods": v1.get("nr_periods", 0), "throttled_periods": v1["nr_throttled"],
                "throttled_ms": v1["throttled_time"] / 1e6}
    return None


def throttled_between(before: dict | None, after: dict | None) -> dict | None:
    """What the kernel throttled between two ``throttling()`` readings: {"periods", "throttled_periods",
    "throttled_ms"}; None without both."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before[k], 3) for k in ("periods", "throttled_periods", "throttled_ms")}


def quota_cpus(root_v2: Path = _V2, root_v1: Path = _V1) -> float | None:
    """The quota in CPUs (quota / period); None where there is none ("max", -1) or none is visible."""
    try:
        quota, period = (root_v2 / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root_v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((root_v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us < 0 else quota_us / period_us
