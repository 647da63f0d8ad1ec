"""Users' own events in, record by record: one consumed record (key, value, headers, timestamp) becomes the state
the worker scores, or a ``MappingFailure`` saying why it cannot, which the record path sends to the dead letters. How
is an ``InputMapping``'s (``worker.formats.input_mapping``: the formats, and where each field comes from).

Debezium change events (``before``/``after``/``op``, also wrapped in ``{"schema", "payload"}`` by the JSON
converter with schemas enabled) are unwrapped, so paths read ``after.body``. A delete (no ``after`` row)
is a dead letter ``invalid_fields`` saying so: it has no text to score, and a dead letter keeps it visible
instead of silently dropping a record. Every configured path must resolve; a record where one does not is
a dead letter ``invalid_fields`` naming the path. Bytes that are not the format at all are ``undecodable``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import schemas
from worker.exceptions import ConfigError, FatalError, RetriableError
from worker.formats import paths
from worker.formats.input_mapping import InputMapping
from worker.formats.records import Reason, SourceRecord, Unscorable, checked_state, decode_source
from worker.formats.registry import RegistryConfig, framed_schema_id, transport_errors

log = logging.getLogger(__name__)

SCHEMA_ID_HEADER = "decider-schema-id"

Headers = Sequence[tuple[str, bytes | None]] | None


@dataclass(frozen=True)
class MappingFailure:
    """Why one record cannot be scored: the dead letter's reason and message, plus the ids when known."""

    reason: Reason
    message: str
    state_id: str | None = None
    schema_id: str | None = None


class RegistryUnavailableError(RetriableError):
    """The Schema Registry did not answer (or answered 5xx) while decoding a record: not the record's fault."""


