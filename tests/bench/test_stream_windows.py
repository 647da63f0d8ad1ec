"""The stream benchmark's steady-state windows, from log lines written by the worker's own JSON formatter."""
import logging

import pytest

from bench.stream_windows import (all_workers_window, budget_plan_errors, cycle_timelines, gpu_pipeline, held_partitions, log_events,
                                  replay_timing)
from worker.ops.logs import JsonFormatter

T0 = 1_790_000_000.0  # an epoch second; events are placed relative to it


def _line(t: float, event: str, **fields) -> str:
    """One event as `decider worker --log-format json` writes it, logged at wall time T0 + t."""
    record = logging.LogRecord("decider.events", logging.INFO, __file__, 1, event.replace("_", " "), None, None)
    record.created, record.msecs = T0 + t, (T0 + t) % 1 * 1000
    record.fields = {"event": event, **fields}
    return JsonFormatter().format(record)


def _log(*lines: str) -> list[dict]:
    return log_events("\n".join(lines))


def _committing(start: float, end: float, every: float, states: int) -> list[str]:
    n = int(round((end - start) / every))
    return [_line(start + k * every, "committed", scored=states, dead_letters={}, commit_ms=3.0) for k in range(n + 1)]


def test_events_keep_their_wall_time_and_other_output_is_skipped():
    text = "\n".join(["plain stderr line", _line(1.25, "assigned", partitions=[0, 1]) + "\r  3/60 [00:01<00:02]",
                      "\r" + _line(2.5, "committed", scored=16, dead_letters={"schema_unknown": 2}), "{not json"])
    events = log_events(text)
    assert [e["event"] for e in events] == ["assigned", "committed"]
    assert events[0]["t"] == pytest.approx(T0 + 1.25, abs=2e-3) and events[0]["partitions"] == [0, 1]
    assert events[1]["t"] == pytest.approx(T0 + 2.5, abs=2e-3) and events[1]["scored"] == 16


def test_held_partitions_follow_assignments_revokes_and_a_restart():
    events = _log(_line(0, "assigned", partitions=[0, 1, 2, 3]), _line(4, "revoked", partitions=[0, 1, 2, 3]),
                  _line(4.1, "assigned", partitions=[0, 1]))
    assert held_partitions(events) == {0, 1}
    assert held_partitions(events + _log(_line(9, "model_loaded", model_id="m", device="cpu"))) == set()
    assert held_partitions(_log(_line(0, "assigned", partitions=[2]), _line(1, "lost", partitions=[2]))) == set()


def test_the_window_starts_when_the_late_worker_has_committed_and_rates_are_per_worker():
    # worker 0 holds everything from 0 s; worker 1 joins at 4 s (eager rebalance: worker 0 gives all up, gets half)
    w0 = _log(_line(0, "assigned", partitions=[0, 1, 2, 3]), *_committing(0.5, 3.9, 0.1, 16),
              _line(4.0, "revoked", partitions=[0, 1, 2, 3]), _line(4.05, "assigned", partitions=[0, 1]),
              *_committing(4.2, 12.0, 0.1, 16))
    w1 = _log(_line(4.05, "assigned", partitions=[2, 3]), *_committing(4.5, 12.0, 0.1, 16))
    visible = [T0 + 0.5 + k * 0.005 for k in range(2300)]  # records visible at 200/s from 0.5 s to 12 s
    lo, hi = T0 + 1.0, T0 + 10.0
    window = all_workers_window([w0, w1], visible, lo, hi)
    assert window["assignment_spread_s"] == pytest.approx(4.05, abs=2e-3)
    assert window["all_workers_window_cut_s"] == pytest.approx(3.5, abs=2e-3)
    assert window["all_workers_window_s"] == pytest.approx(5.5, abs=2e-3)
    assert window["all_workers_states_per_s"] == pytest.approx(200, rel=0.01)
    assert window["per_worker_states_per_s"] == [pytest.approx(160, rel=0.03), pytest.approx(160, rel=0.03)]
    assert window["rebalances_in_window"] == 0


