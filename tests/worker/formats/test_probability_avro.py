"""worker/formats/probability_avro.py writes, byte for byte, what fastavro writes for the record's dict."""
import random

import schemas
from worker.formats import probability_avro
from worker.formats.records import SourceRecord, probability_record


def _schema(rnd: random.Random, n_questions: int) -> dict:
    return {"schema_id": rnd.choice(["s", "support-é", "x" * 200]), "version": rnd.choice([1, 7, 300, 2**40]),
            "questions": [{"id": f"q{i}-ü", "options": [f"opt {j} {'ß' * rnd.randint(0, 3)}"
                                                        for j in range(rnd.randint(2, 26))]}
                          for i in range(n_questions)]}


def test_the_layout_is_the_avsc_files():
    assert probability_avro.matches_schema()


def test_records_are_the_bytes_fastavro_writes():
    rnd = random.Random(0)
    for case in range(300):
        schema = _schema(rnd, rnd.randint(1, 12))
        n = [len(q["options"]) for q in schema["questions"]]
        probabilities = [[rnd.random() for _ in range(k)] for k in n]
        mass = [rnd.random() for _ in n] if case % 2 else None
        raw = [[rnd.random() for _ in range(k)] if rnd.random() < 0.5 else None for k in n] if case % 3 == 0 else None
        fingerprint = ({f: f"{f} #{rnd.getrandbits(64):016x}" for f in probability_avro.LAYOUT["ScoringFingerprint"]}
                       if case % 4 else None)
        state = {"state_id": rnd.choice(["a", "état-" + str(case), "9" * 300]),
                 "event_time": rnd.choice([None, 0, 1_700_000_000_000 + case]),
                 "metadata": rnd.choice([None, {}, {"k": "v", "ü": "x" * 130}])}
        source = SourceRecord(rnd.choice(["states", "t" * 70]), rnd.randint(0, 2**31 - 1), rnd.randint(0, 2**62), None,
                              b"")
        worker_id, truncated, scored_at = rnd.choice(["w-0", "worker.é"]), case % 5 == 0, 1_800_000_000_000 + case
        record = probability_record(state, schema, probabilities, "model-x", source, worker_id, truncated=truncated,
                                    label_mass=mass, raw_probabilities=raw, fingerprint=fingerprint,
                                    scored_at=scored_at)
        written = probability_avro.ProbabilityWriter(schema, "model-x", worker_id, fingerprint).write(
            state, probabilities, source.topic, source.partition, source.offset, scored_at, truncated, mass, raw)
        assert written == schemas.encode_probability(record), case
        assert schemas.decode_probability(written)["questions"][0]["probabilities"] == probabilities[0]


def test_a_changed_schema_is_noticed():
    parsed = schemas.PROBABILITY_RECORD
    renamed = {**parsed, "fields": [dict(f, name="other") if f["name"] == "truncated" else f for f in parsed["fields"]]}
    assert not probability_avro.matches_schema(renamed)
