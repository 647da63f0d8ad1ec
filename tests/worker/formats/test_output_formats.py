"""Output formats: every record round-trips through each format; registry framing is confluent-kafka's own
(a plain ``AvroDeserializer`` reads it); registration happens once, at start, and its failures are one
line there; ``OutputDecoder`` tells the three formats apart record by record."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

import schemas
from tests.registry_double import RegistryDouble
from worker.exceptions import ConfigError, FatalError
from worker.formats.output_formats import DEAD_LETTER, PROBABILITIES, OutputDecoder, OutputEncoder, check_output_format
from worker.formats.registry import RegistryConfig, registry_client

TOPICS = {PROBABILITIES: "out.probabilities", DEAD_LETTER: "out.dead-letter"}
PROBABILITY = {
    "state_id": "s-1", "schema_id": "support", "schema_version": 3, "model_id": "tiny",
    "questions": [{"id": "angry", "options": ["yes", "no"], "probabilities": [0.25, 0.75], "label_mass": 0.875,
                   "raw_probabilities": [0.5, 0.5]}],
    "source_topic": "in", "source_partition": 1, "source_offset": 42, "event_time": 1_700_000_000_000,
    "scored_at": 1_700_000_000_123, "truncated": False, "worker_id": "w-0", "metadata": {"channel": "email"},
    "fingerprint": {"digest": "76cbb0c84ea6fa6f", "model": "f57a0d98b94eb3e9", "decider": "0.1.0 #acdeb2f590716bb4",
                    "kernels": "cpu float32 torch deterministic #311dba5d5d696666", "prompt": "4e9143e6597bb456",
                    "calibration": "none #661e0e7c74423ec7"},
}
DEAD = {
    "reason": "undecodable", "message": "the value is not JSON", "source_topic": "in", "source_partition": 0,
    "source_offset": 7, "original_key": b"k-1", "original_value": b"\x00\xffnot json", "state_id": None,
    "schema_id": None, "failed_at": 1_700_000_000_456, "worker_id": "w-0",
}
RECORDS = {PROBABILITIES: PROBABILITY, DEAD_LETTER: DEAD}


@pytest.fixture
def mock_client():
    return registry_client(f"mock://{uuid.uuid4().hex}")


@pytest.fixture
def double():
    with RegistryDouble() as registry:
        yield registry


def started(output_format: str, client=None, registry: RegistryConfig | None = None) -> OutputEncoder:
    if output_format == "avro-registry" and registry is None:
        registry = RegistryConfig(url="mock://unused")
    encoder = OutputEncoder(output_format, TOPICS, registry, client=client)
    encoder.start()
    return encoder


@pytest.mark.parametrize("kind", [PROBABILITIES, DEAD_LETTER])
@pytest.mark.parametrize("output_format", ["avro", "json", "avro-registry"])
def test_every_format_round_trips_through_the_decoder(output_format, kind, mock_client):
    encoder = started(output_format, mock_client)
    value = encoder.encode(kind, RECORDS[kind])
    assert OutputDecoder(kind, mock_client).decode(value, TOPICS[kind]) == RECORDS[kind]


def test_avro_is_todays_schemaless_encoding_and_json_is_tails_shape():
    assert started("avro").probability(PROBABILITY) == schemas.encode_probability(PROBABILITY)
    assert started("avro").dead_letter(DEAD) == schemas.encode_dead_letter(DEAD)
    import json

    shown = json.loads(started("json").dead_letter(DEAD))
    assert shown["original_key"] == "k-1" and shown["original_value_base64"] == "AP9ub3QganNvbg=="
    assert "original_value" not in shown
    assert json.loads(started("json").probability(PROBABILITY)) == PROBABILITY


@pytest.mark.parametrize("kind", [PROBABILITIES, DEAD_LETTER])
def test_registry_output_is_read_by_a_plain_confluent_deserializer_over_http(kind, double):
    """The double, driven by the real client over HTTP: what any registry-speaking consumer does."""
    config = RegistryConfig(url=double.url)
    encoder = OutputEncoder("avro-registry", TOPICS, config)
    ids = encoder.start()
    value = encoder.encode(kind, RECORDS[kind])
    assert value[0] == 0 and int.from_bytes(value[1:5], "big") == ids[kind]
    reader = AvroDeserializer(registry_client(double.url))  # a fresh client: nothing cached
    decoded = reader(value, SerializationContext(TOPICS[kind], MessageField.VALUE))
    assert schemas.plain_times(decoded) == RECORDS[kind]
    assert double.state.subjects == {f"{TOPICS[PROBABILITIES]}-value": [ids[PROBABILITIES]],
                                     f"{TOPICS[DEAD_LETTER]}-value": [ids[DEAD_LETTER]]}


def test_registration_happens_at_start_not_per_record(double):
    encoder = OutputEncoder("avro-registry", TOPICS, RegistryConfig(url=double.url))
    encoder.start()
    at_start = list(double.requests)
    assert [method for method, _ in at_start] == ["POST", "POST"]
    for _ in range(20):
        encoder.probability(PROBABILITY)
        encoder.dead_letter(DEAD)
    assert double.requests == at_start, "records must be framed from the client's cache"


def test_records_before_start_are_refused(mock_client):
    with pytest.raises(RuntimeError, match="start"):
        OutputEncoder("avro-registry", TOPICS, RegistryConfig(url="mock://x"), client=mock_client).probability(PROBABILITY)


def test_incompatible_subject_fails_at_start_with_one_line(double):
    incompatible = '{"type": "record", "name": "ProbabilityRecord", "namespace": "io.decider", "fields": [{"name": "state_id", "type": "long"}]}'
    double.state.register(f"{TOPICS[PROBABILITIES]}-value", incompatible)
    with pytest.raises(ConfigError) as caught:
        OutputEncoder("avro-registry", TOPICS, RegistryConfig(url=double.url)).start()
    message = str(caught.value)
    assert "not compatible" in message and "out.probabilities-value" in message and "\n" not in message


def test_no_auto_register_needs_the_schema_there(double):
    config = RegistryConfig(url=double.url, auto_register=False)
    with pytest.raises(ConfigError, match="auto-register is off"):
        OutputEncoder("avro-registry", TOPICS, config).start()
    OutputEncoder("avro-registry", TOPICS, RegistryConfig(url=double.url)).start()  # someone registers them
    encoder = OutputEncoder("avro-registry", TOPICS, config)
    encoder.start()
    assert encoder.probability(PROBABILITY)[0] == 0


def test_registry_down_fails_at_start_with_exit_4():
    config = RegistryConfig(url="http://127.0.0.1:9", settings={"max.retries": 0})
    with pytest.raises(FatalError) as caught:
        OutputEncoder("avro-registry", TOPICS, config).start()
    assert caught.value.exit_code == 4 and "cannot be reached" in str(caught.value)
    assert "--schema-registry-url" in str(caught.value) and "--output-format json" in str(caught.value)  # try without one


def test_credentials_are_refused_at_start_and_never_shown():
    with RegistryDouble(users={"decider": "s3cret-pw"}) as double:
        url_with_password = double.url.replace("http://", "http://decider:url-pw@")
        wrong = RegistryConfig(url=double.url, settings={"basic.auth.user.info": "decider:wrong-pw"})
        with pytest.raises(ConfigError) as caught:
            OutputEncoder("avro-registry", TOPICS, wrong).start()
        assert "refused decider's credentials" in str(caught.value) and "wrong-pw" not in str(caught.value)
        right = RegistryConfig(url=double.url, settings={"basic.auth.user.info": "decider:s3cret-pw"})
        OutputEncoder("avro-registry", TOPICS, right).start()
        assert "url-pw" not in RegistryConfig(url=url_with_password).shown_url()


def test_unknown_client_settings_are_a_config_error_without_secrets():
    with pytest.raises(ConfigError) as caught:
        registry_client("http://registry:8081", {"basic.auth.user.info": "u:hunter2", "bogus.setting": "1"})
    assert "bogus.setting" in str(caught.value) and "hunter2" not in str(caught.value)


def test_format_checks():
    with pytest.raises(ConfigError, match="must be one of avro, avro-registry, json"):
        check_output_format("protobuf", None)
    with pytest.raises(ConfigError, match="needs --schema-registry-url"):
        check_output_format("avro-registry", None)


def test_decoder_without_registry_names_the_fix(mock_client):
    framed = started("avro-registry", mock_client).probability(PROBABILITY)
    with pytest.raises(ValueError, match="pass --schema-registry-url"):
        OutputDecoder(PROBABILITIES).decode(framed)
    with pytest.raises(ValueError):
        OutputDecoder(PROBABILITIES, mock_client).decode(b"\x05garbage")


def test_schemaless_dead_letter_starting_with_zero_is_not_taken_for_framing(mock_client):
    """Reason ``undecodable`` is enum index 0: its schemaless encoding starts with the magic byte."""
    started("avro-registry", mock_client)  # the registry holds ids 1 and 2
    for reason_first in (dict(DEAD, message="x" * 1), dict(DEAD, message="")):
        value = schemas.encode_dead_letter(reason_first)
        assert value[0] == 0
        assert OutputDecoder(DEAD_LETTER, mock_client).decode(value) == reason_first