def test_a_rebalance_inside_the_window_is_counted_and_a_worker_steady_too_late_leaves_no_window():
    w0 = _log(_line(0, "assigned", partitions=[0, 1]), *_committing(0.2, 10, 0.1, 8))
    w1 = _log(_line(0, "assigned", partitions=[2, 3]), *_committing(0.2, 10, 0.1, 8), _line(6, "lost", partitions=[2, 3]))
    window = all_workers_window([w0, w1], [], T0 + 1, T0 + 9)
    assert window["rebalances_in_window"] == 1 and window["all_workers_window_cut_s"] == 0
    late = _log(_line(0, "assigned", partitions=[2, 3]), _line(9.5, "committed", scored=8, dead_letters={}))
    empty = all_workers_window([w0, late], [], T0 + 1, T0 + 9)
    assert empty["all_workers_states_per_s"] is None and empty["per_worker_states_per_s"] is None
    assert empty["assignment_spread_s"] == 0


def test_replay_startup_is_until_its_first_commit_and_its_steady_rate_counts_after_it():
    events = _log(_line(0, "model_loaded", model_id="m", device="cuda:0"), _line(1.0, "replay_started", total=2000),
                  *_committing(4.6, 5.6, 0.1, 128), _line(5.65, "committed", scored=0, dead_letters={"state_too_large": 2}))
    timing = replay_timing(events)
    assert timing["startup_s"] == pytest.approx(3.6, abs=2e-3)
    assert timing["first_to_last_commit_s"] == pytest.approx(1.05, abs=2e-3)
    assert timing["steady_states_per_s"] == pytest.approx((10 * 128 + 2) / 1.05, rel=5e-3)
    assert timing["commits"] == 12
    assert replay_timing(_log(_line(0, "replay_started"))) == dict(startup_s=None, first_to_last_commit_s=None,
                                                                   steady_states_per_s=None, commits=0)


def test_budget_plan_errors_compare_each_cycles_outcome_with_its_plan_after_the_warm_up():
    planned = [(40.0, 45.0), (40.0, 38.0), (50.0, 62.0), (30.0, 30.5)]       # (planned, actual) ms after arrival
    events = _log(_line(0.5, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=90.0, planned_visible_ms=None),
                  *(_line(1.0 + k, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=actual,
                          planned_visible_ms=plan) for k, (plan, actual) in enumerate(planned)),
                  _line(9.0, "committed", scored=0, dead_letters={}, arrival_to_visible_ms=1.0, planned_visible_ms=0.0))
    errors = budget_plan_errors(events, budget_ms=45, since=T0 + 0.9)
    assert errors == dict(planned_cycles=4, planned_over_budget=1, later_than_planned=3,
                          plan_error_p50_ms=pytest.approx(0.5), plan_error_p90_ms=pytest.approx(5.0))
    assert budget_plan_errors(events, budget_ms=45, since=T0 + 20)["planned_cycles"] == 0


def test_cycle_timelines_split_each_cycles_time_to_visibility_and_single_out_the_late_ones():
    # (closed, launched, scored, visible) ms after each cycle's first arrival
    cycles = [(2.0, 3.0, 10.0, 13.0), (4.0, 6.0, 14.0, 17.0), (1.0, 2.0, 20.0, 26.0), (3.0, 5.0, 22.0, 30.0)]
    events = _log(_line(0.5, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=99.0, closed_ms=1.0,
                        launched_ms=2.0, scored_ms=3.0),
                  *(_line(1.0 + k, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=visible,
                          closed_ms=closed, launched_ms=launched, scored_ms=scored)
                    for k, (closed, launched, scored, visible) in enumerate(cycles)),
                  # a cycle of dead letters only is never launched: left out
                  _line(9.0, "committed", scored=0, dead_letters={"unknown_schema": 1}, arrival_to_visible_ms=5.0,
                        closed_ms=1.0, launched_ms=None, scored_ms=2.0))
    timelines = cycle_timelines(events, budget_ms=25, since=T0 + 0.9)
    assert timelines["all"] == dict(cycles=4, to_close_ms=2.0, close_to_launch_ms=1.0, launch_to_scored_ms=8.0,
                                    scored_to_visible_ms=3.0, states=4)
    assert timelines["late"] == dict(cycles=2, to_close_ms=1.0, close_to_launch_ms=1.0, launch_to_scored_ms=17.0,
                                     scored_to_visible_ms=6.0, states=4)
    assert cycle_timelines(events, budget_ms=25, since=T0 + 20) == {"all": {"cycles": 0}, "late": {"cycles": 0}}


