"""The input mapping: users' JSON, registry Avro and text records become states, and every kind of bad
record the issue lists becomes a ``MappingFailure`` with the dead-letter reason and the path that failed."""

from __future__ import annotations

import json
import uuid

import pytest

import schemas
from worker.formats.records import Reason
from worker.exceptions import ConfigError
from worker.formats.input_decoder import InputMapper, MappingFailure, RegistryUnavailableError
from worker.formats.input_mapping import InputMapping, split_list
from worker.formats.registry import RegistryConfig, registry_client

TS = 1_700_000_000_000
TICKET = {"ticket": {"id": "T-1", "subject": "Late box", "body": "It arrived broken.", "priority": 2,
                     "created_at": "2026-01-02T03:04:05Z", "tags": ["a", "b"]},
          "customer": {"tier": "gold"}, "items": [{"name": "lamp"}]}


def json_mapper(**options) -> InputMapper:
    options.setdefault("schema_id", "support")
    return InputMapper(InputMapping(format="json", **options))


def bytes_of(document) -> bytes:
    return json.dumps(document).encode()


def failure(result) -> MappingFailure:
    assert isinstance(result, MappingFailure), f"expected a failure, got {result!r}"
    return result


# ---- good records ------------------------------------------------------------------------------------------------
def test_json_template_with_nested_paths_ids_time_and_metadata():
    mapper = json_mapper(id_field="ticket.id", text_template="Subject: {ticket.subject}\n\n{ticket.body} ({items.0.name}, p{ticket.priority})",
                         event_time_field="ticket.created_at", metadata_fields=("ticket.priority", "customer.tier", "ticket.tags"))
    state = mapper.map(b"key-ignored", bytes_of(TICKET), None, TS)
    assert state == {
        "state_id": "T-1", "schema_id": "support",
        "state": "Subject: Late box\n\nIt arrived broken. (lamp, p2)",
        "event_time": 1767323045000,
        "metadata": {"ticket.priority": "2", "customer.tier": "gold", "ticket.tags": '["a", "b"]'},
    }
    # The mapped state is exactly what the StateEvent Avro carries: it round-trips through the decider format.
    assert schemas.decode_state(schemas.encode_state(state)) == state


def test_defaults_key_as_id_record_timestamp_as_event_time_and_template_braces():
    mapper = json_mapper(text_template="{{literal}} {ticket.body}")
    state = mapper.map("ключ".encode(), bytes_of(TICKET), [], TS)
    assert (state["state_id"], state["state"], state["event_time"], state["metadata"]) == ("ключ", "{literal} It arrived broken.", TS, None)


def test_event_time_as_epoch_ms_and_naive_iso_is_utc():
    mapper = json_mapper(text_field="t", event_time_field="at")
    assert mapper.map(b"k", bytes_of({"t": "x", "at": 1234}), None, TS)["event_time"] == 1234
    assert mapper.map(b"k", bytes_of({"t": "x", "at": "1970-01-01T00:00:01"}), None, TS)["event_time"] == 1000
    assert failure(mapper.map(b"k", bytes_of({"t": "x", "at": "yesterday"}), None, TS)).reason is Reason.INVALID_FIELDS


def test_schema_id_precedence_field_then_header_then_fixed():
    header = [("decider-schema-id", b"from-header")]
    fixed = json_mapper(text_field="t")
    assert fixed.map(b"k", bytes_of({"t": "x"}), None, TS)["schema_id"] == "support"
    assert fixed.map(b"k", bytes_of({"t": "x"}), header, TS)["schema_id"] == "from-header"
    by_field = InputMapper(InputMapping(format="json", text_field="t", schema_id_field="s"))
    assert by_field.map(b"k", bytes_of({"t": "x", "s": "from-field"}), header, TS)["schema_id"] == "from-field"
    missing = failure(by_field.map(b"k", bytes_of({"t": "x"}), header, TS))
    assert missing.reason is Reason.INVALID_FIELDS and "'s'" in missing.message
    none = InputMapper(InputMapping(format="json", text_field="t"))
    assert "no schema id" in failure(none.map(b"k", bytes_of({"t": "x"}), None, TS)).message


