"""``decider calibrate`` against the real broker and the tiny model: ``order`` recovers a known position bias (a
test-only engine wrapper adds it) and publishes it as the next schema version; ``temperature`` recovers T* = 2 from
2,000 labels per question sampled from the model's own probabilities re-tempered at 2, with a lower held-out ECE; bad
feedback is counted and skipped with a summary line; too few labels, bad flags and a mismatched option_bias are one
line and exit code 2."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid

import numpy as np
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

import schemas
from tests.engine.test_calibration import PositionBiased
from tests.worker.conftest import state_texts
from worker.cli.calibration import Run, calibrate_order, calibrate_temperature
from worker.cli.commands import latest_schema
from worker.cli.temperature_fit import tempered
from worker.formats.records import SourceRecord, engine_questions, probability_record
from worker.exceptions import ConfigError

SCHEMA = {"questions": [
    {"id": "team", "question": "Which team should handle it?", "options": ["billing", "shipping", "tech", "sales"]},
    {"id": "mood", "question": "How does the customer feel?", "options": ["calm", "annoyed", "furious"]},
]}
KNOWN_BIAS = [3.0, 1.0, -1.0, -3.0]
CONTENT_SCALE = 6.0   # tests.engine.test_calibration.PositionBiased: a preference by option text that reordering keeps


def _decider(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def _topic(bootstrap: str, partitions: int = 2) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}.feedback"
    admin = AdminClient({"bootstrap.servers": bootstrap})   # held: a client destroyed mid-request fails its futures
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result()
    return name


def _produce(bootstrap: str, topic: str, values: list[bytes], keys: list[str] | None = None) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "log_level": 0})
    for i, value in enumerate(values):
        producer.produce(topic, key=(keys[i] if keys else str(i)).encode(), value=value)
        producer.poll(0)
    assert producer.flush(30) == 0


def test_order_recovers_a_known_position_bias_and_publishes_it(stream, schema_engine, tmp_path):
    """Every state of the topic is sampled, so the plain and the biased fits average the same states."""
    stream.put_schema("support", {**SCHEMA, "calibration": "contextual"})
    stream.produce_states([(f"s-{i}", t) for i, t in enumerate(state_texts(24, seed=71))], "support")
    dry = Run(stream.bootstrap, stream.topics, "support", dry_run=True, echo=lambda line: None)
    plain = calibrate_order(dry, 24, lambda: schema_engine)
    assert plain is None and latest_schema(stream.bootstrap, stream.topics, "support")[1] == 2   # nothing published

    lines = []
    run = Run(stream.bootstrap, stream.topics, "support", report=tmp_path / "order", echo=lines.append)
    published = calibrate_order(run, 100, lambda: PositionBiased(schema_engine, KNOWN_BIAS, CONTENT_SCALE))
    assert published["version"] == 2 and published["calibration"] == "none"
    assert latest_schema(stream.bootstrap, stream.topics, "support")[0] == published
    own = {r["id"]: r["option_bias"] for r in json.loads((tmp_path / "order" / "report.json").read_text())["questions"]}
    report = json.loads((tmp_path / "order" / "report.json").read_text())
    dry_report = calibrate_order(Run(stream.bootstrap, stream.topics, "support", dry_run=True,
                                     report=tmp_path / "plain", echo=lambda line: None), 100, lambda: schema_engine)
    assert dry_report is None
    plain_bias = {r["id"]: r["option_bias"]
                  for r in json.loads((tmp_path / "plain" / "report.json").read_text())["questions"]}
    for question, row in zip(published["questions"], report["questions"]):
        n = len(question["options"])
        want = np.array(KNOWN_BIAS[:n]) - np.mean(KNOWN_BIAS[:n])
        np.testing.assert_allclose(np.array(question["option_bias"]) - plain_bias[question["id"]], want, atol=0.05)
        assert row["disagreement_after"] < row["disagreement_before"] - 0.1, row
        assert own[question["id"]] == question["option_bias"]
        assert (tmp_path / "order" / f"position-prior-{question['id']}.png").stat().st_size > 1000
    assert any("calibration contextual -> none" in line for line in lines)
    assert any(line.startswith("published option_bias of 2 questions as schema support version 2") for line in lines)


def _scored_records(stream, schema_engine, record: dict, texts: list[str]) -> list[dict]:
    """The probability records a worker would publish for ``texts`` under schema version ``record`` (real Avro)."""
    handle = schema_engine.prepare(engine_questions(record))
    try:
        scores = []
        for start in range(0, len(texts), 64):
            scores += schema_engine.score(handle, texts[start:start + 64])
    finally:
        schema_engine.release(handle)
    out = []
    for i, (text, p) in enumerate(zip(texts, scores)):
        state = {"state_id": f"f-{i}", "schema_id": record["schema_id"], "state": text}
        probabilities = [p[q, :len(question["options"])].tolist() for q, question in enumerate(record["questions"])]
        out.append(probability_record(state, record, probabilities, "tiny",
                                      SourceRecord(stream.topics.states, 0, i, None, None), "w0"))
    return out


def _labels_at(records: list[dict], temperature: float, seed: int) -> list[bytes]:
    """Feedback for every (record, question): an option drawn from its probabilities re-tempered at ``temperature``."""
    rnd = random.Random(seed)
    feedback = []
    for record in records:
        for question in record["questions"]:
            label = rnd.choices(question["options"], weights=tempered(question["probabilities"], temperature))[0]
            feedback.append(json.dumps({"state_id": record["state_id"], "question_id": question["id"],
                                        "label": label}).encode())
    return feedback


def test_temperature_recovers_t_star_two_and_lowers_the_held_out_ece(stream, schema_engine, tmp_path):
    version = stream.put_schema("support", SCHEMA)
    records = _scored_records(stream, schema_engine, version, state_texts(2000, seed=72))
    _produce(stream.bootstrap, stream.topics.probabilities, [schemas.encode_probability(r) for r in records],
             [r["state_id"] for r in records])
    feedback = _topic(stream.bootstrap)
    _produce(stream.bootstrap, feedback, _labels_at(records, 2.0, seed=73))

    lines = []
    run = Run(stream.bootstrap, stream.topics, "support", report=tmp_path / "temperature", echo=lines.append)
    published = calibrate_temperature(run, feedback, min_labels=200)
    assert lines[0] == (f"feedback from {feedback}: 4000 records, 4000 labelled answers joined with schema support "
                        "v1's committed probability records")
    report = json.loads((tmp_path / "temperature" / "report.json").read_text())
    for question, row in zip(published["questions"], report["questions"]):
        assert question["temperature"] == pytest.approx(2.0, rel=0.1), row
        assert row["labels"] == 2000 and 300 < row["held_out"] < 500 and row["train"] + row["held_out"] == 2000
        assert row["ece_after"] < row["ece_before"] and row["log_loss_after"] < row["log_loss_before"]
        assert len(row["reliability_before"]) == 15
        assert (tmp_path / "temperature" / f"reliability-{question['id']}.png").stat().st_size > 1000
    assert published["version"] == 2 and report["published_version"] == 2


def test_bad_feedback_is_counted_and_skipped_and_too_few_labels_is_one_line(stream, schema_engine, tmp_path):
    version = stream.put_schema("support", SCHEMA)
    records = _scored_records(stream, schema_engine, version, state_texts(30, seed=74))
    _produce(stream.bootstrap, stream.topics.probabilities, [schemas.encode_probability(r) for r in records])
    feedback = _topic(stream.bootstrap, partitions=1)
    good = _labels_at(records, 1.0, seed=75)
    bad = [b"not json {", b"\xff\xfe", json.dumps(["a list"]).encode(),
           json.dumps({"state_id": "f-1", "question_id": "team"}).encode(),
           json.dumps({"state_id": "nobody", "question_id": "team", "label": "tech"}).encode(),
           json.dumps({"state_id": "f-1", "question_id": "colour", "label": "red"}).encode(),
           json.dumps({"state_id": "f-1", "question_id": "team", "label": "marketing"}).encode()]
    _produce(stream.bootstrap, feedback, good + bad)

    lines = []
    run = Run(stream.bootstrap, stream.topics, "support", dry_run=True, echo=lines.append)
    with pytest.raises(ConfigError, match="too few labelled answers to fit temperatures for schema support v1: "
                                          "'team' has 30, 'mood' has 30 \\(at least 200 a question"):
        calibrate_temperature(run, feedback, min_labels=200)
    assert lines == [f"feedback from {feedback}: 67 records, 60 labelled answers joined with schema support v1's "
                     "committed probability records; skipped 7: 2 not JSON, 2 not an object of strings state_id, "
                     "question_id, label, 1 unknown question, 1 unknown state (no committed record of this version), "
                     "1 label not an option"]

    args = ["calibrate", "-b", stream.bootstrap, "--schema-id", "support", "--method", "temperature",
            "--feedback-topic", feedback, "--states-topic", stream.topics.states, "--schemas-topic",
            stream.topics.schemas, "--probabilities-topic", stream.topics.probabilities]
    refused = _one_line_error(_decider(*args))
    assert "'team' has 30, 'mood' has 30" in refused and "--min-labels" in refused
    done = _decider(*args, "--min-labels", "20", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "skipped 7: 2 not JSON" in done.stdout and "dry run: nothing published" in done.stdout, done.stdout
    assert latest_schema(stream.bootstrap, stream.topics, "support")[1] == 2


def test_calibrate_refuses_bad_flags_and_unknown_schemas_in_one_line(stream, model_dir):
    stream.put_schema("support", SCHEMA)
    base = ["calibrate", "-b", stream.bootstrap, "--schemas-topic", stream.topics.schemas,
            "--states-topic", stream.topics.states, "--probabilities-topic", stream.topics.probabilities]
    assert "--method must be order or temperature, not 'pride'" in _one_line_error(
        _decider(*base, "--schema-id", "support", "--method", "pride"))
    assert "--method order needs --model" in _one_line_error(_decider(*base, "--schema-id", "support", "--method", "order"))
    assert "--method temperature needs --feedback-topic" in _one_line_error(
        _decider(*base, "--schema-id", "support", "--method", "temperature"))
    assert "no schema 'nope' in topic" in _one_line_error(
        _decider(*base, "--schema-id", "nope", "--method", "order", "--model", str(model_dir)))
    assert f"no states of schema 'support' in topic {stream.topics.states}" in _one_line_error(
        _decider(*base, "--schema-id", "support", "--method", "order", "--model", str(model_dir)))
    missing = _decider(*base, "--schema-id", "support", "--method", "temperature", "--feedback-topic", "no.such.topic")
    lines = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert missing.returncode == 4 and len(lines) == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert "topic no.such.topic does not exist" in lines[0] and "labelling tool" in lines[0]


def test_schema_put_refuses_an_option_bias_that_does_not_match_the_options(stream, tmp_path):
    path = tmp_path / "biased.json"
    for bias, problem in (([0.1, 0.2], "question 'team' has 2 option_bias values for 4 options"),
                          ([0.1, "high", 0, 0], "question 'team' has option_bias [0.1, 'high', 0, 0]")):
        path.write_text(json.dumps({"questions": [{**SCHEMA["questions"][0], "option_bias": bias}]}))
        line = _one_line_error(_decider("schema", "put", "-b", stream.bootstrap, "--schemas-topic",
                                        stream.topics.schemas, "--id", "biased", str(path)))
        assert problem in line, line
    path.write_text(json.dumps({"calibration": "pride", "questions": SCHEMA["questions"]}))
    assert "calibration must be 'none' or 'contextual'" in _one_line_error(
        _decider("schema", "put", "-b", stream.bootstrap, "--schemas-topic", stream.topics.schemas, "--id", "biased",
                 str(path)))
