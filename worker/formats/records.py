"""Records in every form decider handles, and the conversions between them.

The stream's path, in the order a state takes it: a consumed ``SourceRecord`` is decoded into a StateEvent
(``decode_source``; ``Unscorable`` with a ``Reason`` when it cannot be scored), and leaves as an
``OutgoingRecord`` for the transaction: its ProbabilityRecord (``probability_record``) or a dead letter
(``dead_letter``). A user's schema file (read by ``worker.cli.user_files``) becomes its QuestionSchema record here; the
engine takes a list of ``{"question", "options"}`` dicts (``engine_questions``).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import schemas
from worker.ops.wording import counted

MAX_OPTIONS = 26  # engine.MAX_OPTIONS (labels A..Z); repeated here so the CLI can validate files without importing torch
MAX_QUESTIONS = 64  # engine.prompt.MAX_QUESTIONS, likewise
CALIBRATIONS = ("none", "contextual")  # engine.calibration.CALIBRATIONS, and the Calibration enum of the schema record

SchemaKey = tuple[str, int]
"""(schema id, version): names one question set for good (versions are never reused)."""


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
    headers: list[tuple[str, bytes | None]] | None = None  # as the consumer returns them (None: no headers)
    timestamp_ms: int | None = None  # the record's Kafka timestamp (None or <= 0: not available)


Headers = list[tuple[str, bytes]]


@dataclass(frozen=True)
class OutgoingRecord:
    """One record to publish inside the transaction: a probability record or a dead letter."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Headers | None = None  # headers carried over from the input record (--propagate-headers)


class Unscorable(Exception):
    """A consumed record that cannot be scored: it goes to the dead letters with ``reason`` and this message.
    ``state`` is the decoded StateEvent when the bytes decoded (its ids then go into the dead letter)."""

    def __init__(self, reason: Reason, message: str, state: dict[str, Any] | None = None) -> None:
        """``state``: what was read of the record before it failed (``state_id``/``schema_id``), for the dead letter."""
        super().__init__(message)
        self.reason, self.state = reason, state


def decode_source(source: SourceRecord, max_state_chars: int) -> dict[str, Any]:
    """The StateEvent in ``source``, checked for scoring; ``Unscorable`` says why not."""
    if source.value is None:
        raise Unscorable(Reason.UNDECODABLE, "the record has no value (null)")
    try:
        state = schemas.decode_state(source.value)
    except ValueError as exc:
        raise Unscorable(Reason.UNDECODABLE, str(exc)) from None
    return checked_state(state, max_state_chars)


def checked_state(state: dict[str, Any], max_state_chars: int) -> dict[str, Any]:
    """``state`` if it can be scored; ``Unscorable`` (carrying the state's ids) says why not."""
    problem = state_problem(state)
    if problem:
        raise Unscorable(Reason.INVALID_FIELDS, problem, state)
    if len(state["state"]) > max_state_chars:
        raise Unscorable(Reason.STATE_TOO_LARGE,
                         f"state has {len(state['state'])} characters; the limit is {max_state_chars} (--max-state-chars)", state)
    return state


def state_key(state_id: str) -> bytes:
    """The Kafka key of every output record of a state: its state id, UTF-8 (so a consumer joins or compacts by it,
    whatever the input's key was: a mapped topic's key may be null or another id)."""
    return state_id.encode("utf-8", errors="surrogatepass")


def dead_letter(source: SourceRecord, reason: Reason, message: str, topic: str, worker_id: str,
                state: dict[str, Any] | None = None, encode: Callable[[dict[str, Any]], bytes] = schemas.encode_dead_letter,
                headers: Headers | None = None) -> OutgoingRecord:
    """The dead-letter record for ``source`` (with the ids of its decoded ``state``, if any), keyed by the state id when
    the record was read that far, else by the original key; its value made by ``encode`` (``--output-format``)."""
    state = state or {}
    record = {
        "reason": reason.value,
        "message": message,
        "source_topic": source.topic,
        "source_partition": source.partition,
        "source_offset": source.offset,
        "original_key": source.key,
        "original_value": source.value,
        "state_id": state.get("state_id") or None,  # an empty id is no id
        "schema_id": state.get("schema_id") or None,
        "failed_at": int(time.time() * 1000),
        "worker_id": worker_id,
    }
    key = state_key(record["state_id"]) if record["state_id"] else source.key
    return OutgoingRecord(topic=topic, key=key, value=encode(record), headers=headers)


