"""The loop's blocking steps are timed, and a slow one is logged (what a stalled stream's log should show)."""
import functools
import logging
import time
from concurrent.futures import Future

from worker.ops import metrics
from worker.stream import loop
from worker.stream.batcher import Cycle
from worker.stream.inflight import CyclesInFlight
from worker.stream.latency_budget import CycleBudget


def _count(step: str) -> float:
    return next((s.value for s in metrics.LOOP_STEP_SECONDS.collect()[0].samples
                 if s.name.endswith("_count") and s.labels["step"] == step), 0.0)


def test_a_slow_step_is_timed_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(loop, "SLOW_STEP_S", 0.01)
    before = _count("schema_catch_up")
    with caplog.at_level(logging.WARNING, logger="worker.stream.loop"):
        with loop._blocking_step("schema_catch_up"):
            time.sleep(0.02)
        with loop._blocking_step("wait_for_scores", warn=False):
            time.sleep(0.02)
    assert _count("schema_catch_up") == before + 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("slow step: schema_catch_up took") for m in messages)
    assert not any("wait_for_scores" in m for m in messages)


def test_the_loop_wakes_when_the_cycle_in_flight_is_scored_or_a_transaction_ends(stream):
    """While a cycle is on the GPU the loop waits on it (a consumer's poll cannot be woken by another thread): on its
    scores, so that it is handed to the committer at once, or on the committer's wake-up (a transaction ended). With
    nothing waiting for its scores it waits on the consumer."""
    import threading

    from tests.worker.stream.test_transactions import _group_consumer

    consumer, cycles, scorer = _group_consumer(stream), CyclesInFlight(), _Scorer()
    woken_within = functools.partial(_woken_within, cycles, consumer)
    try:
        cycles.submit(Cycle(), 0.0, CycleBudget(None, 0.05, cycles.gpu_busy), scorer)
        threading.Timer(0.2, cycles.wake).start()
        assert 0.15 <= woken_within(2.0) < 1.0    # by the committer's wake-up, not the 2 s timeout
        threading.Timer(0.2, scorer.scores.set_result, [[]]).start()
        assert 0.15 <= woken_within(2.0) < 1.0    # by the scores
        assert woken_within(2.0) < 0.5            # scored already: no wait at all
        cycles.oldest.handed = True
        assert woken_within(0.3) >= 0.25          # handed on: nothing to wait for but the consumer
    finally:
        consumer.close()


class _Scorer:
    """Takes a cycle's batch and hands the test its scores."""

    def submit(self, jobs, on_launched):
        self.scores = Future()
        return self.scores

    def release_pin(self, key):
        pass


def _woken_within(cycles: CyclesInFlight, consumer, timeout_s: float) -> float:
    started = time.monotonic()
    assert cycles.next_message(consumer, timeout_s) is None
    return time.monotonic() - started


class _Assignment:
    def __init__(self):
        self.committed = []

    def on_committed(self, offsets):
        self.committed.append([(tp.partition, tp.offset) for tp in offsets])