def test_text_format_and_decider_format():
    text = InputMapper(InputMapping(format="text", schema_id="support"))
    assert text.map(b"s-1", "plain words".encode(), None, TS) == {
        "state_id": "s-1", "schema_id": "support", "state": "plain words", "event_time": TS, "metadata": None}
    assert failure(text.map(b"s-1", b"\xff\xfe", None, TS)).reason is Reason.UNDECODABLE
    decider = InputMapper(InputMapping())
    record = {"state_id": "a", "schema_id": "b", "state": "c", "event_time": None, "metadata": None}
    assert decider.map(b"a", schemas.encode_state(record), None, TS) == record
    assert failure(decider.map(b"a", b"garbage", None, TS)).reason is Reason.UNDECODABLE


def test_propagated_headers_are_the_named_ones_in_order():
    mapper = json_mapper(text_field="t")
    headers = [("x", b"1"), ("traceparent", b"00-abc-def-01"), ("tracestate", b"k=v"), ("traceparent", None)]
    assert mapper.propagated_headers(headers) == [("traceparent", b"00-abc-def-01"), ("tracestate", b"k=v")]
    assert mapper.propagated_headers(None) == []
    custom = InputMapper(InputMapping(format="json", schema_id="s", text_field="t", propagate_headers=("x",)))
    assert custom.propagated_headers(headers) == [("x", b"1")]


# ---- Debezium change events --------------------------------------------------------------------------------------
def change_event(op: str, after, wrapped: bool = False) -> bytes:
    event = {"before": None, "after": after, "op": op, "ts_ms": TS, "source": {"table": "tickets"}}
    return bytes_of({"schema": {"type": "struct"}, "payload": event} if wrapped else event)


@pytest.mark.parametrize("wrapped", [False, True])
def test_debezium_create_and_update_read_after_paths(wrapped):
    mapper = json_mapper(id_field="after.id", text_template="{after.subject}: {after.body}")
    for op in ("c", "u", "r"):
        state = mapper.map(None, change_event(op, {"id": 7, "subject": "Hi", "body": "broken"}, wrapped), None, TS)
        assert (state["state_id"], state["state"]) == ("7", "Hi: broken")


@pytest.mark.parametrize("wrapped", [False, True])
def test_debezium_delete_is_a_dead_letter_saying_so(wrapped):
    mapper = json_mapper(id_field="after.id", text_field="after.body")
    result = failure(mapper.map(b"7", change_event("d", None, wrapped), None, TS))
    assert result.reason is Reason.INVALID_FIELDS and "delete" in result.message and "'d'" in result.message


# ---- the bad inputs the issue lists ------------------------------------------------------------------------------
@pytest.mark.parametrize("value, reason, words", [
    (b"not json {", Reason.UNDECODABLE, "not JSON"),
    (b"\xff\xfe\x00", Reason.UNDECODABLE, "not UTF-8"),
    (b"[1, 2]", Reason.UNDECODABLE, "a list, not an object"),
    (b'"a string"', Reason.UNDECODABLE, "not an object"),
    (b"\x00\x00\x00\x00\x07\x02hi", Reason.UNDECODABLE, "schema id 7"),  # registry-framed record on a json topic
    (None, Reason.UNDECODABLE, "tombstone"),
])
def test_undecodable_values_on_a_json_topic(value, reason, words):
    result = failure(json_mapper(text_field="ticket.body").map(b"k", value, None, TS))
    assert result.reason is reason and words in result.message, result.message


@pytest.mark.parametrize("options, document, path, words", [
    ({"text_field": "ticket.missing"}, TICKET, "ticket.missing", "ticket has no 'missing'"),
    ({"text_field": "ticket.priority"}, TICKET, "ticket.priority", "a number (2), not text"),
    ({"text_field": "ticket.tags"}, TICKET, "ticket.tags", "a list, not text"),
    ({"text_field": "ticket.body.deeper"}, TICKET, "ticket.body.deeper", "ticket.body holds a str"),
    ({"text_field": "items.3.name"}, TICKET, "items.3.name", "items has no '3'"),
    ({"text_template": "{ticket.subject} / {ticket.nope}"}, TICKET, "ticket.nope", "has no 'nope'"),
    ({"text_template": "{customer}"}, TICKET, "customer", "an object"),
    ({"text_field": "ticket.body", "id_field": "ticket.tags"}, TICKET, "ticket.tags", "a state id must be"),
    ({"text_field": "ticket.body", "metadata_fields": ("customer.region",)}, TICKET, "customer.region", "no 'region'"),
    ({"text_field": "t"}, {"t": None}, "t", "null, not text"),
])
def test_unreadable_paths_name_the_path(options, document, path, words):
    result = failure(json_mapper(**options).map(b"k", bytes_of(document), None, TS))
    assert result.reason is Reason.INVALID_FIELDS
    assert f"path {path!r}" in result.message and words in result.message, result.message


