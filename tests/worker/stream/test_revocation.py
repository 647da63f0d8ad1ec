"""An incremental rebalance takes some partitions away: only their uncommitted states are dropped, from the open cycle
and from the cycles being scored; the other partitions' states stay and commit (``worker.stream.revocation``). The loop
lets the committer's transaction end before (``test_loop_steps``, ``test_committer``)."""

from __future__ import annotations

from concurrent.futures import Future

from confluent_kafka import TopicPartition

from tests.worker.stream.test_batcher import _batch, _pending, _schema
from worker.stream.batcher import Cycle
from worker.stream.inflight import CyclesInFlight
from worker.stream.latency_budget import CycleBudget
from worker.stream.revocation import drop_uncommitted


class _Scorer:
    """Takes a cycle's batch; its scores never come (what the loop does meanwhile is under test)."""

    def submit(self, jobs, on_launched):
        return Future()


def _cycle(*where: tuple[int, int], schema: str = "s") -> Cycle:
    cycle = Cycle()
    for partition, offset in where:
        _batch(cycle, _pending(partition, offset, schema), _schema(schema), 1.0)
    return cycle


def _in_flight(*cycles: Cycle) -> CyclesInFlight:
    inflight = CyclesInFlight()
    for cycle in cycles:
        inflight.submit(cycle, 0.0, CycleBudget(None, 0.05, inflight.gpu_busy), _Scorer())
    return inflight


def _offsets(cycle: Cycle) -> dict[int, int]:
    return {tp.partition: tp.offset for tp in cycle.offsets()}


def test_an_open_cycle_forgets_the_revoked_partitions_states_batch_members_and_offsets():
    cycle = _cycle((0, 5), (1, 9), (0, 6), (2, 3))
    waiting = _pending(1, 10, "unknown")
    cycle.track(waiting, 1.0)
    cycle.add_waiting(waiting, 99.0)
    removed = cycle.forget_partitions({("states", 1)})
    assert [(p.source.partition, p.source.offset) for p in removed] == [(1, 9), (1, 10)]
    assert [(p.source.partition, p.source.offset) for p in cycle.entries] == [(0, 5), (0, 6), (2, 3)]
    assert cycle.waiting == [] and _offsets(cycle) == {0: 7, 2: 4}
    members = cycle.batches[("s", 1)].members
    assert members == cycle.entries and [m.batch_index for m in members] == [0, 1, 2]
    assert len(cycle.batches[("s", 1)].rows) == 3 and sorted(cycle.pins()) == [("s", 1)] * 3


def test_a_partition_the_cycle_never_saw_changes_nothing_and_a_cycle_left_empty_is_fresh():
    cycle = _cycle((0, 5))
    assert cycle.forget_partitions({("states", 3), ("other", 0)}) == []
    assert len(cycle) == 1 and _offsets(cycle) == {0: 6}
    assert len(cycle.forget_partitions({("states", 0)})) == 1
    assert len(cycle) == 0 and cycle.batches == {} and cycle.offsets() == [] and cycle.opened_at is None


def test_carried_states_of_a_revoked_partition_no_longer_count_as_carried():
    """States held back by a wait for their schema come first in the next cycle's batches and do not make it full."""
    closed = _cycle((0, 1), (1, 1))
    waiting = _pending(1, 2, "late")
    closed.track(waiting, 1.0)
    closed.add_waiting(waiting, 99.0)
    behind = _pending(0, 2)
    _batch(closed, behind, _schema(), 1.0)
    carried = closed.carry_held(2.0)  # partition 1 from its waiting state on; partition 0's states commit
    assert [p.source.partition for p in carried.entries] == [1]
    _batch(carried, _pending(0, 3), _schema(), 2.0)
    carried.forget_partitions({("states", 1)})
    assert not carried.waiting and carried.full(1)  # the state left counts: nothing carried remains


def test_a_cycle_being_scored_keeps_its_batches_whole_so_the_scores_still_line_up():
    cycle = _cycle((0, 5), (1, 9), (0, 6))
    cycle.forget_partitions({("states", 1)}, scored=True)
    assert [(p.source.partition, p.batch_index) for p in cycle.entries] == [(0, 0), (0, 2)]
    assert len(cycle.batches[("s", 1)].members) == 3 and _offsets(cycle) == {0: 7}


