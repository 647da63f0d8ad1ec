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


def test_the_loop_wakes_when_the_cycle_in_flight_is_launched_then_when_it_is_scored(stream):
    """While a cycle is on the GPU the loop waits on it (a consumer's poll cannot be woken by another thread): first
    on its launch, when its transaction is to be opened then, so that the broker round trips overlap the scoring; then,
    the transaction open, on its scores, so that the commit follows them at once. With nothing in flight it waits on
    the consumer."""
    import threading

    from confluent_kafka import TopicPartition

    from tests.worker.stream.test_transactions import _group_consumer, _transactions
    from worker.stream.scorer import LaunchTimes

    consumer, cycles, scorer = _group_consumer(stream), CyclesInFlight(), _Scorer()
    with _transactions(stream, "wake-test") as txns:
        try:
            cycles.submit(Cycle(), 0.0, CycleBudget(None, 0.05, cycles.gpu_busy), scorer)
            threading.Timer(0.05, scorer.on_launched, [LaunchTimes(0.0, 0.0, 0.0)]).start()
            woken_within = functools.partial(_woken_within, cycles, consumer, txns)
            assert woken_within(2.0) < 1.0        # by the launch, not the 2 s timeout
            assert woken_within(2.0) < 0.5        # launched, its transaction not open: no wait at all
            cycles.oldest.offsets = [TopicPartition(stream.topics.states, 0, 1)]
            txns.open(cycles.oldest.offsets)
            threading.Timer(0.2, scorer.scores.set_result, [[]]).start()
            waited = woken_within(2.0)
            assert scorer.scores.done() and 0.15 <= waited < 1.0  # the transaction open: by the scores
            assert woken_within(2.0) < 0.5        # scored already: no wait at all
            txns.discard("test over")
            cycles.clear()
            assert woken_within(0.3) >= 0.25      # nothing in flight, nothing to read: the poll
        finally:
            consumer.close()


class _Scorer:
    """Takes a cycle's batch and hands the test its scores and the callback that says it was launched."""

    def submit(self, jobs, on_launched):
        self.on_launched, self.scores = on_launched, Future()
        return self.scores


def _woken_within(cycles: CyclesInFlight, consumer, txns, timeout_s: float) -> float:
    started = time.monotonic()
    assert cycles.next_message(consumer, txns, timeout_s) is None
    return time.monotonic() - started


def test_dropping_the_uncommitted_states_aborts_the_transaction_opened_for_them(stream):
    """A rebalance drops the cycles in flight; a transaction already opened for the oldest (its offsets sent while the
    GPU scored it) is aborted with them, so those offsets never commit for partitions that may be another's now."""
    from confluent_kafka import TopicPartition

    from tests.worker.stream.test_transactions import _records, _transactions
    from worker.stream.closing import CycleClosing

    worker = loop.Worker.__new__(loop.Worker)   # only the cycles, the closing rule and the transactions take part
    with _transactions(stream, "drop-test") as worker._txns:
        worker._cycle, worker._inflight = Cycle(), CyclesInFlight()
        worker._closing = CycleClosing(8, 50, None, worker._inflight.gpu_busy)
        worker._inflight.submit(Cycle(), 0.0, worker._closing.budget, _Scorer())
        inflight = worker._inflight.oldest
        inflight.offsets = [TopicPartition(stream.topics.states, 0, 30)]
        worker._txns.open(inflight.offsets)
        worker._drop_uncommitted("partitions revoked")
        assert not worker._inflight and not worker._txns.is_open_for(inflight.offsets)
        # the next transaction commits only its own offsets
        worker._txns.commit(_records(stream, 1, "next"), [TopicPartition(stream.topics.states, 0, 7)])
        assert stream.committed_offsets()[0] == 7
