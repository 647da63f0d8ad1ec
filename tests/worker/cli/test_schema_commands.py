"""``decider produce`` and ``decider schema delete`` refuse a schema id the schemas topic does not hold (a typo used to
publish 20 states that the worker dead-lettered as unknown_schema 10 s later, and to print "deleted"), and ``decider
schema list`` / ``schema get`` show what it holds: as a user runs them, exit codes and the lines they print."""

from __future__ import annotations

import json

from confluent_kafka import TopicPartition

from tests.worker.cli.test_cli import decider
from tests.worker.conftest import REPO, SCHEMA_FILE
from worker.kafka_clients import reader_consumer

STATES_FILE = REPO / "worker" / "examples" / "support_states.jsonl"


def _env(stream) -> dict[str, str]:
    return {"DECIDER_BOOTSTRAP": stream.bootstrap, "DECIDER_STATES_TOPIC": stream.topics.states,
            "DECIDER_SCHEMAS_TOPIC": stream.topics.schemas}


def _states_published(stream) -> int:
    consumer = reader_consumer(stream.bootstrap)
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(stream.topics.states, p), timeout=10)[1]
                   for p in range(stream.partitions))
    finally:
        consumer.close()


def _one_error_line(result, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_produce_refuses_a_schema_id_the_topic_does_not_hold_unless_forced(stream):
    env = _env(stream)
    assert decider("schema", "put", "--id", "support", str(SCHEMA_FILE), env=env).returncode == 0
    typo = decider("produce", "--schema-id", "suport", str(STATES_FILE), env=env)
    _one_error_line(typo, f"schema 'suport' is not in {stream.topics.schemas}", "did you mean 'support'?", "--force")
    unlike = decider("produce", "--schema-id", "zzz", str(STATES_FILE), env=env)
    _one_error_line(unlike, "(it holds 'support')")
    assert _states_published(stream) == 0
    forced = decider("produce", "--schema-id", "suport", "--force", str(STATES_FILE), env=env)
    assert forced.returncode == 0 and forced.stdout == f"20 states published to {stream.topics.states}\n", forced.stderr
    assert decider("schema", "delete", "--id", "support", env=env).returncode == 0
    _one_error_line(decider("produce", "--schema-id", "support", str(STATES_FILE), env=env),
                    f"schema 'support' was deleted from {stream.topics.schemas}")
    assert _states_published(stream) == 20


def test_schema_delete_refuses_an_id_the_topic_does_not_hold(stream):
    env = _env(stream)
    _one_error_line(decider("schema", "delete", "--id", "nosuch", env=env), "it holds no schema", "nothing deleted")
    assert decider("schema", "put", "--id", "support", str(SCHEMA_FILE), env=env).returncode == 0
    _one_error_line(decider("schema", "delete", "--id", "suport", env=env), "did you mean 'support'?", "nothing deleted")
    deleted = decider("schema", "delete", "--id", "support", env=env)
    assert deleted.returncode == 0 and deleted.stdout == "schema support deleted (its latest version was 1)\n"
    _one_error_line(decider("schema", "delete", "--id", "support", env=env), "was deleted", "nothing deleted")


def test_schema_list_and_get(stream, tmp_path):
    env = _env(stream)
    empty = decider("schema", "list", env=env)
    assert empty.returncode == 0 and empty.stdout == "" and "no schema in" in empty.stderr
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"mode": "independent", "questions": [{"id": "q", "question": "Fine?", "options": ["yes", "no"]}]}))
    for schema_id, path in (("support", SCHEMA_FILE), ("one", one), ("gone", one)):
        assert decider("schema", "put", "--id", schema_id, str(path), env=env).returncode == 0
    assert decider("schema", "put", "--id", "support", str(one), env=env).returncode == 0  # version 2
    assert decider("schema", "delete", "--id", "gone", env=env).returncode == 0
    listed = decider("schema", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == ["one      version 1  1 question  independent",
                                          "support  version 2  1 question  independent"]
    assert listed.stderr == "deleted: gone\n"
    shown = decider("schema", "get", "--id", "one", env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout) == json.loads(one.read_text()), shown.stderr
    # what get prints, put takes back: the same content, nothing published
    (tmp_path / "got.json").write_text(shown.stdout)
    again = decider("schema", "put", "--id", "one", str(tmp_path / "got.json"), env=env)
    assert again.stdout.startswith("schema one unchanged, version 1"), again.stdout + again.stderr
    _one_error_line(decider("schema", "get", "--id", "oen", env=env), "did you mean 'one'?")