def test_key_as_id_must_be_utf8_and_present():
    mapper = json_mapper(text_field="ticket.body")
    bad_key = failure(mapper.map(b"\xc3\x28", bytes_of(TICKET), None, TS))
    assert bad_key.reason is Reason.INVALID_FIELDS and "key" in bad_key.message and "not UTF-8" in bad_key.message
    no_key = failure(mapper.map(None, bytes_of(TICKET), None, TS))
    assert no_key.reason is Reason.INVALID_FIELDS and "no key" in no_key.message


def test_failure_keeps_the_ids_it_already_read():
    result = failure(json_mapper(id_field="ticket.id", text_field="ticket.nope").map(b"k", bytes_of(TICKET), None, TS))
    assert (result.state_id, result.schema_id) == ("T-1", "support")


# ---- avro-registry input -----------------------------------------------------------------------------------------
USER_SCHEMA = json.dumps({
    "type": "record", "name": "Ticket", "namespace": "com.example",
    "fields": [{"name": "id", "type": "string"}, {"name": "body", "type": "string"},
               {"name": "opened", "type": {"type": "long", "logicalType": "timestamp-millis"}},
               {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [{"name": "tier", "type": "string"}]}}],
})


MOCK = RegistryConfig("mock://shared-through-client")


@pytest.fixture
def mock_registry():
    return registry_client(f"mock://{uuid.uuid4().hex}")


def produce_avro(client, topic: str, record: dict) -> bytes:
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    return AvroSerializer(client, USER_SCHEMA)(record, SerializationContext(topic, MessageField.VALUE))


def test_avro_registry_records_from_confluent_serializer(mock_registry):
    value = produce_avro(mock_registry, "tickets", {"id": "A-1", "body": "refund please", "opened": 1000, "customer": {"tier": "gold"}})
    mapper = InputMapper(InputMapping(format="avro-registry", schema_id="support", id_field="id",
                                      text_template="[{customer.tier}] {body}", event_time_field="opened",
                                      metadata_fields=("customer.tier",)), MOCK, client=mock_registry)
    assert mapper.map(b"k", value, None, TS, topic="tickets") == {
        "state_id": "A-1", "schema_id": "support", "state": "[gold] refund please", "event_time": 1000,
        "metadata": {"customer.tier": "gold"}}


def test_avro_registry_bad_records(mock_registry):
    mapper = InputMapper(InputMapping(format="avro-registry", schema_id="support", text_field="body"), MOCK, client=mock_registry)
    unknown = failure(mapper.map(b"k", b"\x00\x00\x01\x86\xa0\x02hi", None, TS, topic="tickets"))
    assert unknown.reason is Reason.UNDECODABLE and "schema id 100000" in unknown.message
    not_framed = failure(mapper.map(b"k", b'{"body": "json"}', None, TS, topic="tickets"))
    assert not_framed.reason is Reason.UNDECODABLE and "not registry-framed" in not_framed.message
    good = produce_avro(mock_registry, "tickets", {"id": "A", "body": "b", "opened": 1, "customer": {"tier": "t"}})
    truncated = failure(mapper.map(b"k", good[:8], None, TS, topic="tickets"))
    assert truncated.reason is Reason.UNDECODABLE
    assert failure(mapper.map(b"k", None, None, TS)).reason is Reason.UNDECODABLE


def test_avro_registry_down_is_not_the_records_fault():
    down = RegistryConfig("http://127.0.0.1:9", {"max.retries": 0, "timeout": 2})
    mapper = InputMapper(InputMapping(format="avro-registry", schema_id="s", text_field="body"), down)
    with pytest.raises(RegistryUnavailableError):
        mapper.map(b"k", b"\x00\x00\x00\x00\x01\x02hi", None, TS, topic="tickets")


