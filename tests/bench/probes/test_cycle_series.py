"""bench/probes/cycle_series.py: a worker's committed cycles over time, read from a run's logs archive."""
from pathlib import Path

import pytest

from bench.probes import cycle_series
from bench.stream_windows import log_events

RUN_DI = Path(__file__).resolve().parents[3] / "bench/results/2026-12-06-nvidia-h100-run-di-unpadded.logs.tar.xz"


def test_a_runs_committed_cycles_from_its_archive_and_their_picture(tmp_path):
    series = cycle_series.committed_series(log_events(cycle_series.read_log(f"{RUN_DI}:cap100-w0.log")))
    assert len(series) > 1000
    seconds, states, a2v = zip(*series)
    assert seconds[0] == 0 and max(seconds) > 20 and sum(states) > 50_000     # four windows of 8 s and more
    assert all(n >= 0 for n in states) and min(a2v) > 0
    png = cycle_series.plot({"unpadded": series}, tmp_path / "cycles.png", budget_ms=100)
    assert png.stat().st_size > 10_000


def test_a_member_the_archive_lacks_is_named():
    with pytest.raises(SystemExit, match="no member named nope.log"):
        cycle_series.read_log(f"{RUN_DI}:nope.log")
