"""``decider replay --verify-against``: the comparison itself on made-up records (identical, a difference of one ulp,
fingerprints that differ or are missing, states with no live record), then end to end on the broker with the tiny
model and the deterministic CPU table: a replay reproduces the live records bit for bit (exit 0); after a new schema
version with another temperature the states are not comparable, in the calibration part, not differing (exit 0); a
live record changed by one ulp differs (exit 1, its state id named)."""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys

from confluent_kafka import Producer

import schemas
from tests.worker.conftest import QUESTIONS, Stream, state_texts
from worker.config import Topics
from worker.kafka_clients import create_topics
from worker.stream.verify import compare, incomparable, source_of

FINGERPRINT = {"digest": "d1", "model": "m1", "decider": "0.1.0 #e1", "kernels": "cpu float32 torch deterministic #k1",
               "prompt": "p1", "calibration": "none #c1"}


def _record(state_id: str, offset: int, probabilities: list[float], fingerprint=FINGERPRINT, version: int = 1) -> dict:
    return {"state_id": state_id, "schema_id": "tickets", "schema_version": version, "source_topic": "states",
            "source_partition": 0, "source_offset": offset, "fingerprint": fingerprint,
            "questions": [{"id": "q", "options": ["a", "b"], "probabilities": probabilities, "label_mass": 0.5,
                           "raw_probabilities": None}]}


def test_compare_counts_identical_differing_not_comparable_and_missing():
    live = [_record(f"s{i}", i, [0.25, 0.75]) for i in range(6)]
    replayed = copy.deepcopy(live)
    replayed[1]["questions"][0]["probabilities"] = [0.25, math.nextafter(0.75, 1.0)]           # one ulp
    replayed[2]["questions"][0]["label_mass"] = 0.5 + 1e-9
    replayed[3]["fingerprint"] = {**FINGERPRINT, "digest": "d2", "calibration": "none #c2"}
    live[4]["fingerprint"] = None                                                             # written before 47
    replayed.append(_record("s9", 9, [0.5, 0.5]))                                              # nothing live
    report = compare(replayed, {source_of(r): r for r in live}, "live-topic")
    assert (report.replayed, report.missing_live, report.compared, report.differing) == (7, 1, 4, 2)
    (group,) = report.schemas.values()
    assert (group.identical, group.differing, group.first_differing) == (2, 2, ["s1", "s2"])
    assert group.largest_difference == 1e-9 or math.isclose(group.largest_difference, 1e-9, rel_tol=1e-6)
    assert group.not_comparable == {
        "fingerprints differ in calibration: calibration 'none #c1' (live) vs 'none #c2' (replay)": 1,
        "no fingerprint in the live record": 1}
    lines = report.lines()
    assert lines[0] == "verify against live-topic: 7 states replayed, 6 with a live record (1 without, first: s9)"
    assert lines[1].startswith("  tickets v1: 4 compared, 2 bit-identical, 2 differ (largest difference 1e-09; first: s1, s2)")
    assert lines[-1] == "verify: 2 of 4 compared states differ"
    assert report.as_dict()["schemas"][0]["not_comparable"] == dict(group.not_comparable)


def test_every_part_that_differs_is_named():
    other = {**FINGERPRINT, "digest": "d2", "kernels": "cpu float32 torch fast #k2", "model": "m2"}
    assert incomparable(FINGERPRINT, other) == (
        "fingerprints differ in model, kernels: model 'm1' (live) vs 'm2' (replay), kernels "
        "'cpu float32 torch deterministic #k1' (live) vs 'cpu float32 torch fast #k2' (replay)")
    assert incomparable(FINGERPRINT, dict(FINGERPRINT)) is None
    assert incomparable(None, None) == "no fingerprint in the live and replayed record"


