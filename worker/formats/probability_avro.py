"""Probability records straight to schemaless Avro (``--output-format avro``): the bytes fastavro writes for
``records.probability_record``'s dict, without the dict.

Most of a record is the same for every state of a schema version: its ids, each question's id and options, the model,
the worker, the scoring fingerprint. ``ProbabilityWriter`` encodes those once per schema version and, per state, only
what changes (the state id, the probabilities, the source offsets, the times), so a state costs a few byte strings
instead of a nested dict of ~60 objects and fastavro's walk over it (issue 46: 120 against ~15 us a state on this
project's CPU machine). It follows ``schemas/probability_record.avsc`` field by field: ``LAYOUT`` names the fields in
the order it writes them, and ``matches_schema`` checks that order against the parsed schema (the caller falls back to
fastavro where it does not match; ``tests/worker/formats/test_probability_avro.py`` checks the bytes against fastavro's).
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import schemas

LAYOUT = {
    "ProbabilityRecord": ["state_id", "schema_id", "schema_version", "model_id", "questions", "source_topic",
                          "source_partition", "source_offset", "event_time", "scored_at", "truncated", "worker_id",
                          "metadata", "fingerprint"],
    "QuestionProbabilities": ["id", "options", "probabilities", "label_mass", "raw_probabilities"],
    "ScoringFingerprint": ["digest", "model", "decider", "kernels", "prompt", "calibration"],
}

_NULL, _SECOND = b"\x00", b"\x02"   # a union's branch 0 (null) and 1, zigzag-encoded
_DOUBLE = struct.Struct("<d")


def matches_schema(parsed: dict = schemas.PROBABILITY_RECORD) -> bool:
    """Whether the parsed ProbabilityRecord schema has exactly ``LAYOUT``'s fields, in its order."""
    found: dict[str, list[str]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "record":
                found[node["name"].rsplit(".", 1)[-1]] = [f["name"] for f in node["fields"]]
            for key, value in node.items():
                if not key.startswith("__"):      # fastavro's own keys (its named types, as they were parsed)
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(parsed)
    return all(found.get(name) == fields for name, fields in LAYOUT.items())


def long_bytes(n: int) -> bytes:
    """Avro's long: zigzag, then a little-endian base-128 varint."""
    n = (n << 1) ^ (n >> 63)
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes([n]) for n in range(0x80)]


def string_bytes(text: str) -> bytes:
    """Avro's string: its UTF-8 length, then the bytes."""
    data = text.encode("utf-8")
    return long_bytes(len(data)) + data


def _doubles(values: Sequence[float]) -> bytes:
    """An array of doubles: one block and the end marker (just the end marker when empty, as fastavro writes it)."""
    if not values:
        return _NULL
    return long_bytes(len(values)) + struct.pack(f"<{len(values)}d", *values) + _NULL


class ProbabilityWriter:
    """The probability records of one schema version, scored by one model in one worker, as schemaless Avro."""

    def __init__(self, schema_record: dict[str, Any], model_id: str, worker_id: str | None,
                 fingerprint: dict[str, str] | None) -> None:
        questions = schema_record["questions"]
        self._head = (string_bytes(schema_record["schema_id"]) + long_bytes(schema_record["version"])
                      + string_bytes(model_id) + long_bytes(len(questions)))
        # per question: its id and its options (an array of strings, never empty: a question has 2 to 26)
        self._questions = [string_bytes(q["id"]) + long_bytes(len(q["options"]))
                           + b"".join(string_bytes(o) for o in q["options"]) + _NULL for q in questions]
        # the usual question, with its label mass and no raw probabilities, as one pack: its constant part, the
        # probabilities' array (count, doubles, end), the mass's union branch and double, the raw ones' null branch
        self._with_mass = [(constant + long_bytes(len(q["options"])),
                            struct.Struct(f"<{len(constant) + len(long_bytes(len(q['options'])))}s{len(q['options'])}dBBdB"))
                           for constant, q in zip(self._questions, questions)]
        self._tail = ((_NULL if worker_id is None else _SECOND + string_bytes(worker_id)),
                      _NULL if fingerprint is None else
                      _SECOND + b"".join(string_bytes(fingerprint[f]) for f in LAYOUT["ScoringFingerprint"]))
        self._topics: dict[str, bytes] = {}

    def write(self, state: dict[str, Any], probabilities: Sequence[Sequence[float]], topic: str, partition: int,
              offset: int, scored_at: int, truncated: bool = False, label_mass: Sequence[float] | None = None,
              raw_probabilities: Sequence[Sequence[float] | None] | None = None) -> bytes:
        """The record of one scored state (``records.probability_record``'s arguments, its source's position)."""
        parts = [string_bytes(state["state_id"]), self._head]
        if label_mass and not raw_probabilities:         # (every row's length was checked: probabilities_problem)
            for (constant, packer), probs, mass in zip(self._with_mass, probabilities, label_mass):
                parts.append(packer.pack(constant, *probs, 0, 2, mass, 0))
        else:
            masses = label_mass or (None,) * len(self._questions)
            raws = raw_probabilities or (None,) * len(self._questions)
            for constant, probs, mass, raw in zip(self._questions, probabilities, masses, raws):
                parts.append(constant)
                parts.append(_doubles(probs))
                parts.append(_NULL if mass is None else _SECOND + _DOUBLE.pack(mass))
                parts.append(_NULL if raw is None else _SECOND + _doubles(raw))
        parts.append(_NULL)                                   # the end of the questions' array
        topic_bytes = self._topics.get(topic)
        if topic_bytes is None:
            topic_bytes = self._topics[topic] = string_bytes(topic)
        event_time, metadata = state.get("event_time"), state.get("metadata")
        parts += [topic_bytes, long_bytes(partition), long_bytes(offset),
                  _NULL if event_time is None else _SECOND + long_bytes(event_time), long_bytes(scored_at),
                  b"\x01" if truncated else _NULL, self._tail[0], _NULL if metadata is None else _SECOND + _map(metadata),
                  self._tail[1]]
        return b"".join(parts)


def _map(values: dict[str, str]) -> bytes:
    """Avro's map of strings: one block and the end marker (just the end marker when empty)."""
    if not values:
        return _NULL
    return (long_bytes(len(values)) + b"".join(string_bytes(k) + string_bytes(v) for k, v in values.items()) + _NULL)