def schema_problem(document: Any) -> str | None:
    """Why ``document`` (a schema file, or a decoded QuestionSchema record) is unusable, or None."""
    if not isinstance(document, dict):
        return "must be a JSON object with a 'questions' list"
    if document.get("mode", "packed") not in ("packed", "independent"):
        return f"mode must be 'packed' or 'independent', not {document.get('mode')!r}"
    if document.get("calibration", "none") not in CALIBRATIONS:
        return f"calibration must be 'none' or 'contextual', not {document.get('calibration')!r}"
    if document.get("label_mass") is not None and not isinstance(document.get("label_mass"), bool):
        return f"label_mass must be true or false, not {document.get('label_mass')!r}"
    questions = document.get("questions")
    if not isinstance(questions, list) or not questions:
        return "'questions' must be a non-empty list"
    if len(questions) > MAX_QUESTIONS:
        return f"the schema has {len(questions)} questions; at most {MAX_QUESTIONS} are allowed (split them into several schemas)"
    seen: set[str] = set()
    for index, question in enumerate(questions):
        where = f"question {index}"
        if not isinstance(question, dict):
            return f"{where} must be an object"
        qid = question.get("id")
        if not isinstance(qid, str) or not qid:
            return f"{where} needs a non-empty string 'id'"
        if qid in seen:
            return f"question id {qid!r} is used twice"
        seen.add(qid)
        if not isinstance(question.get("question"), str) or not question["question"].strip():
            return f"question {qid!r} needs a non-empty 'question' text"
        options = question.get("options")
        if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options):
            return f"question {qid!r} needs 'options', a list of non-blank strings"
        if not 2 <= len(options) <= MAX_OPTIONS:
            return f"question {qid!r} has {counted(len(options), 'option')}; 2 to {MAX_OPTIONS} are allowed"
        if len(set(options)) != len(options):
            return f"question {qid!r} repeats an option"
        temperature = question.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not (
                isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0)):
            return f"question {qid!r} has temperature {temperature!r}; it must be a positive number"
        problem = _option_bias_problem(question.get("option_bias"), len(options))
        if problem:
            return f"question {qid!r} has {problem}"
    return None


def _option_bias_problem(bias: Any, n_options: int) -> str | None:
    """Why a question's ``option_bias`` is unusable (one finite number per option, or null), or None."""
    if bias is None:
        return None
    if not isinstance(bias, list) or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                                             for b in bias):
        return f"option_bias {bias!r}; it must be a list of finite numbers, one per option"
    if len(bias) != n_options:
        return f"{len(bias)} option_bias values for {n_options} options; give one per option"
    return None


def question_schema_record(document: dict[str, Any], schema_id: str, version: int) -> dict[str, Any]:
    """The Avro QuestionSchema record for a validated schema file."""
    return {
        "schema_id": schema_id,
        "version": version,
        "questions": [
            {
                "id": q["id"],
                "question": q["question"],
                "options": list(q["options"]),
                "temperature": None if q.get("temperature") is None else float(q["temperature"]),
                "option_bias": None if q.get("option_bias") is None else [float(b) for b in q["option_bias"]],
            }
            for q in document["questions"]
        ],
        "mode": document.get("mode", "packed"),
        "calibration": document.get("calibration", "none"),
        "label_mass": document.get("label_mass"),
        "created_at": int(time.time() * 1000),
    }


def schema_document(record: dict[str, Any]) -> dict[str, Any]:
    """The schema file of a QuestionSchema record (``question_schema_record``'s inverse): optional keys only where set."""
    questions = []
    for q in record["questions"]:
        item = {"id": q["id"], "question": q["question"], "options": list(q["options"])}
        for key in ("temperature", "option_bias"):
            if q.get(key) is not None:
                item[key] = q[key]
        questions.append(item)
    document = {"mode": record.get("mode", "packed"), "questions": questions}
    if record.get("calibration", "none") != "none":
        document["calibration"] = record["calibration"]
    if record.get("label_mass") is not None:
        document["label_mass"] = record["label_mass"]
    return document


