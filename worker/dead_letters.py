"""Dead letters: input records the worker could not score, published in the same transaction as the
batch they arrived in, with a reason code a consumer can route on and a message a person can read."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import schemas
from worker.transactions import OutgoingRecord


class Reason(str, enum.Enum):
    """Why a state was not scored (the ``reason`` enum of ``dead_letter.avsc``)."""

    UNDECODABLE = "undecodable"  # the value is not a StateEvent in Avro (or is null)
    INVALID_FIELDS = "invalid_fields"  # decodes, but a required field is empty or malformed
    UNKNOWN_SCHEMA = "unknown_schema"  # no schema with that id appeared within --schema-wait-ms
    SCHEMA_UNPREPARABLE = "schema_unpreparable"  # the schema exists but the engine rejects it
    STATE_TOO_LARGE = "state_too_large"  # over --max-state-chars, or longer than the model's context
    SCORING_ERROR = "scoring_error"  # the engine failed on this state alone (or returned non-finite numbers)


assert {r.value for r in Reason} <= set(schemas.DEAD_LETTER_REASONS), "dead_letter.avsc lacks a reason code"


@dataclass(frozen=True)
class SourceRecord:
    """Where an input record came from, and its raw bytes (kept so a dead letter can carry them)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def dead_letter(
    source: SourceRecord,
    reason: Reason,
    message: str,
    topic: str,
    worker_id: str,
    state_id: str | None = None,
    schema_id: str | None = None,
) -> OutgoingRecord:
    """The dead-letter record for ``source``, keyed by the original key."""
    record = {
        "reason": reason.value,
        "message": message,
        "source_topic": source.topic,
        "source_partition": source.partition,
        "source_offset": source.offset,
        "original_key": source.key,
        "original_value": source.value,
        "state_id": state_id,
        "schema_id": schema_id,
        "failed_at": int(time.time() * 1000),
        "worker_id": worker_id,
    }
    return OutgoingRecord(topic=topic, key=source.key, value=schemas.encode_dead_letter(record))
