"""The record path's decode and output steps with users' formats, in one process on confluent-kafka's ``mock://``
registry (one client shared by writer and reader): ``SourceDecoder`` turns a consumed record into a state or an
``Unscorable`` carrying the ids it read; ``Outputs`` encodes in the chosen format and carries the trace headers;
a registry that does not answer is retried, then fatal (exit 4), never a dead letter."""

from __future__ import annotations

import json

import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.worker.conftest import encode_state
from worker.formats import input_decoder
from worker.stream.batcher import Pending
from worker.config import Topics
from worker.exceptions import FatalError
from worker.formats.input_decoder import SourceDecoder
from worker.formats.input_mapping import InputMapping
from worker.formats.output_formats import OutputEncoder
from worker.stream.outputs import Outputs
from worker.formats.records import Reason, SourceRecord, Unscorable
from worker.formats.registry import RegistryConfig, registry_client

TOPICS = Topics(states="user.events", probabilities="scores", dead_letter="dead")
EVENT = json.dumps({"type": "record", "name": "Event", "fields": [{"name": "id", "type": "string"}, {"name": "text", "type": "string"}]})
TRACE = [("traceparent", b"00-abc-def-01"), ("unrelated", b"x")]


@pytest.fixture
def client(mock_registry_url):
    return registry_client(mock_registry_url)


def source(value: bytes | None, key: bytes | None = b"k-1", headers=None, offset: int = 0) -> SourceRecord:
    return SourceRecord(TOPICS.states, 0, offset, key, value, headers, 1_772_356_320_000)


def test_avro_registry_records_decode_and_dead_letters_go_out_framed_with_their_headers(client, mock_registry_url):
    registry = RegistryConfig(mock_registry_url)
    serialize = AvroSerializer(client, Schema(EVENT, "AVRO"))
    value = serialize({"id": "e-7", "text": "the parcel never came"}, SerializationContext(TOPICS.states, MessageField.VALUE))
    mapping = InputMapping(format="avro-registry", id_field="id", text_field="text", schema_id="support")
    decoder = SourceDecoder(mapping, registry, max_state_chars=10, client=client)

    with pytest.raises(Unscorable) as too_long:  # mapped, then checked like any state: over --max-state-chars
        decoder.decode(source(value, headers=TRACE))
    assert too_long.value.reason is Reason.STATE_TOO_LARGE and too_long.value.state["state_id"] == "e-7"
    state = SourceDecoder(mapping, registry, max_state_chars=1000, client=client).decode(source(value))
    assert (state["state_id"], state["schema_id"], state["state"], state["event_time"]) == ("e-7", "support", "the parcel never came", 1_772_356_320_000)

    encoder = OutputEncoder("avro-registry", {"probabilities": TOPICS.probabilities, "dead-letter": TOPICS.dead_letter}, registry, client=client)
    encoder.start()
    outputs = Outputs(TOPICS, "w0", "model", encoder, decoder.propagated_headers)
    pending = Pending(source(value, headers=TRACE))
    pending.state = too_long.value.state
    outputs.reject(pending, too_long.value.reason, str(too_long.value))
    letter = pending.dead_letter
    assert letter.topic == TOPICS.dead_letter and letter.headers == [("traceparent", b"00-abc-def-01")]
    record = AvroDeserializer(client)(letter.value, SerializationContext(TOPICS.dead_letter, MessageField.VALUE))
    assert (record["reason"], record["state_id"], record["schema_id"], record["original_value"]) == ("state_too_large", "e-7", "support", value)


def test_the_decider_format_keeps_its_direct_path_and_headers_still_travel():
    decoder = SourceDecoder(InputMapping(), None, max_state_chars=100)
    state = decoder.decode(source(encode_state("s-1", "support", "late order"), headers=TRACE))
    assert (state["state_id"], state["state"]) == ("s-1", "late order")
    assert decoder.propagated_headers(source(b"", headers=TRACE)) == [("traceparent", b"00-abc-def-01")]
    assert decoder.propagated_headers(source(b"")) == []
    with pytest.raises(Unscorable) as failure:
        decoder.decode(source(b"\x07not avro"))
    assert failure.value.reason is Reason.UNDECODABLE


def test_mapping_failures_carry_the_ids_read_before_the_failing_path():
    decoder = SourceDecoder(InputMapping(format="json", text_field="a.body", schema_id="support"), None, 100)
    with pytest.raises(Unscorable) as failure:
        decoder.decode(source(b'{"a": {"title": "no body"}}', key=b"t-9"))
    assert failure.value.reason is Reason.INVALID_FIELDS and "a.body" in str(failure.value)
    assert failure.value.state == {"state_id": "t-9", "schema_id": "support"}


def test_a_registry_that_does_not_answer_is_retried_then_fatal_never_a_dead_letter(monkeypatch, client):
    monkeypatch.setattr(input_decoder, "REGISTRY_RETRY_S", 0.5)
    framed = AvroSerializer(client, Schema(EVENT, "AVRO"))({"id": "e", "text": "t"}, SerializationContext(TOPICS.states, MessageField.VALUE))
    down = RegistryConfig("http://127.0.0.1:9")  # nothing listens there
    decoder = SourceDecoder(InputMapping(format="avro-registry", text_field="text", schema_id="s"), down, 100)
    with pytest.raises(FatalError) as fatal:
        decoder.decode(source(framed))
    assert fatal.value.exit_code == 4 and "not dead-lettered" in str(fatal.value)