def test_cycle_timelines_split_close_to_launch_where_the_events_say_when_the_gpu_thread_took_the_cycle():
    # (closed, taken, gathered, launched, scored, visible) ms after each cycle's first arrival
    cycles = [(2.0, 2.5, 2.7, 3.0, 10.0, 13.0), (4.0, 4.5, 5.5, 6.0, 14.0, 17.0)]
    events = _log(*(_line(1.0 + k, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=visible,
                          closed_ms=closed, taken_ms=taken, gathered_ms=gathered, launched_ms=launched,
                          scored_ms=scored)
                    for k, (closed, taken, gathered, launched, scored, visible) in enumerate(cycles)))
    timelines = cycle_timelines(events, budget_ms=25, since=T0)
    assert timelines["all"] == dict(cycles=2, to_close_ms=2.0, close_to_launch_ms=1.0, launch_to_scored_ms=7.0,
                                    scored_to_visible_ms=3.0, close_to_taken_ms=0.5, taken_to_gathered_ms=0.2,
                                    gathered_to_launch_ms=0.3, states=4)


def test_cycle_timelines_split_close_to_taken_and_count_transactions_opened_ahead_where_the_events_say():
    # (closed, submitted, taken, gathered, launched, scored, visible, opened ahead, states) ms after each first arrival
    cycles = [(2.0, 2.1, 2.5, 2.7, 3.0, 10.0, 13.0, True, 4), (4.0, 4.4, 4.5, 5.5, 6.0, 14.0, 17.0, False, 20),
              (3.0, 3.3, 3.9, 4.0, 4.2, 9.0, 12.0, True, 9)]
    events = _log(*(_line(1.0 + k, "committed", scored=n, dead_letters={}, arrival_to_visible_ms=visible,
                          closed_ms=closed, submitted_ms=submitted, taken_ms=taken, gathered_ms=gathered,
                          launched_ms=launched, scored_ms=scored, opened_ahead=ahead)
                    for k, (closed, submitted, taken, gathered, launched, scored, visible, ahead, n)
                    in enumerate(cycles)))
    timelines = cycle_timelines(events, budget_ms=25, since=T0)["all"]
    assert timelines["close_to_submitted_ms"] == 0.3 and timelines["submitted_to_taken_ms"] == 0.4
    assert timelines["close_to_taken_ms"] == 0.5 and timelines["opened_ahead"] == 2 and timelines["states"] == 9


def test_cycle_timelines_tell_a_wait_for_the_tokenizers_from_one_after_them_where_the_events_say():
    # (closed, taken, last tokenizer job submitted, done, gathered) ms after each first arrival: the first cycle's rows
    # were ready before it was taken (its 0.4 ms taken -> gathered came after them), the others' last job finished
    # 0.3 and 0.5 ms after it was taken, and the GPU thread had them 0.1 and 0.2 ms later
    cycles = [(2.0, 2.2, 1.5, 1.9, 2.6), (4.0, 4.2, 3.9, 4.5, 4.6), (6.0, 6.1, 6.0, 6.6, 6.8)]
    events = _log(*(_line(1.0 + k, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=20.0,
                          closed_ms=closed, submitted_ms=closed, taken_ms=taken, tokenize_submitted_ms=submitted,
                          tokenized_ms=done, gathered_ms=gathered, launched_ms=gathered + 0.3, scored_ms=15.0,
                          launch_cpu_ms=0.25)
                    for k, (closed, taken, submitted, done, gathered) in enumerate(cycles)))
    timelines = cycle_timelines(events, budget_ms=25, since=T0)["all"]
    assert timelines["taken_to_gathered_ms"] == 0.4
    assert timelines["taken_to_tokenized_ms"] == 0.3 and timelines["tokenized_to_gathered_ms"] == 0.2
    assert timelines["close_to_tokenize_submitted_ms"] == -0.1
    # taken -> launched (0.7, 0.7 and 1.0 ms) less the GPU thread's own 0.25 ms of CPU: it waited 0.45 at the median
    assert timelines["launch_cpu_ms"] == 0.25 and timelines["launch_waiting_ms"] == 0.45
    # a worker whose events do not say (before 2026-12-06): no such split
    older = [{k: v for k, v in e.items() if not k.startswith(("tokeni", "launch_cpu"))} for e in events]
    assert not {"taken_to_tokenized_ms", "launch_cpu_ms"} & set(cycle_timelines(older, budget_ms=25, since=T0)["all"])


