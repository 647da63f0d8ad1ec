"""The loop's blocking steps are timed, and a slow one is logged (what a stalled stream's log should show)."""
import logging
import queue
import time

from worker.ops import metrics
from worker.stream import loop


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
    from collections import deque
    from concurrent.futures import Future

    from confluent_kafka import TopicPartition

    from tests.worker.stream.test_transactions import _group_consumer, _transactions
    from worker.stream.scorer import LaunchTimes

    worker = loop.Worker.__new__(loop.Worker)   # only the consumer, the transactions and the cycles in flight take part
    worker._consumer, worker._wakeups = _group_consumer(stream), queue.SimpleQueue()
    with _transactions(stream, "wake-test") as worker._txns:
        try:
            scores = Future()
            inflight = loop.InFlight(cycle=None, keys=[], future=scores, closed_at=0.0)
            worker._inflight = deque([inflight])
            threading.Timer(0.05, inflight.on_launched, [LaunchTimes(0.0, 0.0, 0.0)]).start()
            assert _woken_within(worker, 2.0) < 1.0        # by the launch, not the 2 s timeout
            assert _woken_within(worker, 2.0) < 0.5        # launched, its transaction not open: no wait at all
            inflight.offsets = [TopicPartition(stream.topics.states, 0, 1)]
            worker._txns.open(inflight.offsets)
            threading.Timer(0.2, scores.set_result, [[]]).start()
            waited = _woken_within(worker, 2.0)
            assert scores.done() and 0.15 <= waited < 1.0  # the transaction open: by the scores
            assert _woken_within(worker, 2.0) < 0.5        # scored already: no wait at all
            worker._txns.discard("test over")
            worker._inflight = deque()
            assert _woken_within(worker, 0.3) >= 0.25      # nothing in flight, nothing to read: the poll
        finally:
            worker._consumer.close()


def _woken_within(worker, timeout_s: float) -> float:
    started = time.monotonic()
    assert worker._next_message(timeout_s) is None
    return time.monotonic() - started


def test_dropping_the_uncommitted_states_aborts_the_transaction_opened_for_them(stream):
    """A rebalance drops the cycles in flight; a transaction already opened for the oldest (its offsets sent while the
    GPU scored it) is aborted with them, so those offsets never commit for partitions that may be another's now."""
    from collections import deque
    from concurrent.futures import Future

    from confluent_kafka import TopicPartition

    from tests.worker.stream.test_transactions import _records, _transactions
    from worker.stream.batcher import Cycle
    from worker.stream.latency_budget import CycleBudget

    worker = loop.Worker.__new__(loop.Worker)   # only the cycles, the budget and the transactions take part
    with _transactions(stream, "drop-test") as worker._txns:
        inflight = loop.InFlight(cycle=Cycle(), keys=[], future=Future(), closed_at=0.0)
        inflight.offsets = [TopicPartition(stream.topics.states, 0, 30)]
        worker._txns.open(inflight.offsets)
        worker._cycle, worker._inflight = Cycle(), deque([inflight])
        worker._budget = CycleBudget(None, 0.05, lambda: False)
        worker._drop_uncommitted("partitions revoked")
        assert not worker._inflight and not worker._txns.is_open_for(inflight.offsets)
        # the next transaction commits only its own offsets
        worker._txns.commit(_records(stream, 1, "next"), [TopicPartition(stream.topics.states, 0, 7)])
        assert stream.committed_offsets()[0] == 7
