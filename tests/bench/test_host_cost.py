"""bench/host_cost.py: the worker's host CPU by thread and by stage, per state and per cycle, and the GIL's share."""
import json
import os

import pytest

from bench import host_cost
from tests.brokers import bench_broker_args


def test_a_short_run_reports_host_cost_by_thread_and_by_stage(tmp_path):
    out = tmp_path / "host-cost.json"
    result = host_cost.main([*bench_broker_args(), "--rate", "150", "--seconds", "2", "--warmup-seconds", "1",
                             "--out", str(out)])
    assert out.is_file()
    light, staged = result["runs"]
    for run in (light, staged):
        assert run["ok"] and run["states"] > 0 and run["cycles"] > 0, run      # exactly once, and it scored
        assert run["engine_forwards"] > 0 and run["host_us_per_state"] > 0, run
        # the engine's forward is timed apart: host time is every thread's CPU less the forward's
        assert run["host_us_per_state"] == round(run["python_host_us_per_state"] + run["native_client_us_per_state"], 2) \
            or abs(run["host_us_per_state"] - run["python_host_us_per_state"] - run["native_client_us_per_state"]) < 0.05
        assert run["cycle"]["small_cycles"] > 0 and run["cycle"]["close_to_launch_p50_ms"] > 0, run["cycle"]
        # what ran beside it: the broker's CPU (a process of its own) and the machine's busy cores
        assert run["broker_cpu_us_per_state"] > 0 and 0 < run["machine_busy_cores"] <= os.cpu_count(), run
    # py-spy's GIL samples, outside the engine's compute and in it
    assert 0 < light["gil"]["non_engine_share"] <= light["gil"]["gil_held_share"] <= 1, light["gil"]
    # every stage of the path was found and charged on its thread; a thread's stages and its "other" add up to its CPU
    rows = staged["stages"]
    charged = {(r["thread"], r["stage"]) for r in rows}
    assert {("MainThread", "decode"), ("MainThread", "route"), ("MainThread", "records"), ("decider-gpu", "launch"),
            ("decider-gpu", "pad"), ("decider-collect", "read_back"), ("decider-committer", "produce")} <= charged
    assert any(stage == "tokenize" for _, stage in charged)
    assert not staged["missing_stages"], staged["missing_stages"]
    for thread, spent in staged["by_thread_us_per_state"].items():
        if thread.startswith(("MainThread", "decider-")):
            in_rows = sum(r["us_per_state"] for r in rows if r["thread"] == thread)
            assert abs(in_rows - spent) <= 0.02 * spent + 0.5, (thread, in_rows, spent)
            assert all(r["us_per_state"] >= -0.5 for r in rows if r["thread"] == thread and r["stage"] == "other")
    assert 0 < staged["wrapper_overhead_ns"]["self_ns"] < 20_000
    summary = result["summary"][light["tree"]]
    assert summary["exactly_once"] and summary["windows"] == 2 and summary["host_us_per_state"] > 0
    # the PNG beside the JSON, and again from the JSON alone
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000
    png.unlink()
    assert host_cost.main(["--plot", str(out)]) == json.loads(out.read_text()) and png.stat().st_size > 1000


def test_the_stand_ins_gpu_is_a_line_or_a_gpus_measured_batch_times():
    from bench.host_stages import device_ms_at, parse_device_ms, stand_in_batch_ms

    line = parse_device_ms("2.3,0.45")
    assert device_ms_at(line, 1) == pytest.approx(2.75) and device_ms_at(line, 128) == pytest.approx(59.9)
    measured = parse_device_ms("8:5.33,1:2.55,32:16.74,128:63.58")     # any order
    assert device_ms_at(measured, 8) == 5.33 and device_ms_at(measured, 20) == pytest.approx((5.33 + 16.74) / 2)
    assert device_ms_at(measured, 256) == pytest.approx(63.58 + (63.58 - 16.74) / 96 * 128)   # the last two's line
    # a measured GPU runs a batch as its graph's bucket (9 states: 10), a line the states themselves
    assert stand_in_batch_ms(measured, 9) == device_ms_at(measured, 10)
    assert stand_in_batch_ms(line, 9) == device_ms_at(line, 9)
    for bad in ("2.3", "8:5.3", "8:5.3,8:6.0", "a,b"):
        with pytest.raises(ValueError):
            parse_device_ms(bad)


def test_each_repetition_starts_at_another_tree():
    """A later window costs more than an earlier one (the broker warms up): no tree may always run first, and each
    window keeps its tree's index (its log's name)."""
    assert host_cost.window_order(["/tmp/before", "."], 3) == [(0, 0, "/tmp/before"), (0, 1, "."), (1, 1, "."),
                                                              (1, 0, "/tmp/before"), (2, 0, "/tmp/before"), (2, 1, ".")]
    assert [t for _, t, _ in host_cost.window_order(["a", "b", "c"], 3)] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
