"""The worker's HTTP endpoint and structured logs, scraped from a real worker: /readyz turns ready only after the
model and schema table are loaded; /metrics moves as states are scored (counts, histograms, lag, prepared
schemas, engine paths, dead letters by reason); --log-format json writes one JSON object per line."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.worker.conftest import QUESTIONS, state_texts
from worker.devbroker.processes import free_port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    status, text = _get(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_health_and_json_logs_follow_the_run(stream, model_dir):
    port = free_port()
    stream.put_schema("tickets", QUESTIONS)
    worker = stream.start_worker(model_dir, "observed", "--metrics-port", str(port), "--log-format", "json")

    # Not ready while the model and the schema table load; ready after.
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            status, body = _get(port, "/readyz")
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.02)
            continue
        seen.append(status)
        if status == 200:
            break
        time.sleep(0.02)
    assert seen and seen[-1] == 200 and 503 in seen, (seen, worker.log())
    assert _get(port, "/healthz")[0] == 200

    before = _samples(port)
    assert _value(before, "decider_states_scored_total", schema_id="tickets") == 0
    assert _value(before, "decider_batch_states_count") == 0

    n = 24
    stream.produce_states([(f"m-{i}", t) for i, t in enumerate(state_texts(n, seed=3))], "tickets")
    stream.produce_raw(b"junk", b"\x00not avro")
    probabilities, dead = stream.collect(n + 1, timeout_s=90)
    assert len(probabilities) == n and len(dead) == 1, worker.log()

    # The lag gauge comes from librdkafka's statistics (every 2 s): wait for a report after the last commit.
    deadline = time.monotonic() + 15
    while True:
        after = _samples(port)
        lags = {labels: v for (name, labels), v in after.items() if name == "decider_consumer_lag"}
        states_lags = [v for labels, v in lags.items() if dict(labels)["topic"] == stream.topics.states]
        if len(states_lags) == stream.partitions and all(v == 0 for v in states_lags) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(states_lags) == stream.partitions and all(v == 0 for v in states_lags), lags

    assert _value(after, "decider_states_scored_total", schema_id="tickets") == n
    assert _value(after, "decider_dead_letters_total", reason="undecodable") == 1
    assert _value(after, "decider_transactions_total", outcome="committed") >= 1
    for histogram in ("decider_batch_states", "decider_batch_fill_wait_seconds", "decider_batch_launch_seconds",
                      "decider_engine_seconds", "decider_transaction_commit_seconds", "decider_cycle_seconds"):
        assert _value(after, f"{histogram}_count") > _value(before, f"{histogram}_count"), histogram
    assert _value(after, "decider_batch_states_sum") == n
    assert _value(after, "decider_prepared_schemas") == 1
    assert _value(after, "decider_prepared_schema_bytes") > 0
    assert _value(after, "decider_prefix_bank_bytes") >= _value(after, "decider_prepared_schema_bytes")
    assert _value(after, "decider_engine_graphs") == 0
    # On CPU every batch runs eagerly; graph captures and replays exist only on CUDA (tests/worker/stream/test_gpu.py).
    assert _value(after, "decider_engine_batches", path="eager") >= 1
    assert _value(after, "decider_engine_batches", path="captures") == 0

    assert worker.stop() == 0, worker.log()
    lines = [line for line in worker.log().splitlines() if line.startswith("{")]
    events = [json.loads(line) for line in lines]
    kinds = {e.get("event") for e in events}
    assert {"model_loaded", "schemas_loaded", "assigned", "schema_prepared", "committed", "dead_letter", "stopped"} <= kinds, kinds
    committed = [e for e in events if e.get("event") == "committed"]
    assert sum(e["scored"] for e in committed) == n
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in events)
    dead_line = next(e for e in events if e.get("event") == "dead_letter")
    assert dead_line["reason"] == "undecodable" and dead_line["count"] == 1


def test_a_transaction_of_several_cycles_counts_once_and_its_time_once():
    """The committer commits the cycles scored meanwhile in one transaction: each cycle's latency and records count,
    the transaction and its duration once (with its first cycle)."""
    from worker.ops import metrics

    def value(metric, suffix: str, labels: dict | None = None) -> float:
        return next((s.value for s in metric.collect()[0].samples
                     if s.name.endswith(suffix) and (labels is None or s.labels == labels)), 0.0)

    committed, commits, cycles = (value(metrics.TRANSACTIONS, "_total", {"outcome": "committed"}),
                                  value(metrics.COMMIT_SECONDS, "_count"), value(metrics.CYCLE_SECONDS, "_count"))
    for position in range(3):
        metrics.count_committed(0.01, {"s": 2}, {}, first_in_transaction=position == 0)
        metrics.on_event("committed", {"commit_ms": 4.0, "cycles_in_transaction": 3, "transaction_cycle": position})
    assert value(metrics.TRANSACTIONS, "_total", {"outcome": "committed"}) == committed + 1
    assert value(metrics.COMMIT_SECONDS, "_count") == commits + 1
    assert value(metrics.CYCLE_SECONDS, "_count") == cycles + 3
