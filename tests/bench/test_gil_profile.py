"""bench/gil_profile.py: py-spy's GIL samples of a running process, summarised per thread and per place."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench import gil_profile

RAW = """thread (0x1): MainThread;<module> (x.py:1);Worker.run (worker/stream/loop.py:10);Worker._step (worker/stream/loop.py:20) 50
thread (0x2): decider-gpu_0;_worker (concurrent/futures/thread.py:83);SchemaEngine._score_step (engine/schema_engine.py:270);copy_ (torch/x.py:5) 25
thread (0x2): decider-gpu_0;_worker (concurrent/futures/thread.py:83);fill_ids (engine/readout.py:19) 25
thread (0x3): decider-tok_0;_worker (concurrent/futures/thread.py:83);encode (tokenizers/x.py:9) 10
"""


def test_summarize_gives_each_threads_share_of_the_wall_time_and_where_it_held_the_gil():
    summary = gil_profile.summarize(RAW, seconds=1.0)          # 250 samples a second were taken
    assert summary["gil_held_share"] == round(110 / 250, 4)
    assert summary["by_thread"] == {"MainThread": 0.2, "decider-gpu_0": 0.2, "decider-tok_0": 0.04}
    # the read-out is the engine's compute (on the GPU, inside the step's graph), the rest is the host's
    assert summary["engine_share"] == 0.1 and summary["non_engine_share"] == round(85 / 250, 4)
    places = {(p["thread"], p["where"]): p["share"] for p in summary["top"]}
    # the deepest frame of the project's code, else the innermost frame
    assert places[("MainThread", "Worker._step (worker/stream/loop.py:20)")] == 0.2
    assert places[("decider-gpu_0", "SchemaEngine._score_step (engine/schema_engine.py:270)")] == 0.1
    assert places[("decider-gpu_0", "fill_ids (engine/readout.py:19)")] == 0.1
    assert places[("decider-tok_0", "encode (tokenizers/x.py:9)")] == 0.04


SPINNER = """
import threading, time
def spin():
    while True:
        sum(range(1000))
threading.Thread(target=spin, name="busy", daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""


def test_a_python_thread_spinning_holds_the_gil_and_a_sleeping_one_does_not(tmp_path):
    if gil_profile.py_spy() is None:
        pytest.fail("py-spy is one of the test extras: pip install -e .[test]")
    process = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        raw = tmp_path / "gil.txt"
        summary = gil_profile.finish(gil_profile.record(process.pid, 2, raw), raw, 2)
        if "error" in summary and "ermission" in summary["error"]:
            pytest.skip(f"py-spy may not ptrace here: {summary['error']}")
        assert "error" not in summary, summary
        assert summary["by_thread"].get("busy", 0) > 0.5, summary
        assert summary["by_thread"].get("MainThread", 0) < 0.05, summary
    finally:
        process.kill()
        process.wait()
