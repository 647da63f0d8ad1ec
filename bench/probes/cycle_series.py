"""Each committed cycle of a worker's log over time: its states and its first state's arrival -> visible, one panel
pair per log, to see what a capacity window's tail was made of (a queue, a plateau of padded batches, a burst).

    python bench/probes/cycle_series.py padded=RESULT.logs.tar.xz:cap100-w0.log unpadded=... --png out.png

A log is a worker's log file, or ``ARCHIVE:MEMBER`` for one inside a ``stream_bench.py`` logs archive (.tar.xz).
"""
from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.stream_windows import log_events  # noqa: E402


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


def committed_series(text: str) -> list[tuple[float, int, float]]:
    """(seconds since the first committed cycle, states scored, arrival -> visible ms) per committed cycle."""
    cycles = [e for e in log_events(text) if e["event"] == "committed" and "arrived_monotonic_ms" in e]
    if not cycles:
        return []
    start = cycles[0]["arrived_monotonic_ms"]
    return [((e["arrived_monotonic_ms"] - start) / 1000, e["scored"], e["arrival_to_visible_ms"]) for e in cycles]


def plot(series: dict[str, list[tuple[float, int, float]]], path: Path, budget_ms: float | None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(series), 1, figsize=(11, 3.2 * len(series)), sharex=True)
    for k, (label, points) in enumerate(series.items()):
        t, n, a2v = zip(*points) if points else ((), (), ())
        axes[2 * k].plot(t, a2v, ".", ms=2)
        if budget_ms:
            axes[2 * k].axhline(budget_ms, color="red", lw=0.8, ls="--", label=f"budget {budget_ms:g} ms")
            axes[2 * k].legend(loc="upper right")
            axes[2 * k].set_ylim(0, 4 * budget_ms)      # the start's warm-up cycles (seconds) off the scale
        axes[2 * k].set_ylabel("arrival -> visible, ms")
        axes[2 * k].set_title(label)
        axes[2 * k + 1].plot(t, n, ".", ms=2, color="tab:green")
        axes[2 * k + 1].set_ylabel("states a cycle")
    axes[-1].set_xlabel("seconds since the first committed cycle (by its first state's arrival)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="LABEL=LOG or LABEL=ARCHIVE:MEMBER")
    ap.add_argument("--png", required=True, type=Path)
    ap.add_argument("--budget-ms", type=float, default=None, help="draw the latency budget")
    args = ap.parse_args(argv)
    series = {}
    for item in args.logs:
        label, sep, spec = item.partition("=")
        if not sep:
            ap.error(f"{item!r}: expected LABEL=LOG")
        series[label] = committed_series(read_log(spec))
        print(f"{label}: {len(series[label])} committed cycles")
    print(f"wrote {plot(series, args.png, args.budget_ms)}")


if __name__ == "__main__":
    main()