class _Failed(Exception):
    """Internal: carries a ``MappingFailure`` out of the nested helpers."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class InputMapper:
    """Applies an ``InputMapping`` to consumed records; built once per worker (holds the registry deserializer)."""

    def __init__(self, mapping: InputMapping, registry: RegistryConfig | None = None, client: Any = None) -> None:
        """``registry``: required for avro-registry input. ``client``: a registry client to use instead of
        ``registry.client()`` (tests share one ``mock://`` client between producer and mapper)."""
        self.mapping, self.registry = mapping, registry
        self._deserializer = None
        if mapping.format == "avro-registry":
            if registry is None:
                raise ConfigError("--input-format avro-registry needs --schema-registry-url")
            registry_client = client if client is not None else registry.client()
            from confluent_kafka.schema_registry.avro import AvroDeserializer

            # <topic>-value subjects without asking the registry for an "association" per topic.
            self._deserializer = AvroDeserializer(registry_client, conf={"subject.name.strategy.type": "TOPIC"})

    def map(self, key: bytes | None, value: bytes | None, headers: Headers, timestamp_ms: int | None,
            topic: str = "") -> dict[str, Any] | MappingFailure:
        """The state (``state_id``, ``schema_id``, ``state``, ``event_time``, ``metadata``, as
        ``schemas.decode_state`` returns it) or why not. Raises only for what is not the record's fault:
        ``RegistryUnavailableError`` (retry the record) and ``ConfigError`` (the registry refused the credentials)."""
        fmt = self.mapping.format
        if value is None:
            return MappingFailure(Reason.UNDECODABLE, "the value is null (a tombstone): there is no event to score")
        if fmt == "decider":
            try:
                return schemas.decode_state(value)
            except ValueError as exc:
                return MappingFailure(Reason.UNDECODABLE, str(exc))
        state_id = schema_id = None
        try:
            if fmt == "text":
                document, text = None, _utf8(value, "the value")
            else:
                document = self._document(value, headers, topic)
            state_id = self._state_id(document, key)
            schema_id = self._schema_id(document, headers)
            if fmt != "text":
                text = self._text(document)
            return {
                "state_id": state_id,
                "schema_id": schema_id,
                "state": text,
                "event_time": self._event_time(document, timestamp_ms),
                "metadata": self._metadata(document),
            }
        except _Failed as failure:
            return MappingFailure(failure.reason, str(failure), state_id, schema_id)
        except paths.PathError as exc:
            return MappingFailure(Reason.INVALID_FIELDS, str(exc), state_id, schema_id)

    def propagated_headers(self, headers: Headers) -> list[tuple[str, bytes]]:
        """The consumed record's headers that ``--propagate-headers`` names, in their order, for the output record."""
        wanted = set(self.mapping.propagate_headers)
        return [(name, value) for name, value in headers or () if name in wanted and value is not None]

    # ---- the value ---------------------------------------------------------------------------------------------
    def _document(self, value: bytes, headers: Headers, topic: str) -> Any:
        if self.mapping.format == "json":
            document = _json_object(value)
        else:
            document = self._registry_record(value, headers, topic)
        return _unwrap_change_event(document)

    def _registry_record(self, value: bytes, headers: Headers, topic: str) -> Any:
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        from confluent_kafka.serialization import MessageField, SerializationContext

        context = SerializationContext(topic, MessageField.VALUE, list(headers or ()))
        try:
            record = self._deserializer(value, context)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise _Failed(Reason.UNDECODABLE, f"the Schema Registry does not know this record's schema id {framed_schema_id(value)}: {exc.error_message}") from None
            if exc.http_status_code in (401, 403):
                raise ConfigError(self.registry.redact(f"the Schema Registry refused decider's credentials ({exc}); "
                                                       "check [schema_registry] basic.auth.user.info")) from None
            raise RegistryUnavailableError(self.registry.redact(f"Schema Registry error while decoding a record: {exc}")) from None
        except Exception as exc:  # noqa: BLE001 - the serde raises SerializationError, EOFError, ... on garbage
            if _is_connection_error(exc):
                raise RegistryUnavailableError(self.registry.redact(f"Schema Registry unreachable while decoding a record: {exc}")) from None
            raise _Failed(Reason.UNDECODABLE, f"not registry-framed Avro: {exc}") from None
        if not isinstance(record, dict):
            raise _Failed(Reason.UNDECODABLE, f"the registry schema of this record is not an Avro record (it decodes to {paths.describe(record)})")
        return record

    # ---- the fields --------------------------------------------------------------------------------------------
    def _state_id(self, document: Any, key: bytes | None) -> str:
        if self.mapping.id_field is not None:
            value = paths.resolve(document, self.mapping.id_field)
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise paths.PathError(self.mapping.id_field, f"holds {paths.describe(value)}; a state id must be a string or an integer")
            state_id = str(value)
        else:
            if key is None:
                raise _Failed(Reason.INVALID_FIELDS, "the record has no key and no --id-field is set, so it has no state id")
            state_id = _utf8(key, "the record key (the state id)", Reason.INVALID_FIELDS)
        if not state_id.strip():
            raise _Failed(Reason.INVALID_FIELDS, f"the state id ({self.mapping.id_field or 'the record key'}) is empty")
        return state_id

    def _schema_id(self, document: Any, headers: Headers) -> str:
        m = self.mapping
        if m.schema_id_field is not None:
            value = paths.resolve_text(document, m.schema_id_field)
        else:
            header = next((v for name, v in headers or () if name == SCHEMA_ID_HEADER and v is not None), None)
            if header is not None:
                value = _utf8(header, f"the {SCHEMA_ID_HEADER} header", Reason.INVALID_FIELDS)
            elif m.schema_id is not None:
                value = m.schema_id
            else:
                raise _Failed(Reason.INVALID_FIELDS, f"no schema id: set --schema-id or --schema-id-field, or send a {SCHEMA_ID_HEADER} header")
        if not value.strip():
            raise _Failed(Reason.INVALID_FIELDS, "the schema id is empty")
        return value

    def _text(self, document: Any) -> str:
        if self.mapping.text_field is not None:
            return paths.resolve_text(document, self.mapping.text_field)
        return paths.render(document, self.mapping.text_template)

    def _event_time(self, document: Any, timestamp_ms: int | None) -> int | None:
        path = self.mapping.event_time_field
        if path is None:
            return timestamp_ms if timestamp_ms is not None and timestamp_ms > 0 else None
        return epoch_ms(paths.resolve(document, path), path)

    def _metadata(self, document: Any) -> dict[str, str] | None:
        if not self.mapping.metadata_fields:
            return None
        return {path: _metadata_text(paths.resolve(document, path)) for path in self.mapping.metadata_fields}


REGISTRY_RETRY_S = 30.0
"""How long one record is retried while the Schema Registry does not answer, before the worker exits (code 4)."""


class SourceDecoder:
    """The record path's decode step: a consumed ``SourceRecord`` becomes the state to score, or ``Unscorable``
    (carrying the ids read so far) with the dead letter's reason. Built once per loop from ``--input-format``."""

    def __init__(self, mapping: InputMapping, registry: RegistryConfig | None, max_state_chars: int, client: Any = None) -> None:
        """``client``: a registry client to use instead of ``registry.client()`` (tests share a ``mock://`` one)."""
        self.mapper = InputMapper(mapping, registry, client)
        self._max_state_chars = max_state_chars
        # decider's own StateEvent keeps its direct path: no mapping step, no per-record option checks.
        self._direct = mapping.format == "decider"

    def decode(self, source: SourceRecord) -> dict[str, Any]:
        """The checked state in ``source``; ``Unscorable`` says why there is none. A Schema Registry that does not
        answer is retried for ``REGISTRY_RETRY_S``, then ``FatalError`` (exit 4): the record is never dead-lettered
        for it, and a restart reads it again from the committed offsets."""
        if self._direct:
            return decode_source(source, self._max_state_chars)
        mapped = self._map(source)
        if isinstance(mapped, MappingFailure):
            raise Unscorable(mapped.reason, mapped.message, {"state_id": mapped.state_id, "schema_id": mapped.schema_id})
        return checked_state(mapped, self._max_state_chars)

    def propagated_headers(self, source: SourceRecord) -> list[tuple[str, bytes]]:
        """The headers of ``source`` that ``--propagate-headers`` names, for its output record."""
        return self.mapper.propagated_headers(source.headers) if source.headers else []

    def _map(self, source: SourceRecord) -> dict[str, Any] | MappingFailure:
        deadline, delay = time.monotonic() + REGISTRY_RETRY_S, 0.2
        while True:
            try:
                return self.mapper.map(source.key, source.value, source.headers, source.timestamp_ms, source.topic)
            except RegistryUnavailableError as exc:
                if time.monotonic() + delay > deadline:
                    raise FatalError(f"{exc}; still failing after {REGISTRY_RETRY_S:.0f} s. Start the registry or fix "
                                     "--schema-registry-url; a restart scores the record then (it was not dead-lettered)",
                                     EXIT_REGISTRY_UNREACHABLE) from None
                log.warning("%s; retrying %s[%d]@%d in %.1f s", exc, source.topic, source.partition, source.offset, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)


EXIT_REGISTRY_UNREACHABLE = 4  # as for an unreachable broker


def epoch_ms(value: Any, path: str) -> int:
    """An event time as epoch milliseconds: a number of milliseconds, an ISO 8601 string or a datetime."""
    if isinstance(value, dt.datetime):
        return _datetime_ms(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"  # fromisoformat accepts Z only from Python 3.11
        try:
            return _datetime_ms(dt.datetime.fromisoformat(text))
        except ValueError:
            raise paths.PathError(path, f"holds {value!r}, neither epoch milliseconds nor an ISO 8601 time") from None
    raise paths.PathError(path, f"holds {paths.describe(value)}; an event time is epoch milliseconds or an ISO 8601 string")


def _datetime_ms(value: dt.datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return int(round(value.timestamp() * 1000))


def _metadata_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _utf8(raw: bytes, what: str, reason: Reason = Reason.UNDECODABLE) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Failed(reason, f"{what} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None


def _json_object(value: bytes) -> dict[str, Any]:
    schema_id = framed_schema_id(value)
    if schema_id is not None:
        raise _Failed(Reason.UNDECODABLE, f"the value is Schema Registry framed (magic byte 0, schema id {schema_id}), not JSON; "
                      "read this topic with --input-format avro-registry")
    text = _utf8(value, "the value")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Failed(Reason.UNDECODABLE, f"the value is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise _Failed(Reason.UNDECODABLE, f"the value is JSON but {paths.describe(document)}, not an object")
    return document


def _unwrap_change_event(document: dict[str, Any]) -> dict[str, Any]:
    """A Debezium change event without the JSON converter's ``schema``/``payload`` wrapper; deletes fail."""
    payload = document.get("payload")
    if set(document) == {"schema", "payload"} and isinstance(payload, dict) and "op" in payload:
        document = payload
    if "op" in document and ("after" in document or "before" in document) and document.get("after") is None:
        raise _Failed(Reason.INVALID_FIELDS, f"a change event with op {document.get('op')!r} and no 'after' row "
                      "(a delete): there is no row to score")
    return document


def _is_connection_error(exc: Exception) -> bool:
    # A transport error (refused, timeout, DNS) means the registry is down, not that the record is bad.
    return isinstance(exc, transport_errors())