# ---- end to end ---------------------------------------------------------------------------------------------------
def _replay(stream: Stream, model_dir, name: str, output: str, *flags: str) -> subprocess.CompletedProcess:
    create_topics(stream.bootstrap, Topics(states=stream.topics.states, schemas=stream.topics.schemas,
                                           probabilities=output, dead_letter=f"{output}.dead-letter"), stream.partitions)
    args = [sys.executable, "-m", "worker", "replay", "-b", stream.bootstrap, "--model", str(model_dir), "--name", name,
            "--states-topic", stream.topics.states, "--schemas-topic", stream.topics.schemas, "--output-topic", output,
            "--deterministic", "--no-progress", "--max-batch", "16", *flags]
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_replay_verifies_bit_identical_then_not_comparable_after_a_temperature_change(stream, model_dir):
    n = 24
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"v-{i}", t) for i, t in enumerate(state_texts(n, seed=47))], "tickets")
    worker = stream.start_worker(model_dir, "live", "--deterministic")
    live, dead = stream.collect(n, timeout_s=120)
    assert worker.stop() == 0 and dead == [] and len(live) == n, worker.log()
    assert all(r["fingerprint"]["kernels"].startswith("cpu float32 torch deterministic #") for r in live)
    assert len({r["fingerprint"]["digest"] for r in live}) == 1

    same = _replay(stream, model_dir, "same", f"{stream.topics.probabilities}.same",
                   "--verify-against", stream.topics.probabilities)
    assert same.returncode == 0, same.stderr
    assert f"verify against {stream.topics.probabilities}: {n} states replayed, {n} with a live record" in same.stderr
    assert f"  tickets v1: {n} compared, {n} bit-identical, 0 differ\n" in same.stderr, same.stderr
    assert f"verify: all {n} compared states are bit-identical" in same.stderr

    # A new version of the schema with another temperature: the replay scores with it, the live records were not.
    warmer = copy.deepcopy(QUESTIONS)
    warmer["questions"][2]["temperature"] = 1.4
    stream.put_schema("tickets", warmer)
    changed = _replay(stream, model_dir, "warmer", f"{stream.topics.probabilities}.warmer",
                      "--verify-against", stream.topics.probabilities)
    assert changed.returncode == 0, changed.stderr
    line = next(x for x in changed.stderr.splitlines() if x.startswith("  tickets v1 (live) / v2 (replay)"))
    assert line.startswith(f"  tickets v1 (live) / v2 (replay): 0 compared, 0 bit-identical, 0 differ; {n} not "
                           f"comparable: {n} fingerprints differ in calibration: calibration 'none #"), line
    assert "verify: no state could be compared" in changed.stderr

    # One live record nudged by one ulp, in a topic of its own: the finished replay "same", rerun, scores nothing and
    # verifies against it, and finds exactly that state.
    tampered = f"{stream.topics.probabilities}.tampered"
    create_topics(stream.bootstrap, Topics(states=stream.topics.states, schemas=stream.topics.schemas,
                                           probabilities=tampered, dead_letter=f"{tampered}.dead-letter"), 2)
    producer = Producer({"bootstrap.servers": stream.bootstrap})
    for record in sorted(live, key=lambda r: r["state_id"]):
        plain = {k: v for k, v in record.items() if k not in ("kafka", "headers")}
        if plain["state_id"] == "v-5":
            p = plain["questions"][0]["probabilities"]
            p[0] = math.nextafter(p[0], 2.0)
        producer.produce(tampered, key=plain["state_id"].encode(), value=schemas.encode_probability(plain))
    assert producer.flush(10) == 0
    differs = _replay(stream, model_dir, "same", f"{stream.topics.probabilities}.same", "--verify-against", tampered)
    assert differs.returncode == 1, differs.stderr
    assert "complete; 0 states scored" in differs.stderr
    assert re.search(rf"  tickets v1: {n} compared, {n - 1} bit-identical, 1 differ \(largest difference [0-9.e-]+; "
                     r"first: v-5\)", differs.stderr), differs.stderr
    assert f"verify: 1 of {n} compared states differ" in differs.stderr