# ---- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, words", [
    ({"format": "xml"}, "--input-format must be one of"),
    ({"format": "json", "schema_id": "s"}, "needs --text-field PATH or --text-template"),
    ({"format": "json", "schema_id": "s", "text_field": "a", "text_template": "{a}"}, "not both"),
    ({"format": "json", "schema_id": "s", "text_template": "no fields here"}, "names no field"),
    ({"format": "json", "schema_id": "s", "text_template": "{a"}, "not a valid template"),
    ({"format": "json", "schema_id": "s", "text_template": "{}"}, "needs a dotted path"),
    ({"format": "json", "schema_id": "s", "text_template": "{a!r}"}, "conversion or format spec"),
    ({"format": "json", "schema_id": "s", "text_field": "a..b"}, "empty segment"),
    ({"format": "json", "schema_id": "s", "text_field": "a", "schema_id_field": "b"}, "not both"),
    ({"format": "json", "schema_id": "s", "text_field": "a", "metadata_fields": ("x.",)}, "empty segment"),
    ({"format": "decider", "text_field": "a"}, "--text-field apply to --input-format json"),
    ({"format": "text", "schema_id": "s", "text_field": "a"}, "need a structured value"),
    ({"format": "text", "schema_id": " "}, "--schema-id must not be empty"),
])
def test_unusable_mappings_fail_at_start_with_one_line(options, words):
    with pytest.raises(ConfigError) as caught:
        InputMapping(**options)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_avro_registry_needs_a_registry():
    with pytest.raises(ConfigError, match="needs --schema-registry-url"):
        InputMapper(InputMapping(format="avro-registry", schema_id="s", text_field="a"))


def test_from_config_table():
    mapping = InputMapping.from_table({"input-format": "json", "schema_id": "s", "text-template": "{a.b}",
                                       "metadata_fields": ["x", "y.z"], "propagate-headers": "traceparent, baggage"})
    assert mapping == InputMapping(format="json", schema_id="s", text_template="{a.b}", metadata_fields=("x", "y.z"),
                                   propagate_headers=("traceparent", "baggage"))
    with pytest.raises(ConfigError, match="unknown key 'text-feild'"):
        InputMapping.from_table({"input-format": "json", "text-feild": "a"})
    with pytest.raises(ConfigError, match="must be a string"):
        InputMapping.from_table({"id_field": 3})
    assert split_list(" a, ,b ", "--metadata-fields") == ("a", "b")


def test_avro_registry_input_through_the_registry_double_over_http():
    from tests.registry_double import RegistryDouble

    with RegistryDouble() as double:
        value = produce_avro(registry_client(double.url), "tickets", {"id": "B-2", "body": "where is it", "opened": 5, "customer": {"tier": "free"}})
        mapper = InputMapper(InputMapping(format="avro-registry", schema_id="support", id_field="id", text_field="body"),
                             RegistryConfig(double.url))
        state = mapper.map(None, value, None, TS, topic="tickets")
        assert (state["state_id"], state["state"], state["event_time"]) == ("B-2", "where is it", TS)
        unknown = failure(mapper.map(None, b"\x00\x00\x00\x00\x63" + value[5:], None, TS, topic="tickets"))
        assert unknown.reason is Reason.UNDECODABLE and "schema id 99" in unknown.message


def test_flag_templates_unescape_newlines_tabs_and_backslashes():
    from worker.formats.input_mapping import unescape_flag_template

    typed = r"Subject: {a}\n\n{b}\tend \\n stays"
    assert unescape_flag_template(typed) == "Subject: {a}\n\n{b}\tend \\n stays"
    assert unescape_flag_template("no escapes {x}") == "no escapes {x}"


def test_avro_registry_refusing_credentials_is_fatal_not_a_dead_letter():
    from tests.registry_double import RegistryDouble

    with RegistryDouble(users={"u": "right"}) as double:
        value = produce_avro(registry_client(double.url, {"basic.auth.user.info": "u:right"}), "tickets",
                             {"id": "C", "body": "b", "opened": 1, "customer": {"tier": "t"}})
        mapper = InputMapper(InputMapping(format="avro-registry", schema_id="s", text_field="body"),
                             RegistryConfig(double.url, {"basic.auth.user.info": "u:wrong-pw"}))
        with pytest.raises(ConfigError, match="refused decider's credentials") as caught:
            mapper.map(None, value, None, TS, topic="tickets")
        assert "wrong-pw" not in str(caught.value)
