"""The latency-budget model runs the worker's real planner; its --quick run keeps it runnable."""
import pytest

from bench.probes.budget_model import Costs, main, simulate


def test_quick_run_reports_each_budget():
    results = main(["--quick", "--budgets", "50,100"])
    assert [r["budget_ms"] for r in results] == [50.0, 100.0]
    assert all(0 < r["p50_ms"] <= r["p99_ms"] and r["mean_batch"] >= 1 for r in results)


def test_batches_follow_the_load_not_the_budget_and_a_costlier_gpu_is_slower():
    costs = Costs()
    tight, loose = simulate(300, 50, costs, seconds=3), simulate(300, 200, costs, seconds=3)
    assert loose["mean_batch"] == tight["mean_batch"] and loose["p99_ms"] < 50   # nothing waits for the deadline
    busier = simulate(900, 50, costs, seconds=3)
    assert busier["mean_batch"] > 2 * tight["mean_batch"]       # states that arrive while a batch runs join the next
    slow = simulate(300, 50, Costs(batch_fixed_ms=20.0), seconds=3)
    assert slow["p50_ms"] > tight["p50_ms"]


def test_measured_batch_times_are_joined_by_straight_lines():
    h100 = Costs(batch_ms=((1, 2.41), (8, 5.4), (32, 16.2), (128, 63.5)))
    assert h100.gpu_ms(8) == 5.4 and h100.gpu_ms(20) == 5.4 + (16.2 - 5.4) * 12 / 24
    assert h100.gpu_ms(128) == pytest.approx(63.5)
    assert Costs().gpu_ms(10) == Costs().batch_fixed_ms + 10 * Costs().per_row_ms   # no points: the line


def test_a_stall_of_the_loop_delays_the_states_behind_it():
    calm = simulate(600, 100, Costs(), seconds=3)
    stalled = simulate(600, 100, Costs(), seconds=3, stalls=((1500.0, 80.0),))
    assert stalled["p99_ms"] > calm["p99_ms"] + 40       # the states that arrived during the 80 ms waited for it
    quick = ["--quick", "--rate", "600", "--budgets", "100"]
    assert main([*quick, "--stalls", "1500:80"])[0]["p99_ms"] > main(quick)[0]["p99_ms"] + 40