def engine_questions(schema_record: dict[str, Any]) -> list[dict[str, Any]]:
    """What ``SchemaEngine.prepare`` takes: ``[{"id", "question", "options", "temperature"?, "option_bias"?}, ...]`` in
    schema order."""
    questions = []
    for q in schema_record["questions"]:
        item = {"id": q["id"], "question": q["question"], "options": list(q["options"])}
        if q.get("temperature") is not None:
            item["temperature"] = float(q["temperature"])
        if q.get("option_bias") is not None:
            item["option_bias"] = [float(b) for b in q["option_bias"]]
        questions.append(item)
    return questions


def engine_options(schema_record: dict[str, Any]) -> dict[str, Any]:
    """The rest of what ``SchemaEngine.prepare`` takes from a schema version: ``independent``, ``calibration`` and
    ``label_mass`` (None: the engine's default)."""
    return {"independent": schema_record.get("mode") == "independent",
            "calibration": schema_record.get("calibration") or "none", "label_mass": schema_record.get("label_mass")}


def state_problem(record: dict[str, Any]) -> str | None:
    """Why a decoded StateEvent cannot be scored (``invalid_fields``), or None."""
    for name in ("state_id", "schema_id"):
        if not record.get(name, "").strip():
            return f"{name} is empty"
    if not record.get("state", "").strip():
        return "state text is empty"
    return None


def probability_record(
    state: dict[str, Any],
    schema_record: dict[str, Any],
    probabilities: list[list[float]],
    model_id: str,
    source: SourceRecord,
    worker_id: str,
    truncated: bool = False,
    label_mass: list[float] | None = None,
    raw_probabilities: list[list[float] | None] | None = None,
    fingerprint: dict[str, str] | None = None,
    scored_at: int | None = None,
) -> dict[str, Any]:
    """The Avro ProbabilityRecord for one scored state; ``probabilities`` is per question, per option (calibrated where
    the schema says), ``label_mass`` per question (None: not computed), ``raw_probabilities`` per question (None,
    or None for a question: calibration changed nothing), ``fingerprint`` the scoring fingerprint of the schema
    version on this engine (``engine.fingerprint``: records with equal digests are comparable bit for bit) and
    ``scored_at`` when it was scored (epoch ms; None: now)."""
    masses = label_mass or [None] * len(probabilities)
    raws = raw_probabilities or [None] * len(probabilities)
    return {
        "state_id": state["state_id"],
        "schema_id": schema_record["schema_id"],
        "schema_version": schema_record["version"],
        "model_id": model_id,
        "questions": [
            {"id": q["id"], "options": list(q["options"]), "probabilities": [float(p) for p in probs],
             "label_mass": None if mass is None else float(mass),
             "raw_probabilities": None if raw is None else [float(p) for p in raw]}
            for q, probs, mass, raw in zip(schema_record["questions"], probabilities, masses, raws)
        ],
        "source_topic": source.topic,
        "source_partition": source.partition,
        "source_offset": source.offset,
        "event_time": state.get("event_time"),
        "scored_at": int(time.time() * 1000) if scored_at is None else scored_at,
        "truncated": truncated,
        "worker_id": worker_id,
        "metadata": state.get("metadata"),
        "fingerprint": fingerprint,
    }


def probabilities_problem(probabilities: list[list[float]], n_options: list[int],
                          label_mass: list[float] | None = None) -> str | None:
    """Why engine output is unfit to publish (wrong shape, non-finite, not a distribution, a label mass that is not a
    share), or None."""
    if label_mass is not None and not all(math.isfinite(m) and 0 <= m <= 1 for m in label_mass):
        return f"label mass {label_mass} is not a share of the distribution"
    if len(probabilities) != len(n_options):
        return f"engine returned {len(probabilities)} questions, expected {len(n_options)}"
    # The usual answer first, in C-level calls (sum, min): a sum is finite only if every term is, and NaN never is.
    if all(len(row) == count and row and min(row) >= 0 and math.isfinite(total := sum(row)) and abs(total - 1.0) <= 1e-3
           for row, count in zip(probabilities, n_options)):
        return None
    for index, (row, count) in enumerate(zip(probabilities, n_options)):
        if len(row) != count:
            return f"question {index}: engine returned {len(row)} probabilities for {count} options"
        if not all(math.isfinite(p) and p >= 0 for p in row):
            return f"question {index}: non-finite or negative probabilities {row}"
        if abs(sum(row) - 1.0) > 1e-3:
            return f"question {index}: probabilities sum to {sum(row):.6f}, not 1"
    return None
