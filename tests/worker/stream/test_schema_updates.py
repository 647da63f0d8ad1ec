"""Schema changes while the worker runs: a new version applies to later states without a restart; a
tombstone sends later states for that id to the dead letters as unknown_schema; re-publishing revives it
(with the next version number, never reusing one)."""

from __future__ import annotations

import pytest

from tests.worker.conftest import QUESTIONS, QUESTIONS_V2, expected_probabilities, state_texts


def test_new_version_and_tombstone_apply_while_running(stream, model_dir, schema_engine):
    stream.put_schema("tickets", QUESTIONS)
    worker = stream.start_worker(model_dir, "updates", "--schema-wait-ms", "300")
    texts = state_texts(12, seed=5)

    stream.produce_states([(f"a-{i}", t) for i, t in enumerate(texts[:4])], "tickets")
    first, _ = stream.collect(4, settle_s=0)
    assert {r["schema_version"] for r in first} == {1}, worker.log()

    assert stream.put_schema("tickets", QUESTIONS_V2)["version"] == 2
    stream.produce_states([(f"b-{i}", t) for i, t in enumerate(texts[4:8])], "tickets")
    records, _ = stream.collect(8, settle_s=0)
    second = [r for r in records if r["state_id"].startswith("b-")]
    assert len(second) == 4 and {r["schema_version"] for r in second} == {2}, worker.log()
    expected = expected_probabilities(schema_engine, QUESTIONS_V2, texts[4:8])
    for record in second:
        i = int(record["state_id"].split("-")[1])
        assert [q["id"] for q in record["questions"]] == ["urgent", "angry"]
        for question, want in zip(record["questions"], expected[i]):
            assert question["probabilities"] == pytest.approx(want, abs=1e-5)

    stream.delete_schema("tickets")
    stream.produce_states([(f"c-{i}", t) for i, t in enumerate(texts[8:10])], "tickets")
    records, dead = stream.collect(10, settle_s=0)
    assert sorted(d["state_id"] for d in dead) == ["c-0", "c-1"], worker.log()
    assert {d["reason"] for d in dead} == {"unknown_schema"}

    assert stream.put_schema("tickets", QUESTIONS)["version"] == 3  # a re-created id continues its numbering
    stream.produce_states([(f"d-{i}", t) for i, t in enumerate(texts[10:12])], "tickets")
    records, dead = stream.collect(12, settle_s=1.0)
    assert len(records) == 10 and len(dead) == 2
    assert {r["schema_version"] for r in records if r["state_id"].startswith("d-")} == {3}
    assert worker.stop() == 0, worker.log()
