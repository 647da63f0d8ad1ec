"""The gathering window (worker/stream/gathering.py): how long a cycle gathers under a latency budget, from the load
and the learned cycle times; 0 at a light load, and growing with the budget at a load that needs larger batches."""
from __future__ import annotations

import random

import pytest

from worker.stream.gathering import GATHER_SHARE, UTILISATION, CommitWindow, CostLine, RecentRate, gather_window
from worker.stream.latency_budget import CycleTimes, LatencyBudget

# the H200's shape of issue 46: a cycle's GPU time 2.3 ms + 0.45 ms a state, a transaction 2.2 ms, launch lead 1.5 ms
ENGINE = CostLine(0.0023, 0.00045, margin=0.001)
COMMIT = CostLine(0.0022, 0.0, margin=0.0005)
LEAD = 0.0015
FULL_LOAD = 1 / 0.00045   # states/s the GPU sustains at large batches


def _window(rate: float, budget_s: float, max_batch: int = 128) -> float:
    return gather_window(rate, ENGINE, COMMIT, budget_s, LEAD, max_batch)


def test_a_line_is_fitted_through_the_buckets_and_one_size_promises_no_gain():
    points = [(n, 0.0023 + 0.00045 * n, 0.001) for n in (1.0, 3.5, 7.0, 14.0)]
    line = CostLine.fitted(points)
    assert line.fixed == pytest.approx(0.0023) and line.per_state == pytest.approx(0.00045) and line.margin == 0.001
    rare = CostLine.fitted([(1.0, 0.003, 0.001), (2.0, 0.0035, 0.001), (64.0, 0.03, 0.015)])
    assert rare.margin == 0.001        # one rare large batch's first-sample deviation does not set the margin
    assert line.seconds(10) == pytest.approx(0.0068) and line.seconds(10, pessimistic=True) == pytest.approx(0.0078)
    one = CostLine.fitted([(4.0, 0.004, 0.0)])       # all of it charged per state: a larger batch gains nothing
    assert one.fixed == 0.0 and one.per_state == pytest.approx(0.001)
    noisy = CostLine.fitted([(2.0, 0.005, 0.0), (8.0, 0.004, 0.0)])   # larger measured faster: a fixed cost
    assert noisy.per_state == 0.0 and noisy.fixed == 0.005
    assert CostLine.fitted([]) is None


def test_a_light_load_or_nothing_learned_gathers_nothing():
    for budget in (0.025, 0.1, 1.0):
        assert _window(0.05 * FULL_LOAD, budget) == 0.0       # one state's cycle leaves the headroom already
        assert gather_window(None, ENGINE, COMMIT, budget, LEAD, 128) == 0.0
        assert gather_window(1000.0, None, COMMIT, budget, LEAD, 128) == 0.0
    # with every cycle's time charged per state (one size measured), no batch is worth waiting for
    assert gather_window(1500.0, CostLine(0.0, 0.0005), COMMIT, 0.1, LEAD, 128) == 0.0


def test_the_gpus_own_time_sets_the_batch_a_load_needs_not_the_time_from_the_close():
    """Run DN's H100 at 60% of full load (1,249 states/s, budget 50 ms): from the close a cycle took 0.4 ms + 0.72 ms
    a state (the launch's host time grows with the batch), the GPU 1.3 ms + 0.47 ms a state. By the first line no
    batch leaves the GPU headroom (1,249 x 0.72 ms > UTILISATION) and nothing was gathered: cycles of 4-5 states kept
    it ~95% busy. By the GPU's own, batches of ~11 leave it: the cycle gathers."""
    engine, device = CostLine(0.0004, 0.00072, margin=0.0014), CostLine(0.0013, 0.00047)
    commit = CostLine(0.0014, 0.000256, margin=0.002)
    rate = 1249.0
    assert rate * engine.per_state > UTILISATION
    assert gather_window(rate, engine, commit, 0.05, 0.0017, 128) == 0.0                 # no device line learned yet
    window = gather_window(rate, engine, commit, 0.05, 0.0017, 128, device=device)
    n = 1 + rate * window
    assert window > 0 and rate * device.seconds(n) / n <= UTILISATION + 0.05, (window, n)
    # the budget still caps it: the first state's plan, from the close's line, within its share
    plan = window + 0.0017 + engine.seconds(n, pessimistic=True) + commit.seconds(n, pessimistic=True)
    assert plan <= GATHER_SHARE * 0.05 + 1e-9
    # and a GPU whose own time leaves no headroom at this rate gathers nothing (the queue sets the batch)
    assert gather_window(rate, engine, commit, 0.05, 0.0017, 128, device=CostLine(0.0013, 0.0006)) == 0.0


