"""The loop's blocking steps are timed, and a slow one is logged (what a stalled stream's log should show)."""
import logging
import time

from worker import loop, metrics


def _count(step: str) -> float:
    return next((s.value for s in metrics.LOOP_STEP_SECONDS.collect()[0].samples
                 if s.name.endswith("_count") and s.labels["step"] == step), 0.0)


def test_a_slow_step_is_timed_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(loop, "SLOW_STEP_S", 0.01)
    before = _count("schema_catch_up")
    with caplog.at_level(logging.WARNING, logger="worker.loop"):
        with loop._blocking_step("schema_catch_up"):
            time.sleep(0.02)
        with loop._blocking_step("wait_for_scores", warn=False):
            time.sleep(0.02)
    assert _count("schema_catch_up") == before + 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("slow step: schema_catch_up took") for m in messages)
    assert not any("wait_for_scores" in m for m in messages)


def test_the_loop_wakes_when_the_cycle_in_flight_is_scored_not_at_the_end_of_its_poll(kafka_bootstrap):
    """While a cycle is on the GPU the loop waits on its scores (a consumer's poll cannot be woken by another thread),
    so the commit follows the scores at once; with nothing in flight it waits on the consumer."""
    import threading
    from collections import deque
    from concurrent.futures import Future

    from confluent_kafka import Consumer

    worker = loop.Worker.__new__(loop.Worker)   # only the consumer and the cycles in flight take part
    worker._consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "wake-test", "log_level": 0})
    try:
        scores = Future()
        worker._inflight = deque([loop.InFlight(cycle=None, keys=[], future=scores, closed_at=0.0)])
        threading.Timer(0.05, scores.set_result, [[]]).start()
        started = time.monotonic()
        assert worker._next_message(2.0) is None
        assert scores.done() and time.monotonic() - started < 1.0     # woken by the scores, not the 2 s timeout
        started = time.monotonic()
        assert worker._next_message(2.0) is None                       # scored already: no wait at all
        assert time.monotonic() - started < 1.0
        worker._inflight = deque()
        started = time.monotonic()
        assert worker._next_message(0.3) is None                       # nothing in flight, nothing to read: the poll
        assert time.monotonic() - started >= 0.25
    finally:
        worker._consumer.close()
