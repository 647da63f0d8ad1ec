"""Users' own events in, the settings: how the states topic's records become states (``--input-format`` and the
mapping options, or the config file's ``[input]`` table), checked once when built. ``worker.formats.input_decoder``
applies them to each record.

Formats (``--input-format``):

- ``decider``: the StateEvent Avro of ``schemas`` (the default; no mapping options apply).
- ``json``: a UTF-8 JSON object. ``--text-field`` or ``--text-template`` give the text; ids, schema, event
  time and metadata come from dotted paths (``worker.formats.paths``).
- ``avro-registry``: Confluent wire format (schema id in the magic-byte prefix or a header), decoded by
  confluent-kafka's own ``AvroDeserializer``; then mapped like ``json``.
- ``text``: the value is the state text.

Where each field comes from:

- state id: ``--id-field``, else the record key (UTF-8).
- schema id: ``--schema-id-field`` if set (the path must resolve); otherwise the ``decider-schema-id``
  header if the record has one; otherwise the fixed ``--schema-id``. A per-record choice beats the fixed
  default; ``--schema-id`` with ``--schema-id-field`` is refused as ambiguous.
- event time: ``--event-time-field`` (epoch milliseconds, or an ISO 8601 string; no zone means UTC),
  else the record's timestamp.
- metadata: each ``--metadata-fields`` path, keyed by the path, values as text (JSON for non-strings).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from worker.exceptions import ConfigError
from worker.formats import paths

FORMATS = ("decider", "json", "avro-registry", "text")
DEFAULT_PROPAGATE_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True)
class InputMapping:
    """How the states topic's records become states; validated when built (``ConfigError``, one line)."""

    format: str = "decider"
    id_field: str | None = None
    text_field: str | None = None
    text_template: str | None = None
    schema_id_field: str | None = None
    schema_id: str | None = None
    event_time_field: str | None = None
    metadata_fields: tuple[str, ...] = ()
    propagate_headers: tuple[str, ...] = DEFAULT_PROPAGATE_HEADERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata_fields", tuple(self.metadata_fields))
        object.__setattr__(self, "propagate_headers", tuple(self.propagate_headers))
        if self.format not in FORMATS:
            raise ConfigError(f"--input-format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        _check_options(self)

    @property
    def reads_fields(self) -> bool:
        """True for the formats whose value is a document that paths read (json, avro-registry)."""
        return self.format in ("json", "avro-registry")

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str = "[input]") -> "InputMapping":
        """An ``InputMapping`` from the config file's ``[input]`` table (keys as the long option names)."""
        known = {f.replace("_", "-"): f for f in cls.__dataclass_fields__} | {"input-format": "format"}
        values: dict[str, Any] = {}
        for key, value in table.items():
            name = known.get(key.replace("_", "-"))
            if name is None:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if name in ("metadata_fields", "propagate_headers"):
                value = split_list(value, f"{where} {key}")
            elif not isinstance(value, str):
                raise ConfigError(f"{where} {key} must be a string, not {value!r}")
            values[name] = value
        return cls(**values)


_FLAG_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\\\": "\\"}


def unescape_flag_template(text: str) -> str:
    """A ``--text-template`` as typed in a shell, with ``\\n``, ``\\t`` and ``\\\\`` turned into a newline, a tab and a
    backslash (a shell passes them literally; the config file's TOML strings have their own escapes, so the
    ``[input]`` table's value is used as it is)."""
    return re.sub(r"\\[nt\\]", lambda m: _FLAG_ESCAPES[m.group(0)], text)


def split_list(value: str | Sequence[str], option: str) -> tuple[str, ...]:
    """A comma-separated option (or a list of strings, from the config file) as a tuple of its items."""
    items = value.split(",") if isinstance(value, str) else value
    if not all(isinstance(item, str) for item in items):
        raise ConfigError(f"{option} must be a list of strings or a comma-separated string, not {value!r}")
    return tuple(item.strip() for item in items if item.strip())


def _check_options(m: InputMapping) -> None:
    field_options = {"--id-field": m.id_field, "--text-field": m.text_field, "--text-template": m.text_template,
                     "--schema-id-field": m.schema_id_field, "--event-time-field": m.event_time_field,
                     "--metadata-fields": ",".join(m.metadata_fields) or None}
    given = [name for name, value in field_options.items() if value is not None]
    if m.format == "decider" and (given or m.schema_id is not None):
        extra = given + (["--schema-id"] if m.schema_id is not None else [])
        raise ConfigError(f"{', '.join(extra)} apply to --input-format json, avro-registry or text; the decider format carries its own fields")
    if m.format == "text" and given:
        raise ConfigError(f"{', '.join(given)} need a structured value (--input-format json or avro-registry); a text value is the state itself")
    if m.reads_fields:
        if m.text_field is not None and m.text_template is not None:
            raise ConfigError("give --text-field or --text-template, not both")
        if m.text_field is None and m.text_template is None:
            raise ConfigError(f"--input-format {m.format} needs --text-field PATH or --text-template TEMPLATE to know what to score")
        if m.text_template is not None:
            paths.template_paths(m.text_template)
        for option, path in (("--id-field", m.id_field), ("--text-field", m.text_field),
                             ("--schema-id-field", m.schema_id_field), ("--event-time-field", m.event_time_field)):
            if path is not None:
                paths.check_path(path, option)
        for path in m.metadata_fields:
            paths.check_path(path, "--metadata-fields")
    if m.schema_id is not None and not m.schema_id.strip():
        raise ConfigError("--schema-id must not be empty")
    if m.schema_id is not None and m.schema_id_field is not None:
        raise ConfigError("give --schema-id (one schema for every record) or --schema-id-field (read from each record), not both")
    if any(not h for h in m.propagate_headers):
        raise ConfigError("--propagate-headers has an empty header name")