def test_cycle_timelines_take_each_transactions_steps_once_by_its_first_cycle():
    # three transactions: one of one cycle, one of three (its later cycles repeat its figures), one of one
    steps = [({"produce": 0.1, "offsets": 1.0, "flush": 2.0, "commit": 0.4}, 3.5, [0]),
             ({"produce": 0.2, "offsets": 0.5, "flush": 9.0, "commit": 0.2}, 9.9, [0, 1, 2]),
             ({"produce": 0.1, "offsets": 0.6, "flush": 1.0, "commit": 0.3}, 2.0, [0])]
    lines = [_line(1.0 + k, "committed", scored=4, dead_letters={}, arrival_to_visible_ms=20.0, closed_ms=1.0,
                   launched_ms=2.0, scored_ms=10.0, commit_ms=total, commit_steps_ms=parts, transaction_cycle=position)
             for k, (parts, total, positions) in enumerate(steps) for position in positions]
    timelines = cycle_timelines(_log(*lines), budget_ms=25, since=T0)["all"]
    assert timelines["cycles"] == 5
    # counted by cycle, the three-cycle transaction's 9.9 ms would be the median
    assert timelines["commit_ms"] == 3.5
    assert timelines["commit_steps_ms"] == {"produce": 0.1, "offsets": 0.6, "flush": 2.0, "commit": 0.3}
    # a worker whose events do not carry them (before 2026-12-03): no such figures
    older = [{k: v for k, v in e.items() if not k.startswith("commit_")} for e in _log(*lines)]
    assert "commit_steps_ms" not in cycle_timelines(older, budget_ms=25, since=T0)["all"]


def test_gpu_pipeline_places_cycles_on_the_workers_clock_and_measures_the_gpus_idle_gaps():
    # (arrived, closed, launched, scored) on the worker's monotonic clock, ms; the second cycle closed 2 ms before the
    # first one's scores and was queued 1 ms after them (1 ms idle); the third, queued behind the second's scores
    # (no idle), closed 4 ms before them
    cycles = [(100.0, 102.0, 104.0, 110.0), (105.0, 108.0, 111.0, 118.0), (110.0, 114.0, 116.0, 125.0)]
    events = _log(*(_line(1.0 + k, "committed", scored=3, dead_letters={}, arrived_monotonic_ms=arrived,
                          arrival_to_visible_ms=scored - arrived + 3, closed_ms=closed - arrived,
                          launched_ms=launched - arrived, scored_ms=scored - arrived)
                    for k, (arrived, closed, launched, scored) in enumerate(cycles)),
                  _line(9.0, "committed", scored=3, dead_letters={}, arrival_to_visible_ms=5.0, closed_ms=1.0,
                        launched_ms=2.0, scored_ms=3.0))    # a worker before session 13: no monotonic arrival, left out
    # busy: 111..118 (7 ms) + 118..125 (7 ms) of the 15 ms from the first cycle's scores to the last one's; idle
    # while states waited: the second cycle's 1 ms (its first state arrived at 105, before the GPU freed at 110)
    assert gpu_pipeline(events, since=T0) == dict(cycles=3, gpu_busy_fraction=round(14 / 15, 3),
                                                  idle_before_launch_ms=0.0, close_lead_ms=2.0,
                                                  idle_while_waiting_fraction=round(1 / 15, 3),
                                                  idle_while_gathering_fraction=0.0,
                                                  idle_after_close_fraction=round(1 / 15, 3))
    assert gpu_pipeline(events[:2], since=T0)["idle_before_launch_ms"] == 1.0
    # a cycle whose first state came after the GPU freed: its gap is the load's, not the worker's
    late = _log(*(_line(1.0 + k, "committed", scored=3, dead_letters={}, arrived_monotonic_ms=arrived,
                        arrival_to_visible_ms=scored - arrived + 3, closed_ms=closed - arrived,
                        launched_ms=launched - arrived, scored_ms=scored - arrived)
                  for k, (arrived, closed, launched, scored) in enumerate([(100.0, 101.0, 102.0, 110.0),
                                                                           (112.0, 112.5, 113.0, 120.0)])))
    assert gpu_pipeline(late, since=T0)["idle_while_waiting_fraction"] == 0.0
    assert gpu_pipeline(events, since=T0 + 20) == {"cycles": 0}


