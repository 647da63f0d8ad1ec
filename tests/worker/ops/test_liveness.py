"""The broker's reachability as /readyz and /healthz see it (``worker.ops.liveness``, ``worker.ops.health``), without a broker:
the clients' reports, a call that runs too long, librdkafka's statistics, the watchdog's warning."""

from __future__ import annotations

import json
import time

import pytest

from worker.ops import health, liveness
from worker.exceptions import BrokerOutageError


def _stats(*states: tuple[int, str]) -> str:
    return json.dumps({"brokers": {f"b{i}": {"name": f"b{i}", "nodeid": nodeid, "state": state}
                                   for i, (nodeid, state) in enumerate(states)}})


def test_the_last_report_wins():
    broker = liveness.BrokerLiveness()
    assert broker.readiness_problem() is None and broker.outage_s() == 0
    broker.failed("commit_transaction: Local: Timed out")
    time.sleep(0.02)
    assert "broker unreachable" in broker.readiness_problem() and "Timed out" in broker.readiness_problem()
    assert broker.outage_s() >= 0.02
    broker.failed("again")  # the outage counts from its first failure
    assert broker.outage_s() >= 0.02
    broker.succeeded()
    assert broker.readiness_problem() is None and broker.outage_s() == 0


def test_a_call_running_past_the_bound_is_stuck():
    broker = liveness.BrokerLiveness(stuck_after_s=0.05)
    with broker.call("commit"):
        with broker.call("commit_transaction"):  # nested: the outermost call's start counts
            assert broker.readiness_problem() is None
            time.sleep(0.06)
            assert broker.readiness_problem().startswith("commit has not returned")
    assert broker.readiness_problem() is None


def test_statistics_say_whether_a_known_broker_is_connected():
    broker = liveness.BrokerLiveness()
    broker.on_stats(_stats((-1, "INIT"), (1, "DOWN")))
    assert "b1: DOWN" in broker.readiness_problem()
    broker.on_stats(_stats((-1, "INIT"), (1, "UP")))
    assert broker.readiness_problem() is None


def test_health_answers_from_events_and_the_broker(monkeypatch):
    broker = liveness.BrokerLiveness()
    monkeypatch.setattr(liveness, "BROKER", broker)
    state = health.Health()
    assert state.status()[0] is False  # starting
    state.on_event("schemas_loaded", {})
    assert state.status() == (True, "ready")
    broker.failed("no connection to any broker")
    assert state.status() == (False, "broker unreachable for 0 s: no connection to any broker")
    broker.succeeded()
    assert state.alive() == (True, "ok")
    broker.overran("commit_transaction overran its timeout; the process exits in 3 s unless it returns")
    assert state.alive()[0] is False and "exits in 3 s" in state.alive()[1]


def test_the_outage_bound_raises_only_past_its_limit_and_only_while_the_broker_is_down():
    broker = liveness.BrokerLiveness()
    broker.check_outage(0.0)  # answering: no outage however small the limit
    broker.failed("schema topic: Local: Timed out")
    time.sleep(0.02)
    broker.check_outage(60.0)
    with pytest.raises(BrokerOutageError, match=r"--broker-outage-s 0.01\); restart the worker"):
        broker.check_outage(0.01)
    broker.succeeded()
    broker.check_outage(0.0)
