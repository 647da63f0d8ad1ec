"""decider's Avro record contracts: the four ``.avsc`` files of this package, parsed once.

Wire format
-----------
Every value on decider's topics is **schemaless Avro binary** (fastavro's ``schemaless_writer``):
the bare Avro encoding of one record, with no Object Container File header and no Confluent
Schema Registry prefix. Writer and reader both use the ``.avsc`` files shipped here, so a reader
needs this package (or a copy of the files) and nothing else; the schemas evolve only by adding
fields with defaults, which old readers skip when given the writer's schema. Keys are plain UTF-8
strings (state id or schema id), not Avro. A schema tombstone is a record with a null value.

Timestamps are ``timestamp-millis`` logical types on the wire; the helpers here hand back plain
``int`` epoch milliseconds so callers never meet fastavro's ``datetime`` conversion.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
from importlib.resources import files
from typing import Any

import fastavro

__all__ = [
    "STATE_EVENT",
    "QUESTION_SCHEMA",
    "PROBABILITY_RECORD",
    "DEAD_LETTER",
    "DEAD_LETTER_REASONS",
    "encode",
    "decode",
    "encode_state",
    "decode_state",
    "encode_question_schema",
    "decode_question_schema",
    "encode_probability",
    "decode_probability",
    "encode_dead_letter",
    "decode_dead_letter",
    "schema_text",
    "plain_times",
]


def schema_text(name: str) -> str:
    """The text of ``name``.avsc as shipped (what a Schema Registry is given)."""
    return files(__name__).joinpath(f"{name}.avsc").read_text(encoding="utf-8")


def _load(name: str) -> dict:
    """Parse ``name``.avsc from this package once; fastavro caches the named types it defines."""
    return fastavro.parse_schema(json.loads(schema_text(name)))


STATE_EVENT = _load("state_event")
QUESTION_SCHEMA = _load("question_schema")
PROBABILITY_RECORD = _load("probability_record")
DEAD_LETTER = _load("dead_letter")

DEAD_LETTER_REASONS: tuple[str, ...] = tuple(
    next(f for f in DEAD_LETTER["fields"] if f["name"] == "reason")["type"]["symbols"]
)


def encode(schema: dict, record: dict[str, Any]) -> bytes:
    """Encode ``record`` as schemaless Avro binary with the parsed ``schema``."""
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, schema, record)
    return buffer.getvalue()


def decode(schema: dict, payload: bytes) -> dict[str, Any]:
    """Decode schemaless Avro ``payload`` written with ``schema``.

    Raises ``ValueError`` if the bytes are not a valid encoding (truncated, trailing bytes, bad UTF-8),
    so callers catch one type for every kind of garbage.
    """
    buffer = io.BytesIO(payload)
    try:
        record = fastavro.schemaless_reader(buffer, schema, None)
    except Exception as exc:  # fastavro raises EOFError, UnicodeDecodeError, IndexError, ... on garbage
        raise ValueError(f"not a valid {schema.get('name', 'Avro')} encoding: {exc!r}") from exc
    if buffer.tell() != len(payload):
        # A shorter record that happens to parse is still garbage: the whole value must be one record.
        raise ValueError(
            f"not a valid {schema.get('name', 'Avro')} encoding: {len(payload) - buffer.tell()} trailing bytes"
        )
    return plain_times(record)


def plain_times(value: Any) -> Any:
    """Replace fastavro's ``datetime`` (timestamp-millis) by epoch milliseconds, recursively."""
    if isinstance(value, _dt.datetime):
        return int(round(value.timestamp() * 1000))
    if isinstance(value, dict):
        return {k: plain_times(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_times(v) for v in value]
    return value


def encode_state(record: dict[str, Any]) -> bytes:
    """Encode a state event (``state_id``, ``schema_id``, ``state``, optional ``event_time``, ``metadata``)."""
    return encode(STATE_EVENT, record)


def decode_state(payload: bytes) -> dict[str, Any]:
    """Decode a state event; ``ValueError`` on garbage."""
    return decode(STATE_EVENT, payload)


def encode_question_schema(record: dict[str, Any]) -> bytes:
    """Encode one version of a question schema."""
    return encode(QUESTION_SCHEMA, record)


def decode_question_schema(payload: bytes) -> dict[str, Any]:
    """Decode one version of a question schema; ``ValueError`` on garbage."""
    return decode(QUESTION_SCHEMA, payload)


def encode_probability(record: dict[str, Any]) -> bytes:
    """Encode a probability record."""
    return encode(PROBABILITY_RECORD, record)


def decode_probability(payload: bytes) -> dict[str, Any]:
    """Decode a probability record; ``ValueError`` on garbage."""
    return decode(PROBABILITY_RECORD, payload)


def encode_dead_letter(record: dict[str, Any]) -> bytes:
    """Encode a dead letter."""
    return encode(DEAD_LETTER, record)


def decode_dead_letter(payload: bytes) -> dict[str, Any]:
    """Decode a dead letter; ``ValueError`` on garbage."""
    return decode(DEAD_LETTER, payload)
