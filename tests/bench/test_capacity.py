"""`stream_bench.py --capacity`: the rule that turns measured windows into a budget's capacity, and a quick CPU run
through the latency proxy, exactly once."""
import json

import pytest

from bench import cgroup_cpu
from bench.capacity import capacity_of, compare_plot, holds, loads_from, plot
from tests.brokers import bench_broker_args

GRID = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]


def _sample(p99_ms: float, over: int, visible: int = 1000) -> dict:
    return {"p99_ms": p99_ms, "over_budget": over, "measured_visible": visible}


def test_a_window_holds_with_p99_within_the_budget_and_at_most_one_percent_over_it():
    assert holds(_sample(25.0, 10), 25)
    assert not holds(_sample(25.1, 0), 25)
    assert not holds(_sample(20.0, 11), 25)   # p99 within, but 1.1% of its states over


def test_capacity_is_the_highest_load_held_with_every_lower_load_held():
    points = [{"load": 0.3, "held": True}, {"load": 0.4, "held": True}, {"load": 0.5, "held": False},
              {"load": 0.6, "held": True}]
    assert capacity_of(points) == 0.4
    assert capacity_of([{"load": 0.3, "held": False}]) == 0.0
    assert capacity_of([]) == 0.0


def test_a_looser_budget_starts_one_step_below_the_tighter_ones_capacity():
    assert loads_from(GRID, None) == GRID
    assert loads_from(GRID, 0.0) == GRID
    assert loads_from(GRID, 0.6) == [0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    assert loads_from(GRID, 0.3) == GRID


def test_quick_capacity_run_through_a_slower_broker_is_exactly_once(tmp_path):
    from bench.stream_bench import main as stream_main

    result = stream_main([*bench_broker_args(), "--capacity", "--quick", "--states", "60", "--latency-seconds", "2", "--broker-delay-ms", "2",
                          "--latency-budget-ms", "5000", "--capacity-loads", "0.2,0.4", "--capacity-settle-seconds", "2"])
    assert result["broker_delay_ms"] == 2.0 and result["full_load_states_per_s"] > 0
    # the proxy was in the workers' way, and says what it added
    (curve,) = result["budgets"]
    for proxy in (result["full_load"]["proxy"], curve["proxy"]):
        assert proxy["frames"] > 0 and proxy["added_p50_ms"] >= 2.0, proxy
    # the settling states before the first window: at its load, not measured, and in the exactly-once count
    assert result["settle_seconds"] == 2 and curve["settle_states"] == int(0.2 * result["full_load_states_per_s"] * 2)
    assert curve["exactly_once_ok"], curve
    assert [p["load"] for p in curve["points"]] == [0.2, 0.4][:len(curve["points"])]
    assert all(len(p["samples"]) == 2 for p in curve["points"])
    assert result["capacity"] == {"5000": curve["capacity"]} and curve["capacity"] == capacity_of(curve["points"])
    for point in curve["points"]:
        assert point["held"] == all(holds(s, 5000) for s in point["samples"])
        for sample in point["samples"]:
            assert 0 < sample["p50_ms"] <= sample["p99_ms"] and sample["measured_visible"] > 0
            # what the container's CPU quota throttled in the window, where this machine's cgroup says
            if cgroup_cpu.throttling() is not None:
                assert set(sample["cpu_throttled"]) == {"periods", "throttled_periods", "throttled_ms"}
                assert sample["cpu_throttled"]["throttled_ms"] >= 0
    json.dumps(result)  # what --capacity writes on a GPU
    assert plot(result, tmp_path / "capacity.png").stat().st_size > 1000


def test_a_stand_in_capacity_run_models_the_gpu_on_a_cpu(tmp_path):
    """`--engine stand-in`: the worker runs under bench/host_stages.py, its batches scored in the modelled GPU's time,
    at the full shapes; the engine-only rate is the model's; exactly once."""
    from bench.stream_bench import main as stream_main

    result = stream_main([*bench_broker_args(), "--capacity", "--engine", "stand-in", "--device-ms", "9.2,1.8",
                          "--states", "100", "--latency-seconds", "2", "--latency-warmup-seconds", "1",
                          "--latency-budget-ms", "5000", "--capacity-loads", "0.3", "--capacity-samples", "1",
                          "--capacity-settle-seconds", "0", "--full-load-rate", "534", "--out", str(tmp_path)])
    assert result["env"]["engine"] == "stand-in" and result["env"]["state_tokens"] == 128
    assert result["full_load_states_per_s"] == 534
    (curve,) = result["budgets"]
    assert curve["exactly_once_ok"], curve
    (sample,) = curve["points"][0]["samples"]
    # no state is visible sooner than the modelled GPU scores a batch of one
    assert sample["measured_visible"] > 0 and sample["p50_ms"] >= 9.2 + 1.8, sample
    started = [json.loads(line) for path in (tmp_path.glob("*.logs/*.snapshots.jsonl")) for line in
               path.read_text().splitlines()]
    assert started and all(s["engine"] == "stand-in" and s["device_ms"] == "9.2,1.8"
                           for s in started if s["name"] == "started"), started
    assert len(list(tmp_path.glob("*-cpu-stand-in-capacity-delay0ms*.json"))) == 1
    # an A/B in one picture (capacity.py --compare): here the run against itself
    assert compare_plot({"a": [result], "b": [result, result]}, tmp_path / "ab.png").stat().st_size > 1000


def test_a_stand_in_run_refuses_quick_shapes_and_a_bad_device_model(capsys):
    from bench.stream_bench import main as stream_main

    for argv, says in ((["--engine", "stand-in", "--quick"], "full shapes"),
                       (["--engine", "stand-in", "--device-ms", "2.3"], "--device-ms: expected A,B")):
        with pytest.raises(SystemExit) as exit_info:
            stream_main(argv)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_unpadded_batches_leave_a_cycles_tail_to_the_next_exactly_once(tmp_path, monkeypatch):
    """--unpadded-batches on the real worker and Apache Kafka, the stand-in GPU on an H100's measured batch times (its
    graphs pad a batch to a bucket): with a cycle on the GPU, a closing cycle launches a bucket's states and the
    rest open the next one; every state is visible once."""
    from bench.stream_bench import main as stream_main

    monkeypatch.setenv("DECIDER_UNPADDED_BATCHES", "true")
    result = stream_main([*bench_broker_args(), "--capacity", "--engine", "stand-in",
                          "--device-ms", "1:9.16,8:19.24,16:33.76,32:63.28,128:247.5",
                          "--states", "100", "--latency-seconds", "3", "--latency-warmup-seconds", "1",
                          "--latency-budget-ms", "5000", "--capacity-loads", "0.9", "--capacity-samples", "1",
                          "--capacity-settle-seconds", "0", "--full-load-rate", "520", "--out", str(tmp_path)])
    (curve,) = result["budgets"]
    assert curve["exactly_once_ok"], curve
    (log,) = tmp_path.glob("*.logs/cap5000-w0.log")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    cut = [e["message"] for e in events if e.get("message", "").startswith("unpadded batches:")]
    assert cut, "no cycle was cut to its graph's batch size"
    assert [e["scored"] for e in events if e.get("event") == "committed"], "nothing committed"
