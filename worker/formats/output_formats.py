"""How probability records and dead letters are written (``--output-format``) and read back (``decider tail``).

- ``avro`` (default): schemaless Avro of ``schemas/*.avsc`` (``schemas.encode_probability`` ...).
- ``avro-registry``: Confluent wire format (magic byte 0, 4-byte schema id, Avro) through confluent-kafka's
  own ``AvroSerializer``, subject ``<topic>-value``. The schemas are registered (or, with auto-register
  off, looked up) once in ``OutputEncoder.start``, before any record, so a registry that is down or
  refuses the schema stops the worker at start with one line; afterwards the client's cache answers.
- ``json``: one UTF-8 JSON object, the fields ``decider tail --json`` prints (a dead letter's original
  value as ``original_value_base64``, its key as text).

``OutputDecoder`` reads any of the three, telling them apart per record: ``{`` starts JSON (never a valid
first byte of either schemaless record), magic byte 0 with a schema id the registry holds for the expected
record is registry framing, anything else is schemaless Avro.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Callable

import schemas
from worker.exceptions import ConfigError, FatalError
from worker.formats.registry import RegistryConfig, framed_schema_id, transport_errors

OUTPUT_FORMATS = ("avro", "avro-registry", "json")
PROBABILITIES, DEAD_LETTER = "probabilities", "dead-letter"
# kind -> (avsc name, Avro record name, schemaless encoder, schemaless decoder)
_KINDS: dict[str, tuple[str, str, Callable, Callable]] = {
    PROBABILITIES: ("probability_record", "io.decider.ProbabilityRecord", schemas.encode_probability, schemas.decode_probability),
    DEAD_LETTER: ("dead_letter", "io.decider.DeadLetter", schemas.encode_dead_letter, schemas.decode_dead_letter),
}
# Subjects are <topic>-value, fixed: the client's default strategy would ask the registry per topic, per
# first record, for an "association", which would put a registry call on the record path.
TOPIC_SUBJECTS = {"subject.name.strategy.type": "TOPIC"}
EXIT_REGISTRY_UNREACHABLE = 4  # as for an unreachable broker: the service is down, not the configuration wrong


def check_output_format(output_format: str, registry: RegistryConfig | None) -> None:
    """``ConfigError`` if the format is unknown or needs a registry that is not configured."""
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}, not {output_format!r}")
    if output_format == "avro-registry" and registry is None:
        raise ConfigError("--output-format avro-registry needs --schema-registry-url")


def subject(topic: str) -> str:
    """The registry subject of a topic's values (confluent-kafka's default TopicNameStrategy)."""
    return f"{topic}-value"


class OutputEncoder:
    """Encodes the worker's output records; one per worker, ``start()`` before the first record."""

    def __init__(self, output_format: str, topics: dict[str, str], registry: RegistryConfig | None = None,
                 client: Any = None) -> None:
        """``topics``: ``{"probabilities": topic, "dead-letter": topic}``. ``client``: a registry client to use
        instead of ``registry.client()`` (tests share one ``mock://`` client between writer and reader)."""
        check_output_format(output_format, registry)
        self.output_format, self.topics, self.registry = output_format, dict(topics), registry
        if client is None and output_format == "avro-registry":
            client = registry.client()
        self._client = client
        self._serializers: dict[str, Any] = {}
        self._started = output_format != "avro-registry"

    def start(self) -> dict[str, int]:
        """Register (or look up) both schemas once; the registry schema id per kind ({} without a registry).

        Raises ``ConfigError`` (the registry refuses the schema or the credentials, or the subject lacks it
        with auto-register off) or ``FatalError`` exit 4 (the registry cannot be reached), one line each."""
        if self.output_format != "avro-registry":
            return {}
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.avro import AvroSerializer

        ids = {}
        for kind, (avsc, _, _, _) in _KINDS.items():
            schema = Schema(schemas.schema_text(avsc), "AVRO")
            ids[kind] = self._register(subject(self.topics[kind]), schema)
            # The serializer gets the same Schema object: its own registration then hits the client's cache.
            self._serializers[kind] = AvroSerializer(self._client, schema, conf={
                "auto.register.schemas": self.registry.auto_register, **TOPIC_SUBJECTS})
        self._started = True
        return ids

    def _register(self, subject_name: str, schema: Any) -> int:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            if self.registry.auto_register:
                return self._client.register_schema(subject_name, schema)
            return self._client.lookup_schema(subject_name, schema).schema_id
        except SchemaRegistryError as exc:
            raise ConfigError(self.registry.redact(_refusal(subject_name, exc, self.registry.auto_register))) from None
        except transport_errors() as exc:
            raise FatalError(self.registry.redact(f"Schema Registry at {self.registry.url} cannot be reached ({exc}); "
                                                  "start it or fix --schema-registry-url, or to try decider without a registry "
                                                  "use --output-format json (or avro)"), EXIT_REGISTRY_UNREACHABLE) from None

    def encode(self, kind: str, record: dict[str, Any]) -> bytes:
        """The value bytes of one output record of ``kind`` (``"probabilities"`` or ``"dead-letter"``)."""
        if not self._started:
            raise RuntimeError("OutputEncoder.start() must run before the first record")
        if self.output_format == "avro":
            return _KINDS[kind][2](record)
        if self.output_format == "json":
            return json.dumps(json_ready(kind, record), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        from confluent_kafka.serialization import MessageField, SerializationContext

        return self._serializers[kind](record, SerializationContext(self.topics[kind], MessageField.VALUE))

    def probability(self, record: dict[str, Any]) -> bytes:
        """A probability record's value bytes."""
        return self.encode(PROBABILITIES, record)

    def dead_letter(self, record: dict[str, Any]) -> bytes:
        """A dead letter's value bytes."""
        return self.encode(DEAD_LETTER, record)


def _refusal(subject_name: str, exc: Any, auto_register: bool) -> str:
    status = exc.http_status_code
    if status == 409:
        return (f"the Schema Registry refuses decider's schema under subject {subject_name}: it is not compatible with "
                f"the version registered there ({exc.error_message}); use another topic or set the subject's compatibility")
    if status in (401, 403):
        return f"the Schema Registry refused decider's credentials ({exc}); check [schema_registry] basic.auth.user.info"
    if status == 404 and not auto_register:
        return (f"subject {subject_name} does not hold decider's schema and auto-register is off; "
                f"register schemas/*.avsc there or drop --no-auto-register")
    return f"the Schema Registry failed for subject {subject_name}: {exc}"


def json_ready(kind: str, record: dict[str, Any]) -> dict[str, Any]:
    """A record as ``decider tail --json`` shows it (dead letters' bytes as text and base64)."""
    if kind != DEAD_LETTER:
        return dict(record)
    shown = {k: v for k, v in record.items() if k not in ("original_key", "original_value")}
    key, value = record.get("original_key"), record.get("original_value")
    shown["original_key"] = None if key is None else key.decode("utf-8", errors="replace")
    shown["original_value_base64"] = None if value is None else base64.b64encode(value).decode("ascii")
    return shown


class OutputDecoder:
    """Reads output records of one kind in any of the three formats (``decider tail``)."""

    def __init__(self, kind: str, registry_client: Any = None) -> None:
        """``registry_client``: needed only for registry-framed records (``worker.formats.registry.registry_client``)."""
        self.kind, self._client = kind, registry_client
        self._deserializer = None
        if registry_client is not None:
            from confluent_kafka.schema_registry.avro import AvroDeserializer

            self._deserializer = AvroDeserializer(registry_client, conf=TOPIC_SUBJECTS)

    def decode(self, value: bytes, topic: str = "") -> dict[str, Any]:
        """The record as ``schemas.decode_*`` returns it (times as epoch ms, dead letters' bytes as bytes);
        ``ValueError`` if it is none of the formats."""
        if value[:1] == b"{":
            return self._from_json(value)
        schema_id = framed_schema_id(value)
        if schema_id is not None and self._client is not None and self._registry_holds(schema_id):
            from confluent_kafka.serialization import MessageField, SerializationContext

            return schemas.plain_times(self._deserializer(value, SerializationContext(topic, MessageField.VALUE)))
        try:
            return _KINDS[self.kind][3](value)
        except ValueError:
            if schema_id is not None and self._client is None:
                raise ValueError(f"the record looks Schema Registry framed (schema id {schema_id}); "
                                 "pass --schema-registry-url to read it") from None
            raise

    def _registry_holds(self, schema_id: int) -> bool:
        """True if ``schema_id`` is a registry schema of this kind (so a schemaless record starting with a
        0 byte, e.g. a dead letter with reason ``undecodable``, is not mistaken for framing)."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            schema = self._client.get_schema(schema_id)
        except SchemaRegistryError:
            return False
        try:
            parsed = json.loads(schema.schema_str)
        except (TypeError, ValueError):
            return False
        name = parsed.get("name", "") if isinstance(parsed, dict) else ""
        full_name = name if "." in name else f"{parsed.get('namespace', '')}.{name}"
        return full_name == _KINDS[self.kind][1]

    def _from_json(self, value: bytes) -> dict[str, Any]:
        try:
            record = json.loads(value.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a JSON {self.kind} record: {exc}") from None
        if not isinstance(record, dict):
            raise ValueError(f"not a JSON {self.kind} record: {type(record).__name__}")
        if self.kind == DEAD_LETTER:
            key, value64 = record.get("original_key"), record.pop("original_value_base64", None)
            record["original_key"] = None if key is None else key.encode("utf-8")
            record["original_value"] = None if value64 is None else base64.b64decode(value64)
        return record
