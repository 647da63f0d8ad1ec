"""bench/tail_causes.py: the rule that charges each state over budget to one cause, on hand-built cycle records (the
``committed`` events a worker logs) and reader observations."""
import pytest

from bench.tail_causes import (CAUSES, CycleIndex, LateState, broker_pauses, cause_of, cycle_pieces, merged,
                                window_causes)

T0 = 1_000_000.0   # wall seconds of the first cycle's arrival
BUDGET = 25.0


def _event(arrived_ms: float, offsets, closed=1.0, submitted=1.2, taken=1.3, gathered=1.5, launched=2.0, scored=6.0,
           visible=9.0, commit_ms=2.5, steps=None, **extra) -> dict:
    """A ``committed`` event of a cycle whose first state arrived ``arrived_ms`` after T0 (monotonic = wall here),
    logged as the commit ended."""
    return {"event": "committed", "t": T0 + (arrived_ms + visible) / 1000, "scored": 1,
            "arrived_monotonic_ms": arrived_ms, "closed_ms": closed, "submitted_ms": submitted, "taken_ms": taken,
            "gathered_ms": gathered, "launched_ms": launched, "scored_ms": scored, "arrival_to_visible_ms": visible,
            "commit_ms": commit_ms, "commit_steps_ms": steps or {"produce": 0.3, "offsets": 1.0, "flush": 0.5,
                                                                 "commit": 0.7},
            "offsets": offsets, **extra}


def _state(at_ms: float, seen_ms: float, partition: int = 0, offset: int = 0) -> LateState:
    return LateState(1000 * T0 + at_ms, 1000 * T0 + seen_ms, partition, offset)


def _cause(events, state, membership=(), budget=BUDGET):
    return window_causes([[*membership, *events]], [state], budget)["causes"]


def test_the_pieces_of_a_cycle_cover_its_time_once():
    ahead = _event(0.0, [[0, 1]])
    event = _event(3.0, [[0, 2]], closed=4.0, scored=12.0, visible=30.0, commit_ms=10.0)
    pieces = cycle_pieces(event, ahead, previous_transaction_end=9.0 + 5.0)
    spans = sorted((a, b) for a, b, _ in pieces.pieces)
    assert spans[0][0] == 0.0 and spans[-1][1] == pytest.approx(30.0)
    assert all(b0 == pytest.approx(a1) for (_, a1), (b0, _) in zip(spans, spans[1:]))   # no gap, no overlap
    assert {cause for *_, cause in pieces.pieces} <= set(CAUSES)


def test_a_state_queued_behind_the_cycle_in_flight_is_charged_to_the_busy_gpu():
    ahead = _event(0.0, [[0, 1]], scored=33.0, visible=36.0)   # scored 33 ms after T0
    late = _event(2.0, [[0, 2]], closed=29.0, submitted=29.2, taken=29.3, gathered=29.5, launched=30.0, scored=37.0,
                  visible=40.0)
    assert _cause([ahead, late], _state(2.0, 43.0, offset=1)) == {"gpu_busy": 1}


def test_a_state_whose_tokens_were_late_is_charged_to_the_gather_on_the_gpu_thread():
    ahead = _event(0.0, [[0, 1]])
    late = _event(10.0, [[0, 2]], closed=1.0, submitted=1.2, taken=1.3, gathered=22.0, launched=22.5, scored=26.0,
                  visible=29.0)
    result = window_causes([[ahead, late]], [_state(10.0, 40.0, offset=1)], BUDGET)
    assert result["causes"] == {"host_gather": 1} and result["mean_ms"]["host_gather"] == pytest.approx(20.7)


def test_a_slow_commit_is_the_brokers_and_a_slow_produce_the_hosts():
    broker = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0,
                    steps={"produce": 0.5, "offsets": 30.0, "flush": 1.0, "commit": 3.5})
    assert _cause([broker], _state(0.0, 41.0)) == {"broker_commit": 1}
    produce = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0,
                     steps={"produce": 30.0, "offsets": 2.0, "flush": 1.0, "commit": 2.0})
    assert _cause([produce], _state(0.0, 41.0)) == {"host_produce": 1}


def test_waiting_for_the_transaction_before_is_the_brokers_and_making_records_the_hosts():
    first = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0)
    queued = _event(1.0, [[0, 2]], scored=8.0, visible=45.0, commit_ms=4.0)   # began at 41: after the first ended
    assert _cause([first, queued], _state(1.0, 46.0, offset=1)) == {"broker_queue": 1}
    alone = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=4.0)     # scores at 4, transaction from 36
    assert _cause([alone], _state(0.0, 41.0)) == {"host_records": 1}


