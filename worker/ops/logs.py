"""Structured logs: one line per event that matters, human-readable or one JSON object a line (--log-format json).

The loop reports what happens as events (``Worker(on_event=...)``: model loaded, schema prepared, batch
committed with its dead letters, transaction aborted, partitions assigned/revoked/lost); ``log_event`` turns
each into one line on the ``decider.events`` logger with its fields. Fencing and other fatal errors reach the
CLI as exceptions: one ``error:`` line, or under --log-format json one event (``log_fatal``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

EVENTS = logging.getLogger("decider.events")
LEVELS = ("debug", "info", "warning", "error")
# Bulky fields of the loop's events that a log line does not need (whole records, per-partition output offsets).
_DROPPED_FIELDS = {"samples", "outputs"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, then the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


class HumanFormatter(logging.Formatter):
    """``time level logger: message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", {})
        extra = " ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}" for k, v in fields.items() if k != "event")
        return f"{text} {extra}" if extra else text


def setup_logging(level: str = "info", fmt: str = "human") -> None:
    """Configure the root logger on stderr in ``fmt`` (human or json) at ``level`` (debug, info, warning or
    error); replaces earlier handlers."""
    from worker.exceptions import ConfigError

    if fmt not in ("human", "json"):
        raise ConfigError(f"--log-format must be human or json, not {fmt!r}")
    if level.lower() not in LEVELS:
        raise ConfigError(f"--log-level must be {', '.join(LEVELS[:-1])} or {LEVELS[-1]}, not {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    # No formatter here shows a record's source line, thread or process: without them a record is made without walking
    # the caller's frames or asking for the thread and the process (a line per committed cycle; issue 46)
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    # The Schema Registry client's HTTP library logs every request at info: a line per registration, and the URL
    # as given (credentials in it included). decider logs what matters about the registry itself.
    for name in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_event(kind: str, info: dict[str, Any], committed_level: int = logging.INFO) -> None:
    """Sink for ``Worker(on_event=...)``: one line per event, its fields attached; a transaction's ``committed`` line at
    ``committed_level`` (a replay's progress bar says what they would, so it logs them at debug)."""
    fields = {"event": kind, **{k: v for k, v in info.items() if k not in _DROPPED_FIELDS}}
    level = logging.WARNING if kind in ("aborted", "lost") else logging.INFO
    if kind == "committed":
        # A commit with no record (offsets only) is frequent and says nothing: keep it at debug.
        level = committed_level if info.get("scored") or info.get("dead_letters") else logging.DEBUG
        for reason, count in (info.get("dead_letters") or {}).items():
            EVENTS.warning("dead letters", extra={"fields": {"event": "dead_letter", "reason": reason, "count": count}})
    EVENTS.log(level, kind.replace("_", " "), extra={"fields": fields})


def writes_json() -> bool:
    """Whether log lines are JSON objects (``setup_logging(fmt="json")``, --log-format json)."""
    return any(isinstance(handler.formatter, JsonFormatter) for handler in logging.getLogger().handlers)


def log_fatal(kind: str, message: str, exit_code: int) -> None:
    """A fatal error (fencing, an unreachable broker, ...) as one event line before the process exits."""
    EVENTS.error(message, extra={"fields": {"event": kind, "exit_code": exit_code}})
