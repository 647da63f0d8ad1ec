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