@pytest.mark.parametrize("load", [0.4, 0.5, 0.6])
def test_at_a_given_load_the_window_grows_with_the_budget_and_keeps_the_plan_within_its_share(load):
    rate = load * FULL_LOAD
    windows = [_window(rate, budget) for budget in (0.025, 0.05, 0.1, 0.2)]
    assert windows == sorted(windows) and windows[2] > windows[0] and windows[0] == 0.0, windows
    assert all(w == 0.0 or w >= ENGINE.fixed + COMMIT.fixed for w in windows)   # never shorter than a cycle's fixed time
    for budget, window in zip((0.025, 0.05, 0.1, 0.2), windows):
        n = 1 + rate * window
        if window > 0:   # the first state's plan: the window, the launch, the batch's scoring and its commit
            plan = window + LEAD + ENGINE.seconds(n, pessimistic=True) + COMMIT.seconds(n, pessimistic=True)
            assert plan <= GATHER_SHARE * budget + 1e-9
        # never more than the batch that brings the scoring path's busy share to UTILISATION
        assert rate * ENGINE.seconds(n) / n >= UTILISATION - 1e-9 or window == 0.0


def test_the_window_is_the_smallest_batch_that_leaves_the_headroom_when_the_budget_allows_it():
    rate = 0.5 * FULL_LOAD               # 1,111 states/s: the busy share falls to UTILISATION at n = 12.8
    window = _window(rate, 1.0)
    n = 1 + rate * window
    assert rate * ENGINE.seconds(n) / n == pytest.approx(UTILISATION)
    assert _window(rate, 1.0, max_batch=8) == pytest.approx(7 / rate)    # never more than --max-batch
    # at 30% the batch that leaves the headroom (3.8 states) is 4.2 ms away: less than a cycle's fixed 4.5 ms
    assert _window(0.3 * FULL_LOAD, 1.0) == 0.0


@pytest.mark.parametrize("load", [0.7, 0.9, 1.1])
def test_where_the_states_own_time_fills_the_headroom_the_queue_sets_the_batch_at_any_budget(load):
    assert load * FULL_LOAD * ENGINE.per_state >= UTILISATION
    assert [_window(load * FULL_LOAD, budget) for budget in (0.025, 0.1, 1.0)] == [0.0, 0.0, 0.0]


def test_the_rate_is_what_the_last_seconds_committed():
    rate = RecentRate()
    for k in range(5):
        rate.add(k * 0.1, 10)
    assert rate.per_second() is None       # too few cycles to say
    for k in range(5, 40):
        rate.add(k * 0.1, 10)
    assert rate.per_second() == pytest.approx(100.0)
    rate.add(10.0, 10)                     # a pause longer than the window: only the latest cycle is left
    assert rate.per_second() is None
    rate.forget()
    assert rate.per_second() is None


def test_the_commit_window_keeps_the_sums_of_the_cycles_still_in_it():
    window = CommitWindow(1.0)
    for k, (states, missed) in enumerate([(4, False), (6, True), (2, False), (8, True)]):
        window.add(k * 0.4, states, missed)            # at 0, 0.4, 0.8, 1.2: the first leaves with the last
    assert (len(window), window.states, window.missed, window.oldest_at()) == (3, 16, 2, 0.4)
    assert window.span() == pytest.approx(0.8)
    assert window.states_per_second() == pytest.approx((16 - 6) / 0.8)   # the oldest's states came before the span
    window.add(5.0, 3)
    assert (len(window), window.states, window.missed, window.span(), window.states_per_second()) == (1, 3, 0, 0.0, 0.0)
    window.clear()
    assert (len(window), window.states, window.missed) == (0, 0, 0)


