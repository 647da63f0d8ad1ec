"""What users write by hand: schema files (``decider schema put``, ``decider score --schema``) and states files
(``decider produce``, ``decider score --states``), read into records.

Every problem is one ``ConfigError`` naming the file, the line or question, and the fix: bytes that are not UTF-8,
text that is not JSON, keys the format does not have (with the likely intended one), schemas over the size
limits, event times that are not times, and strings no Kafka key or Avro record can carry (an unpaired surrogate
escape such as ``\\ud800``).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from worker.exceptions import ConfigError
from worker.formats.records import schema_problem

SCHEMA_KEYS = ("mode", "questions", "calibration", "label_mass")
QUESTION_KEYS = ("id", "question", "options", "temperature", "option_bias")
STATE_KEYS = ("id", "state", "metadata", "event_time")
# Names other tools give a state's keys, which difflib would not find close to decider's.
STATE_KEY_ALIASES = {"text": "state", "body": "state", "content": "state", "message": "state", "state_id": "id",
                     "key": "id", "meta": "metadata", "time": "event_time", "timestamp": "event_time", "ts": "event_time"}

# engine.prompt's limits, repeated so that the CLI checks a schema file without importing torch (a test keeps
# them equal). The engine also bounds the prefix in tokens; the CLI has no tokenizer, so it bounds the whole
# schema in characters, at about four characters a token of English.
MAX_QUESTION_CHARS = 2000
MAX_OPTION_CHARS = 500
MAX_SCHEMA_CHARS = 32_000

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MIN_TIME_MS = (datetime(1, 1, 1, tzinfo=timezone.utc) - _EPOCH) // timedelta(milliseconds=1)
_MAX_TIME_MS = (datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=timezone.utc) - _EPOCH) // timedelta(milliseconds=1)
TIME_FORMATS = "epoch milliseconds or ISO 8601 such as 2026-01-01T00:00:00Z (UTC unless a zone is given)"


# ---- files ------------------------------------------------------------------------------------------------------
def read_user_text(path: str | Path, what: str) -> str:
    """The text of a user's file ('-' reads stdin), which must be UTF-8 (a leading byte-order mark is allowed)."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{what} {_name(path)} line {line} is not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                          "save the file as UTF-8") from None


def _name(path: str | Path) -> str:
    return "(stdin)" if str(path) == "-" else str(path)


def _parse_json(text: str) -> Any:
    """``json.loads``; ValueError with a short reason (no position relative to a line the caller numbers)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
        # Some of json's reasons end in "at" ("Unterminated string starting at"): one "at" before the place.
        reason = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
        raise ValueError(f"{reason} at {where}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


# ---- schema files -----------------------------------------------------------------------------------------------
def load_schema_file(path: str | Path) -> dict[str, Any]:
    """Read and validate a user's schema file; ``ConfigError`` with the reason if it is unusable."""
    text = read_user_text(path, "schema file")
    try:
        document = _parse_json(text)
    except ValueError as exc:
        raise ConfigError(f"schema file {_name(path)} is not JSON: {exc}") from None
    problem = schema_file_problem(document)
    if problem:
        raise ConfigError(f"schema file {_name(path)}: {problem}")
    return document


def schema_file_problem(document: Any) -> str | None:
    """Why a parsed schema file is unusable, or None: unknown keys first (a misspelt key would otherwise read
    as a missing one), then the structure, then the size limits and the text itself."""
    return _unknown_schema_keys(document) or schema_problem(document) or _oversized(document) or _bad_text(document)


def _unknown_schema_keys(document: Any) -> str | None:
    if not isinstance(document, dict):
        return None
    problem = unknown_key(document, SCHEMA_KEYS, "the schema")
    if problem or not isinstance(document.get("questions"), list):
        return problem
    for index, question in enumerate(document["questions"]):
        if isinstance(question, dict):
            name = question.get("id") if isinstance(question.get("id"), str) else index
            problem = unknown_key(question, QUESTION_KEYS, f"question {name!r}")
            if problem:
                return problem
    return None


def unknown_key(mapping: dict, known: tuple[str, ...], where: str, aliases: dict[str, str] | None = None) -> str | None:
    """'unknown key K in WHERE (did you mean ...?)' for the first key of ``mapping`` not in ``known``, or None
    (``aliases``: other tools' names for the known keys, suggested before any key spelt close)."""
    for key in mapping:
        if key not in known:
            alias = (aliases or {}).get(str(key).lower())
            close = [alias] if alias else difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "known: " + ", ".join(known)
            return f"unknown key {key!r} in {where} ({hint})"
    return None


