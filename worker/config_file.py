"""Configuration files: a TOML file (``--config FILE`` or ``DECIDER_CONFIG``) beside flags and environment.

One precedence rule for every setting: flag > environment variable > config file > built-in default. The
file becomes click's ``default_map``, which click consults after the command line and the environment,
so the rule is click's own and holds for every option of every command.

Layout of the file::

    bootstrap = "kafka-1:9093,kafka-2:9093"   # top level: applies to every command that has the option
    [worker]                                   # one table per command ([topics.create], [schema.put], ...)
    model = "/models/qwen3.5-0.8b"
    max_batch = 64
    [kafka]                                    # librdkafka settings passed to every client
    "security.protocol" = "SASL_SSL"
    "sasl.mechanism" = "SCRAM-SHA-512"
    "sasl.username" = "decider"
    "sasl.password" = "..."
    "ssl.ca.location" = "/etc/kafka/ca.pem"

Keys are the long option names (``max-batch`` or ``max_batch``). The file is validated before any command
runs: an unknown key, a value of the wrong type or a setting decider owns fails with one line naming the
key. Secret values (passwords, keys, JAAS configs) never appear in logs or error messages: ``redact``.
"""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from worker.exceptions import ConfigError

CONFIG_ENV = "DECIDER_CONFIG"
KAFKA_TABLE = "kafka"
REGISTRY_TABLE = "schema_registry"  # Schema Registry client settings (worker.formats.registry)
INPUT_TABLE = "input"  # the input mapping's options, for every command that has them (worker, replay)
# The options [input] may set (worker.formats.input_mapping.InputMapping's fields, as the CLI names them); list values
# are allowed for the two comma-separated ones.
INPUT_KEYS = ("input_format", "id_field", "text_field", "text_template", "schema_id_field", "schema_id",
              "event_time_field", "metadata_fields", "propagate_headers")
_INPUT_LISTS = ("metadata_fields", "propagate_headers")

# Settings decider sets itself because exactly-once depends on them (or that have their own option):
# overriding them from the file would silently break the contract, so they are refused.
OWNED_KAFKA_KEYS = {
    "bootstrap.servers": "use the bootstrap key (or -b/--bootstrap)",
    "group.id": "use the group key (--group)",
    "group.instance.id": "derived from --worker-id",
    "transactional.id": "derived from --worker-id",
    "transaction.timeout.ms": "use transaction_timeout_ms (--transaction-timeout-ms)",
    "session.timeout.ms": "use session_timeout_ms (--session-timeout-ms)",
    "enable.auto.commit": "offsets are committed only inside transactions",
    "isolation.level": "decider reads read_committed",
    "enable.idempotence": "required by the transactional and CLI producers",
    "auto.offset.reset": "a new group must start at the beginning",
    "enable.partition.eof": "the readers rely on it",
}

_SECRET = re.compile(r"password|secret|jaas|token|(^|\.)key\.pem$|(^|\.)key$|credentials", re.IGNORECASE)
REDACTED = "[redacted]"


def is_secret(key: str) -> bool:
    """Whether the value of librdkafka setting ``key`` must never be shown."""
    return bool(_SECRET.search(key))


