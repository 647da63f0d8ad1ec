"""``decider calibrate`` against the real broker and the tiny model: ``order`` recovers a known position bias (a
test-only engine wrapper adds it) and publishes it as the next schema version; ``temperature`` recovers T* = 0.5 and
T* = 2.5 (one question each) from 2,000 labels per question sampled from the model's own probabilities re-tempered at
them, read from the schema version it published, with a lower held-out log-loss and ECE at the published temperature; bad
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
from worker.cli.temperature_fit import held_out as held_out_answer
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


def _tempered(probabilities, temperature: float) -> np.ndarray:
    """softmax(log p / temperature), the test's own (not ``worker.cli.temperature_fit``'s)."""
    logits = np.log(np.maximum(np.asarray(probabilities, dtype=np.float64), 1e-12)) / temperature
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def _labelled(records: list[dict], temperatures: dict[str, float], seed: int) -> list[tuple[str, str, list, int]]:
    """(state id, question id, published probabilities, label index) for every (record, question): the label drawn
    from the probabilities re-tempered at that question's ``temperatures``."""
    rnd = random.Random(seed)
    return [(record["state_id"], q["id"], q["probabilities"],
             rnd.choices(range(len(q["options"])), weights=_tempered(q["probabilities"], temperatures[q["id"]]))[0])
            for record in records for q in record["questions"]]


def _feedback(records: list[dict], labelled: list[tuple[str, str, list, int]]) -> list[bytes]:
    options = {q["id"]: q["options"] for q in records[0]["questions"]}
    return [json.dumps({"state_id": s, "question_id": q, "label": options[q][label]}).encode()
            for s, q, _, label in labelled]


def _labels_at(records: list[dict], temperature: float, seed: int) -> list[bytes]:
    """Feedback for every (record, question): an option drawn from its probabilities re-tempered at ``temperature``."""
    return _feedback(records, _labelled(records, {q["id"]: temperature for q in records[0]["questions"]}, seed))


def _log_loss(answers: list[tuple[list, int]], temperature: float) -> float:
    return -float(np.mean([np.log(_tempered(p, temperature)[label]) for p, label in answers]))


def _ece(answers: list[tuple[list, int]], temperature: float, bins: int = 15) -> float:
    """Expected calibration error of the top probability, equal-width bins (the test's own)."""
    tops = [(_tempered(p, temperature).max(), int(_tempered(p, temperature).argmax()) == label) for p, label in answers]
    total = 0.0
    for b in range(bins):
        inside = [(c, hit) for c, hit in tops if min(int(c * bins), bins - 1) == b]
        if inside:
            total += len(inside) * abs(np.mean([hit for _, hit in inside]) - np.mean([c for c, _ in inside]))
    return total / len(tops)


def test_temperature_recovers_known_temperatures_below_and_above_one_in_the_published_version(stream, schema_engine,
                                                                                             tmp_path):
    """Labels drawn at T* = 0.5 for one question and 2.5 for the other (the records published at temperature 1):
    the schema version published carries each question's T*, and the held-out answers re-tempered to it (by this
    test's own arithmetic) have a lower log-loss and ECE than as published."""
    version = stream.put_schema("support", SCHEMA)
    records = _scored_records(stream, schema_engine, version, state_texts(2000, seed=72))
    _produce(stream.bootstrap, stream.topics.probabilities, [schemas.encode_probability(r) for r in records],
             [r["state_id"] for r in records])
    feedback = _topic(stream.bootstrap)
    truth = {"team": 0.5, "mood": 2.5}
    labelled = _labelled(records, truth, seed=73)
    _produce(stream.bootstrap, feedback, _feedback(records, labelled))

    lines = []
    run = Run(stream.bootstrap, stream.topics, "support", report=tmp_path / "temperature", echo=lines.append)
    returned = calibrate_temperature(run, feedback, min_labels=200)
    assert lines[0] == (f"feedback from {feedback}: 4000 records, 4000 labelled answers joined with schema support "
                        "v1's committed probability records")
    published, next_version = latest_schema(stream.bootstrap, stream.topics, "support")   # from the schemas topic
    assert published["version"] == 2 and next_version == 3
    report = json.loads((tmp_path / "temperature" / "report.json").read_text())
    assert report["published_version"] == 2 and returned == published
    for question, row in zip(published["questions"], report["questions"]):
        qid, temperature = question["id"], question["temperature"]
        assert temperature == pytest.approx(truth[qid], rel=0.15), (qid, temperature)   # 0.535 and 2.45 here
        held_out = [(p, label) for s, q, p, label in labelled if q == qid and held_out_answer(s, q)]
        assert 300 < len(held_out) < 500
        assert _log_loss(held_out, temperature) < _log_loss(held_out, 1.0), qid
        assert _ece(held_out, temperature) < _ece(held_out, 1.0), qid
        assert row["labels"] == 2000 and row["held_out"] == len(held_out) and row["train"] + row["held_out"] == 2000
        assert len(row["reliability_before"]) == 15
        assert (tmp_path / "temperature" / f"reliability-{qid}.png").stat().st_size > 1000


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
