"""The benchmark stays runnable: `engine_bench.py --quick` on the CPU, tiny model."""
import pytest

from bench.engine_bench import main
from tests.brokers import bench_broker_args

FIELDS = {"method", "batch", "state_tokens", "states_per_s", "tokens_per_s", "gemm_fraction", "p50_ms", "p99_ms"}


def test_quick_run_measures_every_cpu_method(capsys):
    result = main(["--quick", "--iters", "1"])
    runs = result["runs"]
    assert {r["method"] for r in runs} == {"reference", "full_fast", "cached_eager"}
    assert {r["batch"] for r in runs} == {1, 4}
    for r in runs:
        assert FIELDS <= r.keys()
        assert r["states_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
    assert {"gpu", "torch", "transformers", "fla"} <= result["env"].keys()
    assert max(result["parity"].values()) < 1e-4
    assert "| method | batch |" in capsys.readouterr().out


def test_each_batch_times_its_methods_in_both_orders():
    """Half of every method's iterations in the given order, half in the reverse (run FD: the method timed second
    was up to 2.2% slower at batch 128 in one order)."""
    from bench.engine_bench import alternated

    assert alternated(["fast", "det"], 10) == [("fast", 5), ("det", 5), ("det", 5), ("fast", 5)]
    assert alternated(["a", "b", "c"], 7) == [("a", 4), ("b", 4), ("c", 4), ("c", 3), ("b", 3), ("a", 3)]
    assert alternated(["a", "b"], 1) == [("a", 1), ("b", 1)]


def test_quick_run_times_every_iteration_of_both_orders(capsys):
    result = main(["--quick", "--iters", "3", "--batches", "1", "--methods", "full_fast,cached_eager"])
    assert [(r["method"], r["batch"]) for r in result["runs"]] == [("full_fast", 1), ("cached_eager", 1)]
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 and r["iters"] == 3 for r in result["runs"])


def test_quick_many_schemas_run_times_mixed_and_per_schema_batches(capsys):
    result = main(["--quick", "--iters", "1", "--schemas", "1,3"])
    runs = result["runs"]
    assert {(r["method"], r["schemas"]) for r in runs} == {(m, n) for m in ("mixed", "per_schema") for n in (1, 3)}
    assert all(r["states_per_s"] > 0 and r["bank_mb"] > 0 for r in runs)
    assert "| mixed | 3 |" in capsys.readouterr().out


def test_wide_schemas_bench_times_the_shapes_side_by_side(capsys):
    from bench.wide_schemas import main as wide_main

    runs = wide_main(["--shapes", "10x4,3x26", "--batches", "1,2", "--tables", "deterministic", "--iters", "1"])
    assert [(r["shape"], r["batch"]) for r in runs] == [("10x4", 1), ("3x26", 1), ("10x4", 2), ("3x26", 2)]
    assert all(r["ms"] > 0 and r["states_per_s"] > 0 for r in runs)
    assert "3x26   batch   2:" in capsys.readouterr().out


def test_stream_bench_quick_runs_end_to_end_exactly_once():
    """Embedded broker + a real worker process + load generator, on the CPU; every phase verifies exactly-once."""
    from bench.stream_bench import main as stream_main

    result = stream_main([*bench_broker_args(), "--quick", "--states", "60", "--latency-seconds", "2", "--latency-budget-ms", "3000", "--replay",
                          "--gil-profile"])
    phases = [r["phase"] for r in result["runs"]]
    assert phases == ["throughput", "latency", "latency", "replay"]
    tput, lat, budget, replay = result["runs"]
    for r in (tput, lat, budget):
        assert r["ok"], r
    assert tput["states_per_s"] > 0 and result["engine_only_states_per_s"] > 0
    # one worker: it held partitions before the warm-up, so the all-workers window is the whole 10-90% window
    assert tput["assignment_spread_s"] == 0 and tput["all_workers_window_cut_s"] == 0, tput
    assert tput["all_workers_states_per_s"] > 0 and len(tput["per_worker_states_per_s"]) == 1, tput
    assert tput["rebalances_in_window"] == 0, tput
    assert 0 < lat["p50_ms"] <= lat["p99_ms"]
    # the budget phase ran its worker with the budget, and reports states and cycles over it
    assert budget["latency_budget_ms"] == 3000 and budget["max_wait_ms"] == 3000, budget
    assert 0 < budget["p50_ms"] <= budget["p99_ms"] and 0 <= budget["over_budget"] <= budget["states"]
    assert budget["worker0_cycles"] > 0 and 0 <= budget["worker0_cycles_over_budget"] <= budget["worker0_cycles"]
    # and where its cycles' time went, from the worker's committed events
    timeline = budget["worker0_timelines"]["all"]
    assert timeline["cycles"] > 0 and all(timeline[k] >= 0 for k in ("to_close_ms", "close_to_launch_ms",
                                                                       "launch_to_scored_ms", "scored_to_visible_ms",
                                                                       "close_to_taken_ms", "taken_to_gathered_ms",
                                                                       "gathered_to_launch_ms",
                                                                       "close_to_submitted_ms",
                                                                       "submitted_to_taken_ms"))
    # and how its cycles followed one another on the device (the worker's committed events on its monotonic clock)
    pipeline = budget["worker0_pipeline"]
    assert pipeline["cycles"] >= 2 and 0 < pipeline["gpu_busy_fraction"] <= 1, pipeline
    assert pipeline["idle_before_launch_ms"] >= 0, pipeline
    # and which of its threads held the GIL, sampled by py-spy over the measured window (the loop consumed meanwhile)
    gil = budget["worker0_gil"]
    assert "error" not in gil and gil["by_thread"].get("MainThread", 0) > 0, gil
    # the replay scored every state of the live latency phase, and each has a live record to compare with
    assert replay["exit_code"] == 0 and replay["states_per_s"] > 0, replay
    assert replay["states"] == replay["compared"] > 0, replay
    # its steady rate (first commit to last) and the startup before its first commit, from its own log
    assert replay["steady_states_per_s"] > 0 and replay["startup_s"] > 0 and replay["commits"] > 1, replay
    assert replay["process_s"] > replay["startup_s"] + replay["first_to_last_commit_s"], replay


