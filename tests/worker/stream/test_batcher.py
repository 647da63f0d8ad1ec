"""The cycle's bookkeeping alone (no broker, no model): offsets per partition, batches per schema version, when a
cycle is due, states waiting for their schema, batches of superseded versions, and one pin per batched state."""

from __future__ import annotations

from concurrent.futures import Future

from confluent_kafka import TopicPartition

from worker.stream.batcher import Cycle, Pending
from worker.formats.records import SourceRecord


def _pending(partition: int, offset: int, schema_id: str = "s") -> Pending:
    pending = Pending(SourceRecord("states", partition, offset, b"k", b"v"))
    pending.state = {"state_id": f"{partition}-{offset}", "schema_id": schema_id, "state": "text"}
    return pending


def _schema(schema_id: str = "s", version: int = 1) -> dict:
    return {"schema_id": schema_id, "version": version, "questions": []}


def _batch(cycle: Cycle, pending: Pending, schema: dict, now: float) -> None:
    cycle.track(pending, now)
    cycle.add_to_batch(pending, schema, Future(), Future(), now)


def test_offsets_are_the_next_offset_per_partition_consumed():
    cycle = Cycle()
    for partition, offset in [(0, 5), (1, 9), (0, 6), (0, 7)]:
        cycle.track(_pending(partition, offset), now=0.0)
    assert sorted(cycle.offsets(), key=lambda tp: tp.partition) == [TopicPartition("states", 0, 8), TopicPartition("states", 1, 10)]
    assert len(cycle) == 4 and cycle.opened_at == 0.0


def test_states_batch_per_schema_version_in_arrival_order():
    cycle = Cycle()
    first, second, other = _pending(0, 0), _pending(0, 1), _pending(0, 2, schema_id="t")
    _batch(cycle, first, _schema(), 1.0)
    _batch(cycle, other, _schema("t"), 1.5)
    _batch(cycle, second, _schema(), 2.0)
    assert list(cycle.batches) == [("s", 1), ("t", 1)]
    assert cycle.batches[("s", 1)].members == [first, second] and len(cycle.batches[("s", 1)].rows) == 2
    assert (second.batch_key, second.batch_index) == (("s", 1), 1)
    assert cycle.entries == [first, other, second]  # output follows input order, across batches
    assert sorted(cycle.pins()) == [("s", 1), ("s", 1), ("t", 1)]


def test_a_cycle_is_due_when_its_batch_is_full_or_its_first_state_waited_max_wait():
    cycle = Cycle()
    assert not cycle.due(100.0, max_batch=2, max_wait_s=0.05) and cycle.seconds_until_due(100.0, 0.05) is None
    _batch(cycle, _pending(0, 0), _schema(), 10.0)
    assert abs(cycle.seconds_until_due(10.02, 0.05) - 0.03) < 1e-9
    assert not cycle.due(10.04, max_batch=2, max_wait_s=0.05)
    assert cycle.due(10.05, max_batch=2, max_wait_s=0.05)
    _batch(cycle, _pending(0, 1), _schema(), 10.01)
    assert cycle.full(2) and cycle.due(10.01, max_batch=2, max_wait_s=0.05)


def test_states_of_every_schema_fill_the_batch_together():
    """The engine scores a cycle's schemas as one GPU batch, so max_batch counts the states of all of them."""
    cycle = Cycle()
    _batch(cycle, _pending(0, 0), _schema(), 10.0)
    _batch(cycle, _pending(0, 1), _schema("t"), 10.0)
    assert not cycle.full(3)
    _batch(cycle, _pending(1, 0), _schema("u"), 10.0)
    assert cycle.full(3) and cycle.due(10.0, max_batch=3, max_wait_s=0.05)


def test_a_lone_dead_letter_is_due_after_max_wait_from_the_cycles_opening():
    cycle = Cycle()
    cycle.track(_pending(0, 0), now=3.0)  # decided at once (a dead letter): in no batch
    assert cycle.seconds_until_due(3.0, 0.5) == 0.5
    assert cycle.due(3.5, max_batch=8, max_wait_s=0.5)


def test_no_deadline_means_only_full_batches_close_a_cycle():
    cycle = Cycle()
    _batch(cycle, _pending(0, 0), _schema(), 0.0)
    assert not cycle.due(1e9, max_batch=2, max_wait_s=float("inf"))


def test_waiting_states_are_taken_back_for_routing():
    cycle = Cycle()
    pending = _pending(0, 0, schema_id="later")
    cycle.track(pending, 0.0)
    cycle.add_waiting(pending, deadline=10.0)
    assert pending.wait_deadline == 10.0 and cycle.waiting == [pending]
    assert cycle.take_waiting() == [pending] and cycle.waiting == []
    _batch(cycle, pending, _schema("later"), 1.0)
    assert pending.wait_deadline is None  # batched: no longer waiting


def test_batches_of_superseded_or_deleted_versions_are_taken_out():
    cycle = Cycle()
    old, current, deleted = _pending(0, 0), _pending(0, 1, schema_id="t"), _pending(0, 2, schema_id="gone")
    _batch(cycle, old, _schema("s", 1), 0.0)
    _batch(cycle, current, _schema("t", 4), 0.0)
    _batch(cycle, deleted, _schema("gone", 1), 0.0)
    latest = {"s": 2, "t": 4}
    stale = cycle.take_stale(latest.get)
    assert sorted(batch.key for batch in stale) == [("gone", 1), ("s", 1)]
    assert list(cycle.batches) == [("t", 4)] and list(cycle.pins()) == [("t", 4)]
    assert old.batch_key is None and old.batch_index == -1
    assert cycle.entries == [old, current, deleted]  # still consumed in this cycle: routed again by the caller


