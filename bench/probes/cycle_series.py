"""Each committed cycle of a worker's log over time: its states, its first state's arrival -> visible and the GPU's
idle time before its launch (its launch after the cycle ahead's scores; below 0: queued behind it), three panels per
log, to see what a capacity window's tail was made of (a queue, a plateau of padded batches, a burst, a GPU left idle).

    python bench/probes/cycle_series.py padded=RESULT.logs.tar.xz:cap100-w0.log unpadded=... --png out.png

A log is a worker's log file, or ``ARCHIVE:MEMBER`` for one inside a ``stream_bench.py`` logs archive (.tar.xz).
"""
from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.stream_windows import gpu_pipeline, log_events  # noqa: E402


def read_log(spec: str) -> str:
    """The text of a log: a file, or ``ARCHIVE:MEMBER`` (the member found by its file name anywhere in the archive)."""
    if ":" not in spec or Path(spec).exists():
        return Path(spec).read_text(errors="replace")
    archive, member = spec.rsplit(":", 1)
    with tarfile.open(archive) as tar:
        found = [m for m in tar.getmembers() if Path(m.name).name == member]
        if not found:
            raise SystemExit(f"{archive}: no member named {member}")
        return tar.extractfile(found[0]).read().decode(errors="replace")


def committed_series(events: list[dict]) -> list[tuple[float, int, float]]:
    """(seconds since the first committed cycle, states scored, arrival -> visible ms) per committed cycle of a log's
    ``events`` (``bench.stream_windows.log_events``)."""
    cycles = [e for e in events if e["event"] == "committed" and "arrived_monotonic_ms" in e]
    if not cycles:
        return []
    start = cycles[0]["arrived_monotonic_ms"]
    return [((e["arrived_monotonic_ms"] - start) / 1000, e["scored"], e["arrival_to_visible_ms"]) for e in cycles]


def idle_before_launch(events: list[dict]) -> list[tuple[float, float]]:
    """(seconds since the first committed cycle, ms from the scores of the cycle launched before it to its launch)
    per launched cycle of a log's ``events``, in launch order."""
    cycles = [e for e in events if e["event"] == "committed" and e.get("launched_ms") is not None
              and e.get("scored_ms") is not None and "arrived_monotonic_ms" in e]
    if not cycles:
        return []
    start = min(e["arrived_monotonic_ms"] for e in cycles)
    at = lambda e, field: e["arrived_monotonic_ms"] + e[field]  # noqa: E731
    cycles.sort(key=lambda e: at(e, "launched_ms"))
    return [((at(e, "launched_ms") - start) / 1000, at(e, "launched_ms") - at(ahead, "scored_ms"))
            for ahead, e in zip(cycles, cycles[1:])]


def plot(series: dict[str, list[tuple[float, int, float]]], path: Path, budget_ms: float | None,
         gaps: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 3 if gaps else 2
    fig, axes = plt.subplots(rows * len(series), 1, figsize=(11, 1.6 * rows * len(series)), sharex=True)
    axes = [axes[r::rows] for r in range(rows)]
    for k, (label, points) in enumerate(series.items()):
        t, n, a2v = zip(*points) if points else ((), (), ())
        latency, states = axes[0][k], axes[1][k]
        latency.plot(t, a2v, ".", ms=2)
        if budget_ms:
            latency.axhline(budget_ms, color="red", lw=0.8, ls="--", label=f"budget {budget_ms:g} ms")
            latency.legend(loc="upper right")
            latency.set_ylim(0, 4 * budget_ms)      # the start's warm-up cycles (seconds) off the scale
        latency.set_ylabel("arrival -> visible, ms")
        latency.set_title(label)
        states.plot(t, n, ".", ms=2, color="tab:green")
        states.set_ylabel("states a cycle")
        if gaps:
            idle = axes[2][k]
            g_t, g_ms = zip(*gaps[label]) if gaps[label] else ((), ())
            idle.plot(g_t, g_ms, ".", ms=2, color="tab:purple")
            idle.axhline(0, color="grey", lw=0.6)
            idle.set_ylim(-30, 30)
            idle.set_ylabel("GPU idle before\nlaunch, ms")
    fig.axes[-1].set_xlabel("seconds since the first committed cycle (by its first state's arrival)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="LABEL=LOG or LABEL=ARCHIVE:MEMBER")
    ap.add_argument("--png", required=True, type=Path)
    ap.add_argument("--budget-ms", type=float, default=None, help="draw the latency budget")
    ap.add_argument("--gaps", action="store_true", help="a third panel: the GPU's idle time before each launch")
    args = ap.parse_args(argv)
    series, gaps = {}, {}
    for item in args.logs:
        label, sep, spec = item.partition("=")
        if not sep:
            ap.error(f"{item!r}: expected LABEL=LOG")
        events = log_events(read_log(spec))      # parsed once for the three views of it
        series[label] = committed_series(events)
        gaps[label] = idle_before_launch(events)
        print(f"{label}: {len(series[label])} committed cycles; GPU pipeline {gpu_pipeline(events)}")
    print(f"wrote {plot(series, args.png, args.budget_ms, gaps if args.gaps else None)}")


if __name__ == "__main__":
    main()