@pytest.mark.parametrize("flag", ["--max-wait-ms", "--latency-budget-ms"])
def test_stream_bench_refuses_a_repeated_phase_value(flag, capsys):
    """Phases are named by their value (their topics and group): a repeated value would read the earlier phase's
    states and report its records as duplicates, so the bench refuses it before starting anything."""
    from bench.stream_bench import main as stream_main

    with pytest.raises(SystemExit):
        stream_main(["--quick", flag, "25,25"])
    assert "each value at most once" in capsys.readouterr().err


def test_pipelined_timing_launches_each_batch_before_reading_the_one_ahead():
    """`pipelined` on the tiny engine (CPU): every launch's scores are read, each after the next launch was made, and
    the per-batch times it reports cover its windows."""
    import argparse

    from bench.engine_bench import PIPELINE_WINDOW, pipelined
    from bench.workload import build_engine, questions, states
    from engine import SchemaEngine

    eng, _ = build_engine(argparse.Namespace(quick=True, device="cpu", dtype="float32"))
    se = SchemaEngine(eng, use_graphs=False)
    h = se.prepare(questions(eng.tok, 3, 4, 60))
    rows = [se.tokenize(h, s) for s in states(eng.tok, 2, 32, seed=1)]
    expected = [[[round(p, 6) for p in q] for q in s] for s in se.score_mixed([(h, r) for r in rows])]
    events = []

    class Recorded:
        def __init__(self, n):
            self.n, self.pending = n, se.launch_mixed([(h, r) for r in rows])

        def result(self):
            events.append(("read", self.n))
            got = self.pending.result()
            assert [[[round(p, 6) for p in q] for q in s] for s in got] == expected
            return got

    def launch():
        events.append(("launch", len([e for e in events if e[0] == "launch"])))
        return Recorded(events[-1][1])

    times = pipelined(launch, iters=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    launches = [n for kind, n in events if kind == "launch"]
    reads = [n for kind, n in events if kind == "read"]
    assert len(launches) == 1 + 2 * PIPELINE_WINDOW and sorted(reads) == launches
    for n in reads[1:]:                     # in a window, batch n is read once batch n + 1 was launched (but the last)
        last_of_window = n % PIPELINE_WINDOW == 0
        assert last_of_window or events.index(("launch", n + 1)) < events.index(("read", n))


def test_quick_run_sets_engine_switches_and_records_them(monkeypatch):
    from engine import model

    monkeypatch.setattr(model, "ANSWER_QUERIES", False)         # restored after the test; --set changes it for the run
    result = main(["--quick", "--iters", "1", "--batches", "1", "--methods", "cached_eager",
                   "--set", "engine.model.ANSWER_QUERIES=True"])
    assert model.ANSWER_QUERIES is True
    assert result["env"]["settings"] == ["engine.model.ANSWER_QUERIES=True"]
    with pytest.raises(SystemExit):
        main(["--quick", "--set", "engine.model.NO_SUCH_SWITCH=1"])


def test_quick_run_times_the_read_out_with_and_without_the_label_mass(capsys):
    """`METHOD_no_label_mass` times the same method on a SchemaEngine without the label mass (issue 34 sets its default
    by that difference at batch 128 on the H200); the markdown states the difference."""
    result = main(["--quick", "--iters", "1", "--batches", "1,4", "--methods",
                   "cached_eager,cached_eager_no_label_mass,cached_eager_deterministic_no_label_mass"])
    assert {(r["method"], r["batch"]) for r in result["runs"]} == {
        (m, b) for m in ("cached_eager", "cached_eager_no_label_mass", "cached_eager_deterministic_no_label_mass")
        for b in (1, 4)}
    out = capsys.readouterr().out
    assert "batch 4, 32-token states: the label mass costs " in out and "of cached_eager's states/s" in out