def test_a_waiting_state_holds_back_only_its_own_partition():
    cycle = Cycle()
    before, waiting, after = _pending(0, 10), _pending(0, 11, schema_id="later"), _pending(0, 12)
    other = [_pending(1, 20), _pending(1, 21)]
    _batch(cycle, before, _schema(), 1.0)
    _batch(cycle, other[0], _schema(), 1.0)
    cycle.track(waiting, 1.1)
    cycle.add_waiting(waiting, deadline=11.0)
    _batch(cycle, after, _schema(), 1.2)
    _batch(cycle, other[1], _schema(), 1.3)
    after_row = cycle.batches[("s", 1)].rows[after.batch_index]

    carried = cycle.carry_held(now=2.0)

    # Partition 0 commits up to, not including, its waiting state; partition 1 wholly.
    assert cycle.entries == [before, other[0], other[1]] and cycle.waiting == []
    assert sorted((tp.partition, tp.offset) for tp in cycle.offsets()) == [(0, 11), (1, 22)]
    assert cycle.batches[("s", 1)].members == [before, other[0], other[1]]
    assert [m.batch_index for m in cycle.batches[("s", 1)].members] == [0, 1, 2]
    assert sorted(cycle.pins()) == [("s", 1)] * 3
    # The next cycle starts with the held states, in order, the batched one with its tokenized row.
    assert carried.entries == [waiting, after] and carried.waiting == [waiting] and waiting.wait_deadline == 11.0
    assert carried.batches[("s", 1)].members == [after] and carried.batches[("s", 1)].rows == [after_row]
    assert [(tp.partition, tp.offset) for tp in carried.offsets()] == [(0, 13)]
    assert carried.wait_deadline() == 11.0 and carried.opened_at == 2.0
    # States carried over never make a batch full: they cannot commit before the wait ends anyway.
    assert not carried.full(1)
    _batch(carried, _pending(0, 13), _schema(), 2.5)
    assert carried.full(1)


def test_nothing_is_carried_when_no_state_waits():
    cycle = Cycle()
    _batch(cycle, _pending(0, 0), _schema(), 0.0)
    assert len(cycle.carry_held(now=1.0)) == 0 and len(cycle) == 1 and cycle.wait_deadline() is None


def test_a_tail_past_an_unpadded_batch_opens_the_next_cycle_with_its_wait_and_arrival():
    """``carry_tail`` (--unpadded-batches): the first n batched states stay, with the dead letters among them; every
    later state moves, per partition its last ones, so each partition's offset stops before its first moved state."""
    cycle = Cycle()
    a0, b0, dead, a1, c0, b1 = (_pending(0, 5), _pending(1, 7), _pending(1, 8), _pending(0, 6), _pending(2, 3),
                                _pending(1, 9, schema_id="t"))
    _batch(cycle, a0, _schema(), 1.0)
    _batch(cycle, b0, _schema(), 1.1)
    cycle.track(dead, 1.2)               # decided at once: a dead letter, in no batch
    _batch(cycle, a1, _schema(), 1.3)
    _batch(cycle, c0, _schema(), 1.4)
    _batch(cycle, b1, _schema("t"), 1.5)
    rows = {id(p): cycle.batches[p.batch_key].rows[p.batch_index] for p in (a1, c0, b1)}

    tail = cycle.carry_tail(2, now=3.0)

    assert cycle.entries == [a0, b0, dead] and list(cycle.batches) == [("s", 1)]
    assert cycle.batches[("s", 1)].members == [a0, b0]
    # partition 2's one state moved: its offset stays where the cycle found it (3), a commit that moves nothing
    assert sorted((tp.partition, tp.offset) for tp in cycle.offsets()) == [(0, 6), (1, 9), (2, 3)]
    assert tail.entries == [a1, c0, b1] and tail.batches[("s", 1)].members == [a1, c0]
    assert [tail.batches[p.batch_key].rows[p.batch_index] for p in (a1, c0, b1)] == [rows[id(p)] for p in (a1, c0, b1)]
    assert sorted((tp.partition, tp.offset) for tp in tail.offsets()) == [(0, 7), (1, 10), (2, 4)]
    # the moved states' own arrivals, per batch too (not the cycle's first state's: moved on at every close, a state
    # would pass it on and on), and they count towards a full batch (they are ready, unlike held ones)
    assert tail.arrived_at == tail.opened_at == 1.3
    assert tail.batches[("s", 1)].opened_at == 1.3 and tail.batches[("t", 1)].opened_at == 1.5
    assert tail.full(3) and tail.due(3.0, max_batch=3, max_wait_s=10.0)


def test_no_tail_when_every_batched_state_is_kept():
    cycle = Cycle()
    _batch(cycle, _pending(0, 0), _schema(), 0.0)
    cycle.track(_pending(0, 1), 0.1)      # a dead letter after the last batched state stays with it
    assert len(cycle.carry_tail(1, now=1.0)) == 0 and len(cycle) == 2
    assert [(tp.partition, tp.offset) for tp in cycle.offsets()] == [(0, 2)]
