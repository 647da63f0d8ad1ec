"""Calibration on the stream (issue 34): a calibrated schema version's records carry the calibrated probabilities,
the raw ones and the label mass, as the engine computes them for that version; a replay of a calibrated schema
reproduces the live worker's records bit for bit (deterministic kernels: the contextual bias and every score are the
same in another process and other batches)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.worker.conftest import state_texts
from tests.worker.ops.test_metrics import _samples
from tests.worker.stream.test_latency_budget_stream import _sample
from tests.worker.stream.test_replay import _replay
from worker.devbroker.processes import free_port
from worker.formats.records import engine_options, engine_questions, question_schema_record

CALIBRATED = {
    "calibration": "contextual",
    "questions": [
        {"id": "angry", "question": "Is the customer angry?", "options": ["yes", "no"], "option_bias": [0.4, -0.4]},
        {"id": "team", "question": "Which team?", "options": ["billing", "shipping", "tech", "sales"],
         "temperature": 0.7},
    ],
}
UNCALIBRATED = {"label_mass": False,
                "questions": [{"id": "urgent", "question": "Is it urgent?", "options": ["yes", "no", "unclear"]}]}


def _engine_scores(schema_engine, document: dict, texts: list[str]):
    """``SchemaEngine.score_details`` of ``texts`` under ``document`` as the worker prepares it."""
    record = question_schema_record(document, "ref", 1)
    handle = schema_engine.prepare(engine_questions(record), **engine_options(record))
    try:
        return schema_engine.score_details(handle, texts)
    finally:
        schema_engine.release(handle)


def test_records_of_a_calibrated_schema_carry_calibrated_and_raw_probabilities_and_the_label_mass(
        stream, model_dir, schema_engine):
    texts = state_texts(12, seed=61)
    stream.put_schema("calibrated", CALIBRATED)
    stream.put_schema("plain", UNCALIBRATED)
    stream.produce_states([(f"c-{i}", t) for i, t in enumerate(texts)], "calibrated")
    stream.produce_states([(f"p-{i}", t) for i, t in enumerate(texts[:4])], "plain")
    port = free_port()
    worker = stream.start_worker(model_dir, "calibrated-0", "--metrics-port", str(port))
    probabilities, dead = stream.collect(16, timeout_s=120)
    assert dead == [] and len(probabilities) == 16, worker.log()
    samples = _samples(port)          # one observation per record of a schema with the mass: its lowest question's
    assert _sample(samples, "decider_label_mass_count", schema_id="calibrated") == 12
    lowest = sum(min(q["label_mass"] for q in r["questions"]) for r in probabilities if r["schema_id"] == "calibrated")
    assert _sample(samples, "decider_label_mass_sum", schema_id="calibrated") == pytest.approx(lowest, rel=1e-9)
    assert ("decider_label_mass_count", (("schema_id", "plain"),)) not in samples
    expected = _engine_scores(schema_engine, CALIBRATED, texts)
    for record in (r for r in probabilities if r["schema_id"] == "calibrated"):
        want = expected[int(record["state_id"].split("-")[1])]
        for q, question in enumerate(record["questions"]):
            n = len(question["options"])
            assert question["probabilities"] == _approx(want.probabilities[q, :n])
            assert question["raw_probabilities"] == _approx(want.raw_probabilities[q, :n])
            assert question["raw_probabilities"] != question["probabilities"]       # contextual changed both
            assert [question["label_mass"]] == _approx([want.label_mass[q]])
            assert 0 < question["label_mass"] <= 1
    for record in (r for r in probabilities if r["schema_id"] == "plain"):
        assert [(q["label_mass"], q["raw_probabilities"]) for q in record["questions"]] == [(None, None)]


def _approx(values):
    return pytest.approx([float(v) for v in values], abs=1e-5)


def test_a_replay_of_a_calibrated_schema_reproduces_the_live_records_bit_for_bit(stream_factory, model_dir):
    live, replayed = stream_factory(2), stream_factory(2)
    texts = state_texts(24, seed=62)
    live.put_schema("calibrated", CALIBRATED)
    worker = live.start_worker(model_dir, "calibrated-live", "--deterministic", "--max-batch", "3")
    live.produce_states([(f"r-{i}", t) for i, t in enumerate(texts)], "calibrated")
    live_records, dead = live.collect(24, timeout_s=120)
    assert dead == [] and len(live_records) == 24, worker.log()
    worker.stop()

    # the replay reads the live states and schemas, writes to other topics, in batches of 16 and in another process
    source = dataclasses.replace(live, topics=dataclasses.replace(
        live.topics, probabilities=replayed.topics.probabilities, dead_letter=replayed.topics.dead_letter))
    replay = _replay(source, model_dir, "calibrated-replay", "--deterministic", "--max-batch", "16", "--no-progress")
    assert replay.process.wait(180) == 0, replay.log()
    replay_records, dead = replayed.collect(24, timeout_s=60)
    assert dead == [] and len(replay_records) == 24, replay.log()

    def answers(records):
        return {r["state_id"]: [(q["probabilities"], q["raw_probabilities"], q["label_mass"]) for q in r["questions"]]
                for r in records}

    assert answers(replay_records) == answers(live_records)              # floats compared exactly
    assert all(q["raw_probabilities"] is not None and q["label_mass"] is not None
               for r in live_records for q in r["questions"])
