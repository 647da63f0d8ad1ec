"""The registry test double answers confluent-kafka's real ``SchemaRegistryClient`` (and its Avro serde) the
way Confluent's registry does, for every call decider makes."""

from __future__ import annotations

import json

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.registry_double import RegistryDouble

V1 = {"type": "record", "name": "Ticket", "namespace": "com.example",
      "fields": [{"name": "id", "type": "string"}, {"name": "body", "type": "string"}]}
V2_WITH_DEFAULT = {**V1, "fields": V1["fields"] + [{"name": "tier", "type": "string", "default": "free"}]}
V2_NO_DEFAULT = {**V1, "fields": V1["fields"] + [{"name": "tier", "type": "string"}]}


def avro(document: dict) -> Schema:
    return Schema(json.dumps(document), "AVRO")


@pytest.fixture
def registry():
    with RegistryDouble() as double:
        yield double


@pytest.fixture
def client(registry):
    return SchemaRegistryClient({"url": registry.url})


def test_register_lookup_get_by_id_versions_and_latest(client):
    first = client.register_schema("tickets-value", avro(V1))
    assert client.register_schema("tickets-value", avro(V1)) == first  # idempotent
    second = client.register_schema("tickets-value", avro(V2_WITH_DEFAULT))
    assert second != first
    assert json.loads(client.get_schema(first).schema_str) == V1
    found = client.lookup_schema("tickets-value", avro(V1))
    assert (found.schema_id, found.version) == (first, 1)
    latest = client.get_latest_version("tickets-value")
    assert (latest.schema_id, latest.version, latest.subject) == (second, 2, "tickets-value")
    assert client.get_version("tickets-value", 1).schema_id == first
    assert client.get_versions("tickets-value") == [1, 2]
    assert client.get_subjects() == ["tickets-value"]
    # The same schema under another subject keeps its global id, as in the registry.
    assert SchemaRegistryClient({"url": client._rest_client.base_urls[0]}).register_schema("other-value", avro(V1)) == first


def test_error_codes_match_the_registry(client):
    with pytest.raises(SchemaRegistryError) as unknown_id:
        client.get_schema(999)
    assert (unknown_id.value.http_status_code, unknown_id.value.error_code) == (404, 40403)
    with pytest.raises(SchemaRegistryError) as unknown_subject:
        client.lookup_schema("nope-value", avro(V1))
    assert unknown_subject.value.error_code == 40401
    client.register_schema("tickets-value", avro(V1))
    with pytest.raises(SchemaRegistryError) as not_there:
        client.lookup_schema("tickets-value", avro(V2_WITH_DEFAULT))
    assert not_there.value.error_code == 40403
    with pytest.raises(SchemaRegistryError) as invalid:
        client.register_schema("bad-value", Schema('{"type": "record", "name": "X"}', "AVRO"))
    assert invalid.value.http_status_code == 422


def test_backward_compatibility_is_enforced_and_testable(client):
    client.register_schema("tickets-value", avro(V1))
    assert client.test_compatibility("tickets-value", avro(V2_WITH_DEFAULT)) is True
    assert client.test_compatibility("tickets-value", avro(V2_NO_DEFAULT)) is False
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema("tickets-value", avro(V2_NO_DEFAULT))
    assert refused.value.http_status_code == 409 and "tier" in refused.value.error_message
    client.set_compatibility("tickets-value", "NONE")
    assert client.get_compatibility("tickets-value") == "NONE"
    client.register_schema("tickets-value", avro(V2_NO_DEFAULT))


def test_avro_serde_round_trip_over_http(registry):
    writer_client, reader_client = SchemaRegistryClient({"url": registry.url}), SchemaRegistryClient({"url": registry.url})
    context = SerializationContext("tickets", MessageField.VALUE)
    value = AvroSerializer(writer_client, json.dumps(V1))({"id": "t-1", "body": "hello"}, context)
    assert value[0] == 0
    assert AvroDeserializer(reader_client)(value, context) == {"id": "t-1", "body": "hello"}
    assert ("POST", "subjects/tickets-value/versions") in registry.requests


def test_basic_auth():
    with RegistryDouble(users={"u": "p"}) as double:
        with pytest.raises(SchemaRegistryError) as refused:
            SchemaRegistryClient({"url": double.url}).get_subjects()
        assert refused.value.http_status_code == 401
        for wrong in ("u:wrong", "u:", "u:p2", "someone:p", "U:p"):  # a wrong password, or a user it does not know
            with pytest.raises(SchemaRegistryError) as refused:
                SchemaRegistryClient({"url": double.url, "basic.auth.user.info": wrong}).get_subjects()
            assert refused.value.http_status_code == 401, wrong
        assert SchemaRegistryClient({"url": double.url, "basic.auth.user.info": "u:p"}).get_subjects() == []