def test_a_collection_is_charged_to_gc_and_taken_out_of_what_it_stopped():
    event = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0, gc_pauses_ms=[[5.0, 30.0]],
                   steps={"produce": 0.5, "offsets": 30.0, "flush": 1.0, "commit": 3.5})
    result = window_causes([[event]], [_state(0.0, 41.0)], BUDGET)
    assert result["causes"] == {"gc": 1}
    assert result["mean_ms"]["gc"] == pytest.approx(30.0)
    # the steps after the produce (34.5 ms) less the 29.5 ms of them the collection stopped; the produce all stopped
    assert result["mean_ms"]["broker_commit"] == pytest.approx(34.5 - 29.5) and "host_produce" not in result["mean_ms"]
    # a collection outside the state's span is not its cause
    before = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0, gc_pauses_ms=[[-40.0, 30.0]],
                    steps={"produce": 0.5, "offsets": 30.0, "flush": 1.0, "commit": 3.5})
    assert _cause([before], _state(0.0, 41.0)) == {"broker_commit": 1}


def test_zgcs_pauses_are_read_in_both_its_forms_and_its_concurrent_phases_are_not(tmp_path):
    """ZGC's pause lines (Java 17's, and Java 21+'s generational ones naming the young or old collection) are the
    broker's pauses, as G1's are; its concurrent phases and collection summaries are not."""
    log = ("[1970-01-12T13:46:40.010+0000] GC(0) Pause Mark Start 0.006ms\n"
           "[1970-01-12T13:46:40.020+0000] GC(0) Concurrent Mark 9.912ms\n"
           "[1970-01-12T13:46:40.030+0000] GC(1) Y: Pause Mark Start (Major) 0.014ms\n"
           "[1970-01-12T13:46:40.040+0000] GC(1) O: Pause Relocate Start 0.020ms\n"
           "[1970-01-12T13:46:40.050+0000] GC(1) Major Collection (Warmup) 26M(5%)->12M(2%) 0.048s\n")
    (tmp_path / "server.log").write_text(log)
    assert broker_pauses(tmp_path / "server.log") == [pytest.approx((1000 * T0 + at - ms, 1000 * T0 + at))
                                                       for at, ms in ((10, 0.006), (30, 0.014), (40, 0.020))]


def test_a_pause_of_the_broker_is_charged_to_broker_gc_where_the_worker_waited_on_the_broker(tmp_path):
    """A G1 pause of Apache Kafka's JVM (its GC log) inside a slow transaction step is the broker's collection, not
    its commit; inside the host's own work it is nothing of the broker's."""
    steps = {"produce": 0.5, "offsets": 30.0, "flush": 1.0, "commit": 3.5}
    event = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0, steps=steps)
    # the log line is written as the pause ends: 25 ms from 8 to 33 ms after the arrival (the offsets step: 5.5-35.5)
    log = ("[1970-01-12T13:46:40.033+0000] GC(7) Pause Young (Normal) (G1 Evacuation Pause) 300M->40M(512M) 25.000ms\n"
           "[1970-01-12T13:46:40.050+0000] GC(8) Concurrent Mark Cycle 1.2ms\n")
    (tmp_path / "server.log").write_text(log)
    pauses = broker_pauses(tmp_path / "server.log")
    assert broker_pauses(None) == [] and broker_pauses(tmp_path / "gone.log") == []
    assert pauses == [pytest.approx((1000 * T0 + 8.0, 1000 * T0 + 33.0))]       # the concurrent phase is no pause
    result = window_causes([[event]], [_state(0.0, 41.0)], BUDGET, broker_pauses_wall_ms=pauses)
    assert result["causes"] == {"broker_gc": 1}
    assert result["mean_ms"]["broker_gc"] == pytest.approx(25.0)
    assert result["mean_ms"]["broker_commit"] == pytest.approx(34.5 - 25.0)
    # the same pause while the host made the records is the host's time still
    host = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=4.0)     # records from 4 to 36
    result = window_causes([[host]], [_state(0.0, 41.0)], BUDGET, broker_pauses_wall_ms=pauses)
    assert result["causes"] == {"host_records": 1} and "broker_gc" not in result["mean_ms"]
    # and one outside the state's span is nobody's
    later = [(1000 * T0 + 100.0, 1000 * T0 + 125.0)]
    assert window_causes([[event]], [_state(0.0, 41.0)], BUDGET, broker_pauses_wall_ms=later)["causes"] == {
        "broker_commit": 1}