def test_gpu_pipeline_tells_the_gpus_idle_time_while_a_cycle_gathered_from_the_time_after_its_close():
    # (arrived, closed, launched, scored), ms: the GPU frees at 110; the second cycle (first state at 104) stays open
    # until 113 (gathering: 3 ms idle) and is queued at 114 (1 ms from its close); the third closes at 117, before the
    # GPU frees at 121, and is queued at 123 (2 ms idle, all of it after its close)
    cycles = [(100.0, 102.0, 103.0, 110.0), (104.0, 113.0, 114.0, 121.0), (115.0, 117.0, 123.0, 130.0)]
    events = _log(*(_line(1.0 + k, "committed", scored=3, dead_letters={}, arrived_monotonic_ms=arrived,
                          arrival_to_visible_ms=scored - arrived + 3, closed_ms=closed - arrived,
                          launched_ms=launched - arrived, scored_ms=scored - arrived)
                    for k, (arrived, closed, launched, scored) in enumerate(cycles)))
    pipeline = gpu_pipeline(events, since=T0)   # 20 ms from the first scores to the last
    assert pipeline["idle_while_waiting_fraction"] == round(6 / 20, 3)
    assert pipeline["idle_while_gathering_fraction"] == round(3 / 20, 3)
    assert pipeline["idle_after_close_fraction"] == round(3 / 20, 3)
    assert "close_after_plan_ms" not in pipeline    # events without the budget's plan


def test_gpu_pipeline_says_whether_closes_kept_the_budgets_plan_and_the_gpu_freed_when_expected():
    # (arrived, closed, launched, scored, planned close, expected free of the cycle ahead), ms on the worker's clock:
    # the second cycle closed 0.5 ms after its plan and the GPU freed (110) 1 ms before the plan expected (111); the
    # third closed 0.3 ms after its plan, the GPU freeing (121) 2 ms sooner than expected (123)
    cycles = [(100.0, 102.0, 103.0, 110.0, None, None), (104.0, 108.5, 110.5, 121.0, 108.0, 111.0),
              (112.0, 119.3, 121.4, 130.0, 119.0, 123.0)]
    events = _log(*(_line(1.0 + k, "committed", scored=3, dead_letters={}, arrived_monotonic_ms=arrived,
                          arrival_to_visible_ms=scored - arrived + 3, closed_ms=closed - arrived,
                          launched_ms=launched - arrived, scored_ms=scored - arrived,
                          planned_close_ms=None if plan is None else plan - arrived,
                          ahead_free_expected_ms=None if free is None else free - arrived)
                    for k, (arrived, closed, launched, scored, plan, free) in enumerate(cycles)))
    pipeline = gpu_pipeline(events, since=T0)
    assert pipeline["close_after_plan_ms"] == 0.3 and pipeline["free_after_expected_ms"] == -2.0


def test_gpu_pipeline_says_how_often_the_planner_gathered_and_for_how_long():
    # (arrived, closed, launched, scored, gathering window at the close), ms: two of three cycles planned a window
    cycles = [(100.0, 102.0, 103.0, 110.0, 0.0), (104.0, 108.5, 110.5, 121.0, 4.5), (112.0, 119.3, 121.4, 130.0, 6.0)]

    def events(with_window: bool) -> list[dict]:
        return _log(*(_line(1.0 + k, "committed", scored=3, dead_letters={}, arrived_monotonic_ms=arrived,
                            arrival_to_visible_ms=scored - arrived + 3, closed_ms=closed - arrived,
                            launched_ms=launched - arrived, scored_ms=scored - arrived,
                            **({"gather_ms": window} if with_window else {}))
                      for k, (arrived, closed, launched, scored, window) in enumerate(cycles)))

    pipeline = gpu_pipeline(events(True), since=T0)
    assert pipeline["gather_window_ms"] == 4.5 and pipeline["gathering_fraction"] == round(2 / 3, 3)
    assert "gather_window_ms" not in gpu_pipeline(events(False), since=T0)
