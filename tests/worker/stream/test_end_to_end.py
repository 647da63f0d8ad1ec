"""Schema put -> states -> worker -> ``decider tail --json``: exactly N records equal to SchemaEngine.score."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.worker.conftest import QUESTIONS, REPO, expected_probabilities, state_texts
from worker.devbroker.processes import free_port


def test_states_scored_once_each_with_engine_probabilities(stream, model_dir, schema_engine):
    n = 24
    texts = state_texts(n, seed=1)
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"s-{i}", t) for i, t in enumerate(texts)], "tickets")
    metrics_port = free_port()
    worker = stream.start_worker(model_dir, "e2e", "--metrics-port", str(metrics_port))

    # Wait for N records, then read everything again with an idle timeout: exactly N, no more.
    assert len(_tail(stream, "--max", str(n), "--timeout", "90")) == n, worker.log()
    records = _tail(stream, "--timeout", "2")

    assert sorted(r["state_id"] for r in records) == sorted(f"s-{i}" for i in range(n)), worker.log()
    expected = expected_probabilities(schema_engine, QUESTIONS, texts)
    for record in records:
        i = int(record["state_id"].split("-")[1])
        assert record["schema_id"] == "tickets" and record["schema_version"] == 1
        assert record["model_id"] == model_dir.name
        assert [q["id"] for q in record["questions"]] == ["angry", "want", "team"]
        assert [q["options"] for q in record["questions"]] == [q["options"] for q in QUESTIONS["questions"]]
        for question, want in zip(record["questions"], expected[i]):
            assert question["probabilities"] == pytest.approx(want, abs=1e-5)
            assert sum(question["probabilities"]) == pytest.approx(1.0, abs=1e-5)
        assert record["source_topic"] == stream.topics.states
        assert record["event_time"] == 1_700_000_000_000 and record["worker_id"] == "e2e"

    # The (topic, partition, offset) of every input appears once: nothing scored twice or skipped.
    sources = {(r["source_partition"], r["source_offset"]) for r in records}
    assert len(sources) == n
    _, dead = stream.collect(0, settle_s=0.5)
    assert dead == []
    assert stream.committed_offsets() == stream.end_offsets()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert f'decider_states_scored_total{{schema_id="tickets"}} {float(n)}' in metrics
    assert 'decider_transactions_total{outcome="committed"}' in metrics

    assert worker.stop() == 0, worker.log()
    assert "SIGTERM received" in worker.log()


def _tail(stream, *flags: str) -> list[dict]:
    tail = subprocess.run(
        [sys.executable, "-m", "worker", "tail", "-b", stream.bootstrap, "--topic", "probabilities", "--json", "--from-beginning",
         "--probabilities-topic", stream.topics.probabilities, *flags],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert tail.returncode == 0, tail.stderr
    return [json.loads(line) for line in tail.stdout.splitlines()]
