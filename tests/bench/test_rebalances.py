"""What each rebalance cost, read from worker events (``bench.rebalances``): the partitions that changed owner, how long
each was without one, and the states read twice; an incremental join leaves the kept partitions owned throughout, an
eager one leaves none."""
from bench.rebalances import Step, dropped_states, markdown, rebalance_table


def _event(t: float, kind: str, partitions: list[int]) -> dict:
    return {"t": t, "event": kind, "partitions": partitions}


def test_an_incremental_join_a_stop_and_a_kill():
    events = {
        "w0": [_event(1.0, "assigned", [0, 1, 2, 3]), _event(12.0, "revoked", [2, 3]), _event(12.05, "assigned", []),
               _event(31.0, "assigned", [2])],
        "w1": [_event(12.1, "assigned", []), _event(13.0, "assigned", [2, 3]), _event(30.5, "revoked", [2])],
        "w2": [],
    }
    steps = [Step("w0 starts", "start", "w0", 0.0), Step("w1 joins", "start", "w1", 10.0),
             Step("w1 stops", "stop", "w1", 30.0), Step("w0 killed", "kill", "w0", 40.0, held_at_kill={0, 1, 2},
                                                         unread_bound=7)]
    rows = rebalance_table(events, [(12.0, 3), (50.0, 1)], steps, end=60.0, partitions=4)
    join, stop, kill = rows
    assert join == {"step": "w1 joins", "moved": [2, 3], "unowned_s": {2: 1.0, 3: 1.0}, "reread": 3, "reread_is_bound": False,
                    "lost": []}
    assert stop["moved"] == [2] and stop["unowned_s"] == {2: 0.5} and stop["reread"] == 0
    # no worker took the killed one's partitions before the run ended: moved to nobody, their gaps still open
    assert kill["moved"] == [0, 1, 2] and kill["unowned_s"] == {} and (kill["reread"], kill["reread_is_bound"]) == (8, True)
    table = markdown([{"rebalancing": "incremental", "rebalances": rows}])
    assert "| incremental | w1 joins | 2 [2, 3] | 2 | 1.00 / 1.00 | 2:1.00 3:1.00 | 3 | - |" in table
    assert "| <= 8 | - |" in table


def test_a_session_that_expires_during_a_join_is_reported_as_lost_partitions():
    # w0's session expires while w1 starts (the broker answered none of its heartbeats): it loses all four partitions,
    # joins again and gets them back 0.3 s later, then the join moves 2 and 3 to w1 as usual
    events = {
        "w0": [_event(1.0, "assigned", [0, 1, 2, 3]), _event(11.0, "lost", [0, 1, 2, 3]),
               _event(11.3, "assigned", [0, 1, 2, 3]), _event(14.0, "revoked", [2, 3]), _event(14.05, "assigned", [])],
        "w1": [_event(14.1, "assigned", []), _event(15.0, "assigned", [2, 3])],
    }
    steps = [Step("w0 starts", "start", "w0", 0.0), Step("w1 joins", "start", "w1", 10.0)]
    [join] = rebalance_table(events, [], steps, end=20.0, partitions=4)
    assert join["moved"] == [2, 3] and join["lost"] == [0, 1, 2, 3]
    assert join["unowned_s"] == {0: 0.3, 1: 0.3, 2: 1.3, 3: 1.3}      # a partition's gaps in the step add up
    assert "| [0, 1, 2, 3] |" in markdown([{"rebalancing": "incremental", "rebalances": [join]}])


def test_an_eager_join_leaves_every_partition_without_an_owner_for_a_while():
    events = {"w0": [_event(1.0, "assigned", [0, 1]), _event(12.0, "revoked", [0, 1]), _event(12.5, "assigned", [0])],
              "w1": [_event(12.6, "assigned", [1])]}
    steps = [Step("w0 starts", "start", "w0", 0.0), Step("w1 joins", "start", "w1", 10.0)]
    [join] = rebalance_table(events, [], steps, end=20.0, partitions=2)
    assert join["moved"] == [1] and join["unowned_s"] == {0: 0.5, 1: 0.6}


def test_the_dropped_states_lines_of_a_json_log():
    log = "\n".join([
        '{"ts":"2026-12-02T13:27:56.272Z","level":"info","logger":"worker.stream.revocation","message":"partitions '
        'revoked: dropped 3 uncommitted states of partitions [0, 1] (they will be read again)"}',
        '{"ts":"2026-12-02T13:27:57.000Z","level":"info","logger":"decider.events","message":"revoked","event":"revoked"}',
        "not json",
    ])
    [(t, n)] = dropped_states(log)
    assert n == 3 and abs(t - 1796218076.272) < 1e-3