def _oversized(document: dict[str, Any]) -> str | None:
    total = 0
    for question in document["questions"]:
        if len(question["question"]) > MAX_QUESTION_CHARS:
            return (f"question {question['id']!r} is {len(question['question'])} characters; at most "
                    f"{MAX_QUESTION_CHARS} are allowed")
        longest = max(len(option) for option in question["options"])
        if longest > MAX_OPTION_CHARS:
            return f"question {question['id']!r} has an option of {longest} characters; at most {MAX_OPTION_CHARS} are allowed"
        total += len(question["question"]) + sum(len(option) for option in question["options"])
    if total > MAX_SCHEMA_CHARS:
        return (f"the questions and options hold {total} characters; at most {MAX_SCHEMA_CHARS} are allowed "
                "(shorten them, or split them into several schemas)")
    return None


def _bad_text(document: dict[str, Any]) -> str | None:
    for question in document["questions"]:
        for text in (question["id"], question["question"], *question["options"]):
            if not _is_unicode(text):
                return f"question {question['id']!r}: {_surrogate_problem(text)}"
    return None


# ---- states files -----------------------------------------------------------------------------------------------
def read_state_lines(path: str | Path, schema_id: str) -> list[dict[str, Any]]:
    """StateEvent records for every non-blank line of a JSON-lines states file ('-' reads stdin)."""
    text = read_user_text(path, "states file")
    # Lines end at "\n" only: JSON strings may hold other line separators (U+2028, U+0085) that
    # str.splitlines() would cut at.
    return [state_record(line, schema_id, f"states file {_name(path)} line {number}")
            for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def no_states_warning(path: str | Path, outcome: str) -> str:
    """The warning for a states file without a state (empty, or blank lines only): ``outcome`` says what follows."""
    return f"warning: states file {_name(path)} holds no states (no line that is not blank); {outcome}"


def state_record(line: str, schema_id: str, where: str) -> dict[str, Any]:
    """The Avro StateEvent for one line of a states file; ``where`` names the line in errors."""
    item = _state_object(line, where)
    metadata = _metadata(item.get("metadata"), where)
    texts = [("id", item["id"]), ("state", item["state"])]
    texts += [("metadata", text) for pair in (metadata or {}).items() for text in pair]
    for name, text in texts:
        if not _is_unicode(text):
            raise ConfigError(f'{where}: "{name}" {_surrogate_problem(text)}')
    try:
        event_time = event_time_ms(item.get("event_time"))
    except ValueError as exc:
        raise ConfigError(f'{where}: "event_time" {_short(item.get("event_time"))} {exc}') from None
    return {"state_id": item["id"], "schema_id": schema_id, "state": item["state"], "event_time": event_time,
            "metadata": metadata}


def _state_object(line: str, where: str) -> dict[str, Any]:
    try:
        item = _parse_json(line)
    except ValueError as exc:
        raise ConfigError(f"{where} is not JSON: {exc}") from None
    # Unknown keys first: {"id": ..., "text": ...} is a misnamed "state", not a missing one.
    problem = unknown_key(item, STATE_KEYS, "the state", STATE_KEY_ALIASES) if isinstance(item, dict) else None
    if problem:
        raise ConfigError(f"{where}: {problem}; put your own fields in \"metadata\"")
    if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not isinstance(item.get("state"), str):
        raise ConfigError(f'{where} must be an object with string "id" and "state"')
    return item


def _metadata(metadata: Any, where: str) -> dict[str, str] | None:
    """The Avro map of strings: string values as they are, others as their JSON text."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ConfigError(f'{where}: "metadata" must be an object')
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in metadata.items()}


def event_time_ms(value: Any) -> int:
    """Epoch milliseconds of a state's ``event_time``: absent (None) is now; a number is epoch milliseconds
    (0 is 1970-01-01T00:00:00Z, not "now"); a string is ISO 8601, UTC unless it names a zone, or digits.
    ValueError says why anything else is not a time."""
    if value is None:
        return int(time.time() * 1000)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"is not a time: give {TIME_FORMATS}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError("is not a whole number of epoch milliseconds")
        value = int(value)
    if isinstance(value, str):
        value = _parse_time_text(value.strip())
    if not _MIN_TIME_MS <= value <= _MAX_TIME_MS:
        raise ValueError("is out of range: epoch milliseconds of a time between the years 1 and 9999")
    return value


def _parse_time_text(text: str) -> int:
    if re.fullmatch(r"-?\d{1,20}", text):
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"is not a time: give {TIME_FORMATS}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (moment - _EPOCH) // timedelta(milliseconds=1)


# ---- text -------------------------------------------------------------------------------------------------------
def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_problem(text: str) -> str:
    return (f"{_short(text)} holds an unpaired surrogate escape (such as \\ud800), which is not Unicode text; "
            "fix or remove the escape")


def _short(value: Any, limit: int = 60) -> str:
    """``value`` as JSON writes it, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=not _is_unicode(value) if isinstance(value, str) else False)
    return text if len(text) <= limit else text[: limit - 1] + "…"