def test_cycles_in_flight_lose_the_revoked_states_and_one_left_with_nothing_is_no_longer_in_flight():
    only_revoked, mixed = _cycle((1, 1), (1, 2)), _cycle((0, 3), (1, 3))
    inflight = _in_flight(only_revoked, mixed)
    removed, emptied = inflight.forget_partitions({("states", 1)})
    assert removed == 3 and [f.cycle for f in emptied] == [only_revoked]
    assert [f.cycle for f in inflight] == [mixed] and _offsets(mixed) == {0: 4}


def test_eager_revocation_drops_everything():
    open_cycle, scored = _cycle((0, 1)), _cycle((1, 1))
    inflight, released = _in_flight(scored), []
    assert drop_uncommitted(open_cycle, inflight, "partitions lost", None, released.append)
    assert not inflight
    assert sorted(released) == [("s", 1), ("s", 1)]


def test_revoking_a_partition_keeps_the_others_work_in_flight_with_the_offsets_left():
    released: list = []
    kept, mixed = _cycle((0, 10)), _cycle((0, 12), (1, 5))
    inflight = _in_flight(kept, mixed)
    open_cycle = _cycle((0, 13), (1, 6))
    left = drop_uncommitted(open_cycle, inflight, "partitions revoked", [TopicPartition("states", 1)], released.append)
    assert not left and released == [("s", 1)]           # the open cycle's state of partition 1, unpinned
    assert [f.cycle for f in inflight] == [kept, mixed]   # scored all the same; their partition-0 states commit
    assert _offsets(kept) == {0: 11} and _offsets(mixed) == {0: 13} and _offsets(open_cycle) == {0: 14}


def _left_to_commit(open_cycle: Cycle, inflight: CyclesInFlight) -> tuple[set, set]:
    """What the worker would still commit: (partition, offset) of every state, and every offset, open or in flight."""
    cycles = [open_cycle, *(f.cycle for f in inflight)]
    return ({(p.source.partition, p.source.offset) for c in cycles for p in c.entries},
            {(tp.partition, tp.offset) for c in cycles for tp in c.offsets()})


def test_revoking_several_partitions_leaves_none_of_their_states_or_offsets_to_commit():
    """The next owners of partitions 1 and 2 start from their committed offsets: nothing of either may commit here."""
    early, mixed = _cycle((1, 4), (0, 10), (2, 7)), _cycle((2, 8), (0, 11), (1, 5))
    inflight = _in_flight(early, mixed)
    open_cycle = _cycle((0, 12), (1, 6), (2, 9))
    revoked = [TopicPartition("states", 1), TopicPartition("states", 2)]
    drop_uncommitted(open_cycle, inflight, "partitions revoked", revoked, lambda key: None)
    assert _left_to_commit(open_cycle, inflight) == ({(0, 10), (0, 11), (0, 12)}, {(0, 11), (0, 12), (0, 13)})


def test_every_pin_of_the_dropped_states_is_given_back_once_also_of_a_cycle_in_flight_left_empty():
    """A prepared schema stays pinned while a state batched with it may still commit: the pins of what a revoke drops
    (the open cycle's states, and a cycle in flight with nothing left to commit) are given back now, those of what
    stays when it commits; none is lost or given back twice."""
    only_revoked = _cycle((1, 1), (1, 2), schema="gone")
    mixed, open_cycle = _cycle((0, 3), (1, 3)), _cycle((0, 4), (1, 4), schema="open")
    taken = sorted([*only_revoked.pins(), *mixed.pins(), *open_cycle.pins()])
    inflight, released = _in_flight(only_revoked, mixed), []
    left = drop_uncommitted(open_cycle, inflight, "partitions revoked", [TopicPartition("states", 1)], released.append)
    assert not left and [f.cycle for f in inflight] == [mixed]          # only_revoked is no longer in flight
    still_held = [*mixed.pins(), *open_cycle.pins()]                     # given back when they commit
    assert sorted(released + still_held) == taken
    assert sorted(released) == [("gone", 1), ("gone", 1), ("open", 1)]