def test_a_capture_on_the_launch_is_charged_to_capture():
    event = _event(0.0, [[0, 1]], gathered=1.5, launched=31.5, scored=36.0, visible=39.0, graph_captures=1)
    assert _cause([event], _state(0.0, 40.0)) == {"capture": 1}
    same_without = _event(0.0, [[0, 1]], gathered=1.5, launched=31.5, scored=36.0, visible=39.0)
    assert _cause([same_without], _state(0.0, 40.0)) == {"host_launch": 1}


def test_a_rebalance_inside_the_span_decides_whatever_the_pieces_say():
    event = _event(0.0, [[0, 1]], scored=4.0, visible=40.0, commit_ms=35.0)
    revoked = {"event": "revoked", "t": T0 + 0.020, "partitions": [1]}
    assert _cause([event], _state(0.0, 41.0), membership=[revoked]) == {"rebalance": 1}
    earlier = {"event": "assigned", "t": T0 - 1.0, "partitions": [0]}
    assert _cause([event], _state(0.0, 41.0), membership=[earlier]) == {"broker_commit": 1}


def test_a_state_belongs_to_the_cycle_that_committed_its_offset():
    events = [_event(0.0, [[0, 5], [1, 3]]), _event(10.0, [[0, 9]], scored=40.0, visible=43.0),
              _event(50.0, [[1, 7]])]
    index = CycleIndex([events])
    assert [index.cycle_of(0, k) for k in (0, 4, 5, 8, 9)] == [0, 0, 1, 1, None]
    assert [index.cycle_of(1, k) for k in (2, 3, 6, 7)] == [0, 2, 2, None]
    result = window_causes([events], [_state(12.0, 60.0, partition=0, offset=6),
                                      _state(12.0, 60.0, partition=0, offset=9)], BUDGET)
    assert result["over_budget"] == 2 and result["causes"] == {"scoring": 1, "unmapped": 1}


def test_only_measured_states_over_the_budget_are_counted_and_the_earliest_event_places_the_cycle():
    event = _event(0.0, [[0, 10]], closed=20.0, submitted=20.2, taken=20.3, gathered=20.5, launched=21.0,
                   scored=24.0, visible=27.0)
    warm = LateState(1000 * T0 - 2.0, 1000 * T0 + 30.0, 0, 1, measured=False)   # 2 ms before the log says
    on_time = _state(10.0, 30.0, offset=2)
    result = window_causes([[event]], [warm, on_time, _state(0.0, 30.0, offset=3)], BUDGET)
    assert result["over_budget"] == 1 and result["causes"] == {"host_intake": 1}
    # placed at the warm-up state's event, 2 ms earlier than the log line's time says
    index = CycleIndex([[event]])
    from bench.tail_causes import place_arrivals
    place_arrivals(index, [warm], BUDGET)
    assert index.cycles[0].arrival_wall_ms == pytest.approx(1000 * T0 - 2.0)


def test_a_tie_goes_to_the_cause_listed_first_and_windows_merge():
    event = _event(0.0, [[0, 1]], closed=10.0, submitted=10.0, taken=10.0, gathered=10.0, launched=10.0,
                   scored=20.0, visible=20.0, commit_ms=0.0, steps={})
    cycle = CycleIndex([[event]]).cycles[0]
    cause, times = cause_of(cycle, _state(0.0, 20.0), [])
    assert times == {"host_intake": 10.0, "scoring": 10.0} and cause == "scoring"   # scoring comes first in CAUSES
    a = {"over_budget": 2, "causes": {"gc": 2}, "shares": {"gc": 1.0}, "mean_ms": {"gc": 10.0}}
    b = {"over_budget": 2, "causes": {"gc": 1, "gpu_busy": 1}, "shares": {}, "mean_ms": {"gc": 20.0}}
    assert merged([a, b]) == {"over_budget": 4, "causes": {"gc": 3, "gpu_busy": 1},
                              "shares": {"gc": 0.75, "gpu_busy": 0.25}, "mean_ms": {"gc": 15.0}}
    assert merged([])["over_budget"] == 0


def test_on_a_cpu_the_launch_is_the_forward_and_charged_to_scoring():
    event = _event(0.0, [[0, 1]], gathered=1.5, launched=31.5, scored=32.0, visible=35.0)
    assert window_causes([[event]], [_state(0.0, 36.0)], BUDGET, compute_in_launch=True)["causes"] == {"scoring": 1}