def test_a_rebalance_lets_the_running_transaction_commit_and_drops_what_the_committer_had_not_begun(stream):
    """The committer has committed cycle A (its outcome not yet taken) and holds cycle B, not begun, when the
    partitions go: A is accounted committed, B comes back to the loop and is dropped with the open cycle, nothing of it
    commits, and the committer takes cycles again afterwards."""
    from confluent_kafka import TopicPartition

    from tests.worker.stream.test_transactions import _records, _transactions
    from worker.stream.closing import CycleClosing
    from worker.stream.committer import Committer, Handed
    from worker.stream.outputs import CycleOutputs

    worker = loop.Worker.__new__(loop.Worker)   # the cycles, the closing rule, the committer and what it reports to
    worker._cycle, worker._inflight, worker._scorer = Cycle(), CyclesInFlight(), _Scorer()
    worker._assignment, events = _Assignment(), []
    worker._emit = lambda kind, info: events.append(kind)
    worker._closing = CycleClosing(8, 50, None, worker._inflight.gpu_busy)
    with _transactions(stream, "drop-test") as txns:
        worker._committer = Committer(txns, worker._inflight.wake)
        try:
            for offset in (30, 31):
                worker._inflight.submit(Cycle(), 0.0, worker._closing.budget, worker._scorer)
                worker._scorer.scores.set_result([])
            a, b = worker._inflight
            for inflight, offset in ((a, 30), (b, 31)):
                inflight.handed, inflight.out = True, CycleOutputs()
                inflight.offsets = [TopicPartition(stream.topics.states, 0, offset)]
            worker._committer.hand(Handed(a, _records(stream, 1, "a"), a.offsets))
            worker._committer.wait_for_outcome(timeout=20)
            worker._committer.hold()
            worker._committer.hand(Handed(b, _records(stream, 1, "b"), b.offsets))
            worker._drop_uncommitted("partitions revoked")
            assert worker._assignment.committed == [[(0, 30)]] and events == ["committed"]
            assert not worker._inflight and not b.handed and worker._committer.pending == 0
            assert stream.committed_offsets()[0] == 30
            worker._committer.hand(Handed("next", _records(stream, 1, "next"), [TopicPartition(stream.topics.states, 0, 7)]))
            worker._committer.wait_for_outcome(timeout=20)
            assert [o.error for o in worker._committer.outcomes()] == [None]   # not held any more
            assert stream.committed_offsets()[0] == 7
        finally:
            worker._committer.close()


def test_a_cycle_scored_before_the_table_applied_a_schema_its_states_name_is_read_again(stream, monkeypatch):
    """A cycle closes with what the schema table has applied (no broker round trip at the close). Before its records
    are made the broker's end offsets say whether a schema record published before the close was missed: none, and the
    cycle goes on; one for a schema its states do not name, and it goes on after the table caught up; one for a schema
    they name, and all uncommitted work is dropped and read again from the committed offsets."""
    from types import SimpleNamespace

    from tests.worker.conftest import QUESTIONS, QUESTIONS_V2
    from worker.stream.batcher import Pending
    from worker.stream.schema_table import SchemaTable

    stream.put_schema("t", QUESTIONS)
    stream.put_schema("u", QUESTIONS)
    table = SchemaTable(stream.bootstrap, stream.topics.schemas)
    worker, events, rewinds = loop.Worker.__new__(loop.Worker), [], []
    worker._table, worker._cycle, worker._assignment, worker._consumer = table, Cycle(), None, None
    worker._router, worker.config = SimpleNamespace(apply=lambda changes, cycle: None), SimpleNamespace(broker_outage_s=5)
    worker._emit = lambda kind, info: events.append(kind)
    worker._drop_uncommitted = lambda why: rewinds.append(why)
    monkeypatch.setattr(loop, "seek_committed", lambda assignment, consumer, outage_s: rewinds.append("seek"))

    def scored(*schema_ids: str) -> SimpleNamespace:   # a cycle closed now, its states naming schema_ids
        cycle = Cycle()
        cycle.entries = [Pending(source=None, state={"schema_id": schema_id}) for schema_id in schema_ids]
        return SimpleNamespace(cycle=cycle, table_view=table.view())

    try:
        table.catch_up()
        caught_up = scored("t")
        assert worker._schemas_confirmed(caught_up) and caught_up.table_view is None and not rewinds

        stream.put_schema("t", QUESTIONS_V2)            # published before the close; the table has not applied it
        other = scored("u")
        assert worker._schemas_confirmed(other) and not rewinds and not events
        assert table.get("t")["version"] == 2           # caught up by the confirmation

        stream.put_schema("t", QUESTIONS)               # version 3, again not applied when the cycle closes
        named = scored("u", "t")
        assert not worker._schemas_confirmed(named)
        assert events == ["schemas_changed_while_scored"] and len(rewinds) == 2 and rewinds[1] == "seek", rewinds
        assert table.get("t")["version"] == 3
    finally:
        table.close()