def redact(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with every secret value replaced (for logs and messages)."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in settings.items()}


def redact_text(text: str, settings: Mapping[str, Any]) -> str:
    """``text`` with every secret value of ``settings`` replaced, wherever it appears (e.g. in a client error)."""
    secrets = sorted({str(v) for k, v in settings.items() if is_secret(k) and str(v)}, key=len, reverse=True)
    if not secrets:
        return text
    # One pass, longest first: a secret that is part of another (or of the marker) cannot leave a fragment.
    return re.sub("|".join(map(re.escape, secrets)), REDACTED, text)


@dataclass(frozen=True)
class FileConfig:
    """A validated config file: click's ``default_map`` and the librdkafka pass-through settings."""

    path: Path
    default_map: dict[str, Any] = field(default_factory=dict)
    kafka: dict[str, Any] = field(default_factory=dict)
    schema_registry: dict[str, Any] = field(default_factory=dict)  # client settings, secrets included


def split_config_flag(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[Path | None, list[str]]:
    """Take ``--config FILE`` (or ``--config=FILE``) out of ``argv`` wherever it is; else ``DECIDER_CONFIG``.

    Read before click parses anything, because the file supplies the defaults of that parse."""
    rest: list[str] = []
    path: str | None = None
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        if arg == "--":
            rest.extend(items[i:])
            break
        if arg == "--config":
            if i + 1 >= len(items):
                raise ConfigError("--config needs a file name")
            path, i = items[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if path is None:
        path = environ.get(CONFIG_ENV) or None
    return (Path(path) if path else None), rest


def load_config_file(path: Path, root: Any) -> FileConfig:
    """Read and validate ``path`` against the commands of ``root`` (the ``decider`` click group).

    Commands and options are looked at by duck typing: typer ships its own copy of click."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: invalid TOML: {exc}") from None
    where = f"config {path}"
    kafka = _kafka_table(document.pop(KAFKA_TABLE, {}), where)
    registry = _registry_table(document.pop(REGISTRY_TABLE, {}), where)
    input_values = _input_table(document.pop(INPUT_TABLE, {}), where)
    commands = dict(_leaf_commands(root))
    shared: dict[str, Any] = {}
    per_command: dict[tuple[str, ...], dict[str, Any]] = {}
    for key, value in document.items():
        if isinstance(value, dict) and _is_command_prefix(key, commands):
            _command_tables(key, value, (key,), commands, per_command, where)
        else:
            params = [p for params in commands.values() for p in params if _name(key) == p.name]
            if not params:
                known = {p.name for params in commands.values() for p in params} | {path[0] for path in commands}
                raise ConfigError(f"{where}: unknown key {key!r} ({_suggestion(key, known)}not an option of any command, "
                                  "nor a command table)")
            for param in params:
                _check_type(key, value, param, where)
            shared[_name(key)] = value
    default_map: dict[str, Any] = {}
    for path_parts, params in commands.items():
        names = {p.name for p in params}
        # [input] applies to the commands that map input (worker, replay), not to produce's or score's --schema-id.
        values = {k: v for k, v in input_values.items() if k in names} if "input_format" in names else {}
        for key, value in values.items():
            _check_type(f"[{INPUT_TABLE}] {key}", value, next(p for p in params if p.name == key), where)
        values.update({k: v for k, v in shared.items() if k in names})
        values.update(per_command.get(path_parts, {}))
        if values:
            node = default_map
            for part in path_parts[:-1]:
                node = node.setdefault(part, {})
            node[path_parts[-1]] = values
    return FileConfig(path=path, default_map=default_map, kafka=kafka, schema_registry=registry)


def _name(key: str) -> str:
    return key.replace("-", "_")


def _suggestion(key: str, known: typing.Iterable[str]) -> str:
    """"did you mean 'max_batch'? " for the known key closest to ``key`` (difflib), or nothing."""
    close = difflib.get_close_matches(_name(key), sorted(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _known(key: str, known: typing.Iterable[str]) -> str:
    """The suggestion for ``key`` first, then every known key: "did you mean 'max_batch'? known: ..."."""
    return f"{_suggestion(key, known)}known: {', '.join(sorted(known))}"


def _leaf_commands(group: Any, prefix: tuple[str, ...] = ()):
    """(command path, its options) of every runnable command under ``group``."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _leaf_commands(command, prefix + (name,))
        else:
            yield prefix + (name,), [p for p in command.params if getattr(p, "param_type_name", "") == "option"]


def _is_command_prefix(key: str, commands: dict[tuple[str, ...], list]) -> bool:
    return any(path[0] == key for path in commands)


def _command_tables(key: str, table: dict, path: tuple[str, ...], commands: dict, out: dict, where: str) -> None:
    if path in commands:
        params = {p.name: p for p in commands[path]}
        section = "[" + ".".join(path) + "]"
        for option, value in table.items():
            param = params.get(_name(option))
            if param is None:
                raise ConfigError(f"{where}: unknown key {option!r} in {section} ({_known(option, params)})")
            _check_type(f"{section} {option}", value, param, where)
            out.setdefault(path, {})[param.name] = value
        return
    for sub, value in table.items():
        child = path + (sub,)
        if not isinstance(value, dict) or not any(p[:len(child)] == child for p in commands):
            tables = {p[len(path)] for p in commands if p[:len(path)] == path and len(p) > len(path)}
            raise ConfigError(f"{where}: unknown key {sub!r} in [{'.'.join(path)}] ({_suggestion(sub, tables)}expected "
                              "a command table)")
        _command_tables(sub, value, child, commands, out, where)


def _annotation(param: Any) -> Any:
    """The option's Python type (typer's annotation, ``Optional[...]`` unwrapped; click's type name otherwise)."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:
        return {"integer": int, "float": float, "boolean": bool}.get(getattr(getattr(param, "type", None), "name", ""), str)
    kinds = [a for a in typing.get_args(descriptor.annotation) if a is not type(None)] or [descriptor.annotation]
    return kinds[0]


def _check_type(key: str, value: Any, param: Any, where: str) -> None:
    kind = _annotation(param)
    if kind is bool or getattr(param, "is_flag", False):
        ok, want = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{where}: {key} must be {want}, not {type(value).__name__} {value!r}")


def _kafka_table(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{KAFKA_TABLE}] must be a table of librdkafka settings")
    settings: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            # An unquoted dotted key (security.protocol = ...) is a nested table in TOML.
            raise ConfigError(f"{where}: [{KAFKA_TABLE}] key {key!r} is a table: quote dotted librdkafka names, "
                              f"e.g. \"{key}.{next(iter(value), 'x')}\" = ...")
        if key in OWNED_KAFKA_KEYS:
            raise ConfigError(f"{where}: [{KAFKA_TABLE}] {key!r} is set by decider ({OWNED_KAFKA_KEYS[key]})")
        if not isinstance(value, (str, int, float, bool)):
            shown = REDACTED if is_secret(key) else repr(value)
            raise ConfigError(f"{where}: [{KAFKA_TABLE}] {key} must be a string, number or boolean, not {shown}")
        settings[key] = value
    check_kafka_settings(settings, where)
    return settings


def _input_table(table: Any, where: str) -> dict[str, Any]:
    """The [input] table as option values (lists joined with commas, as the flags take them)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{INPUT_TABLE}] must be a table of input mapping options")
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = _name(key)
        if name not in INPUT_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} in [{INPUT_TABLE}] ({_known(key, INPUT_KEYS)})")
        if name in _INPUT_LISTS and isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise ConfigError(f"{where}: [{INPUT_TABLE}] {key} must be a list of strings, not {value!r}")
            value = ",".join(value)
        values[name] = value
    return values


def _registry_table(table: Any, where: str) -> dict[str, Any]:
    """The [schema_registry] table: confluent-kafka SchemaRegistryClient settings (checked when the client is made)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{REGISTRY_TABLE}] must be a table of Schema Registry client settings")
    for key, value in table.items():
        if isinstance(value, dict):
            raise ConfigError(f"{where}: [{REGISTRY_TABLE}] key {key!r} is a table: quote dotted names, "
                              f"e.g. \"{key}.{next(iter(value), 'x')}\" = ...")
        if key == "url":
            raise ConfigError(f"{where}: [{REGISTRY_TABLE}] must not set url; use schema_registry_url (--schema-registry-url)")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{where}: [{REGISTRY_TABLE}] {key} must be a string, number or boolean")
    return dict(table)


def check_kafka_settings(settings: Mapping[str, Any], where: str = "kafka settings") -> None:
    """Let librdkafka itself reject unknown names and bad values now, not at the first client (no connection is made)."""
    if not settings:
        return
    from confluent_kafka import KafkaException, Producer

    try:
        # No bootstrap servers: the client connects nowhere; construction alone validates every setting.
        Producer({**settings, "log_level": 0}).flush(0)
    except KafkaException as exc:
        detail = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise ConfigError(f"{where}: [{KAFKA_TABLE}] {redact_text(detail, settings)}") from None
