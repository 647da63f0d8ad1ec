"""Dotted paths into users' events (``after.body``, ``items.0.name``) and text templates whose
placeholders are such paths (``"Subject: {ticket.subject}"``; ``{{`` and ``}}`` stand for braces).

A path is checked once, when the mapping is configured (``check_path``, ``template_paths``); resolving it
against one event (``resolve``) raises ``PathError`` naming the path and what was found instead, which
the input mapping turns into a dead letter.
"""

from __future__ import annotations

import datetime as dt
import string
from typing import Any

from worker.exceptions import ConfigError

_MISSING = object()


class PathError(Exception):
    """A path that cannot be read in one event; ``str()`` is a message naming the path."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"path {path!r}: {problem}")
        self.path = path


def check_path(path: str, option: str) -> str:
    """``path`` if it is a well-formed dotted path, else ``ConfigError`` naming ``option``."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{option} needs a dotted path such as ticket.body, not {path!r}")
    if any(not part for part in path.split(".")):
        raise ConfigError(f"{option} {path!r} has an empty segment; write it like after.body or items.0.name")
    return path


def template_paths(template: str, option: str = "--text-template") -> tuple[str, ...]:
    """The paths named by ``template``'s placeholders, in order; ``ConfigError`` if the template is unusable."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{option} {template!r} is not a valid template ({exc}); write {{{{ and }}}} for literal braces") from None
    paths = []
    for _, field_name, format_spec, conversion in parsed:
        if field_name is None:
            continue
        if conversion or format_spec:
            raise ConfigError(f"{option}: placeholder {{{field_name}...}} has a conversion or format spec; only {{path}} is supported")
        paths.append(check_path(field_name, f"{option} placeholder"))
    if not paths:
        raise ConfigError(f"{option} {template!r} names no field; put paths in braces, e.g. 'Subject: {{ticket.subject}}'")
    return tuple(paths)


def resolve(document: Any, path: str) -> Any:
    """The value at ``path`` in ``document`` (objects by key, lists by index); ``PathError`` if absent."""
    value = document
    walked: list[str] = []
    for part in path.split("."):
        found = _step(value, part)
        if found is _MISSING:
            where = ".".join(walked) or "the event"
            if isinstance(value, (dict, list, tuple)):
                raise PathError(path, f"{where} has no {part!r}")
            raise PathError(path, f"{where} holds {describe(value)}, not an object or list")
        value = found
        walked.append(part)
    return value


def _step(value: Any, part: str) -> Any:
    if isinstance(value, dict):
        return value.get(part, _MISSING)
    if isinstance(value, (list, tuple)) and part.isdigit():
        index = int(part)
        return value[index] if index < len(value) else _MISSING
    return _MISSING


def resolve_text(document: Any, path: str) -> str:
    """The string at ``path``; ``PathError`` if absent or not a string."""
    value = resolve(document, path)
    if not isinstance(value, str):
        raise PathError(path, f"holds {describe(value)}, not text")
    return value


def render(document: Any, template: str) -> str:
    """``template`` with each ``{path}`` replaced by the scalar at that path; ``PathError`` on the first that fails."""
    pieces = []
    for literal, field_name, _, _ in string.Formatter().parse(template):
        pieces.append(literal)
        if field_name is not None:
            pieces.append(scalar_text(resolve(document, field_name), field_name))
    return "".join(pieces)


def scalar_text(value: Any, path: str) -> str:
    """A scalar as it is written into text (``true``/``false`` for booleans); ``PathError`` for null, objects, lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dt.datetime):  # Avro timestamp logical types decode to datetimes
        return value.isoformat()
    raise PathError(path, f"holds {describe(value)}; a template placeholder needs a string, number or boolean")


def describe(value: Any) -> str:
    """A short name of what ``value`` is, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, bytes):
        return "bytes"
    return f"a {type(value).__name__}"