def _learned(budget_s: float, rate: float, seconds: float = 3.0, seed: int = 0, seen: list | None = None) -> LatencyBudget:
    """A planner fed the cycles a GPU of ENGINE's costs commits at ``rate`` states/s, closing each cycle as the
    planner says (a small model of the loop: one cycle on the GPU at a time, commits 2.2 ms after the scores);
    ``seen``: gets each commit's (time, gathering window after it)."""
    rng = random.Random(seed)
    budget = LatencyBudget(budget_s, max_wait_s=budget_s)
    t, gpu_free, arrivals = 0.0, 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append(t)
    i = 0
    while i < len(arrivals):
        first = arrivals[i]
        close = max(first, budget.close_by(first, first, gpu_busy=gpu_free > first))
        n = sum(1 for a in arrivals[i:] if a <= close)
        launched = close + LEAD
        scored = max(launched, gpu_free) + ENGINE.seconds(n) * rng.uniform(0.9, 1.1)
        budget.submitted(close, n, gpu_busy=gpu_free > close)
        budget.committed(CycleTimes(n, first, close, scored, scored + 0.0022, launched_at=launched))
        if seen is not None:
            seen.append((scored + 0.0022, budget.gather_s))
        gpu_free, i = scored, i + n
    return budget


def test_a_planner_that_learned_a_high_load_gathers_longer_under_a_larger_budget_and_not_at_a_light_one():
    heavy = [_learned(budget, 0.6 * FULL_LOAD).gather_s for budget in (0.025, 0.05, 0.1)]
    assert heavy[0] == 0.0 and 0.005 < heavy[1] < heavy[2], heavy     # 25 ms: no window worth its wait
    light = [_learned(budget, 0.03 * FULL_LOAD).gather_s for budget in (0.025, 0.1)]
    assert light == [0.0, 0.0]
    # the open cycle waits its window on an idle GPU, then closes; a rewind forgets the load and the window
    planner = _learned(0.1, 0.6 * FULL_LOAD)
    assert planner.close_by(100.0, 100.0, gpu_busy=False) == pytest.approx(100.0 + planner.gather_s)
    assert planner.close_by(100.0, 99.0, gpu_busy=False) <= 100.0     # already past it (and max-wait): at once
    planner.forget_order()
    assert planner.gather_s == 0.0 and planner.close_by(100.0, 100.0, gpu_busy=False) == 100.0


def test_the_gathering_window_is_worked_out_again_at_most_every_refresh_interval():
    """Its lines were refitted at every commit, a tight budget's few hundred a second: the loop's largest stage."""
    from worker.stream.gathering import GATHER_REFRESH_S

    seen: list = []
    planner = _learned(0.1, 0.6 * FULL_LOAD, seen=seen)
    changes = [t for (t, window), (_, before) in zip(seen[1:], seen) if window != before]
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    # commits ~13 ms apart here: refitted at each, the window changed at nearly every one
    assert len(seen) > len(changes) > 10 and min(gaps) >= GATHER_REFRESH_S - 1e-9, (len(seen), len(changes))
    assert planner.gather_s > 0.005                     # and it still gathers what the load needs


def test_a_cycle_never_gathers_past_the_size_beyond_which_batches_stopped_getting_cheaper_per_state():
    # a CPU's shape: 29 ms a batch + 2.4 ms a state up to 32 states, then 64 costs more per state than 32 did
    convex = [(2.0, 0.034, 0.002), (6.0, 0.043, 0.002), (12.0, 0.058, 0.002), (28.0, 0.096, 0.002),
              (60.0, 0.275, 0.002)]
    assert CostLine.fitted(convex).cheapest_up_to == 28.0
    line = CostLine(0.029, 0.0024, 0.002, cheapest_up_to=28.0)
    rate = 220.0                      # the headroom needs 37 states a cycle, and a budget of 2 s would allow them
    assert rate * line.fixed / (UTILISATION - rate * line.per_state) > 28.0
    window = gather_window(rate, line, COMMIT, 2.0, LEAD, 64)
    assert 1 + rate * window == pytest.approx(28.0)
    # where the largest measured bucket is the cheapest, the next one up is worth a try: twice its size
    linear = CostLine.fitted([(n, 0.0023 + 0.00045 * n, 0.001) for n in (2.0, 6.0, 12.0)])
    assert linear.cheapest_up_to == 24.0
