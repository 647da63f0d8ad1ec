"""The CLI's shared options, declared once with their defaults from ``worker.config``, and the one place a command's
flags (environment variables and config file included) become its configuration object."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import typer
from typer.core import TyperCommand

from worker.config import MAX_COMMIT_LINGER_MS, MAX_TRANSACTIONAL_IDS, Cluster, Topics, WorkerConfig
from worker.exceptions import ConfigError
from worker.formats.input_mapping import InputMapping, split_list, unescape_flag_template
from worker.formats.registry import RegistryConfig

DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig) if f.default is not dataclasses.MISSING}
TOPICS = Topics()  # the default topic names
DEFAULT_INPUT = InputMapping()

# ---- shared options -----------------------------------------------------------------------------------------
BootstrapOpt = typer.Option(..., "-b", "--bootstrap", envvar="DECIDER_BOOTSTRAP", help="Kafka bootstrap servers, host:port[,host:port].")
StatesTopicOpt = typer.Option(TOPICS.states, "--states-topic", envvar="DECIDER_STATES_TOPIC", help="Topic of state events.")
SchemasTopicOpt = typer.Option(TOPICS.schemas, "--schemas-topic", envvar="DECIDER_SCHEMAS_TOPIC", help="Compacted topic of question schemas.")
ProbabilitiesTopicOpt = typer.Option(TOPICS.probabilities, "--probabilities-topic", envvar="DECIDER_PROBABILITIES_TOPIC", help="Output topic of probability records.")
DeadLetterTopicOpt = typer.Option(TOPICS.dead_letter, "--dead-letter-topic", envvar="DECIDER_DEAD_LETTER_TOPIC", help="Output topic of dead letters.")
ModelOpt = typer.Option(..., "--model", envvar="DECIDER_MODEL", help="Local Hugging Face model directory (Qwen3.5 family).")
DeviceOpt = typer.Option(DEFAULTS["device"], "--device", envvar="DECIDER_DEVICE", help="cpu, cuda or cuda:N.")
DtypeOpt = typer.Option(None, "--dtype", envvar="DECIDER_DTYPE", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA).")
DeterministicOpt = typer.Option(
    None, "--deterministic/--no-deterministic", envvar="DECIDER_DETERMINISTIC",
    help="Batch-invariant scoring: a state's probabilities are bit-identical whatever batch it is scored in, so a "
         "replay reproduces the live records. Default: on where it costs at most 5% (CUDA; docs/semantics.md).")


def _option(name: str, annotation: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


# Options of every command that runs the loop (worker and replay): declared once, added to each by @loop_options.
LOOP_OPTIONS = [
    _option("bootstrap", str, BootstrapOpt),
    _option("model", str, ModelOpt),
    _option("device", str, DeviceOpt),
    _option("dtype", Optional[str], DtypeOpt),
    _option("deterministic", Optional[bool], DeterministicOpt),
    _option("schema_wait_ms", int, typer.Option(DEFAULTS["schema_wait_ms"], "--schema-wait-ms", envvar="DECIDER_SCHEMA_WAIT_MS", help="How long a state naming an unknown schema waits before it is dead-lettered.")),
    _option("max_state_chars", int, typer.Option(DEFAULTS["max_state_chars"], "--max-state-chars", envvar="DECIDER_MAX_STATE_CHARS", help="Longer states are dead-lettered (state_too_large).")),
    _option("schema_memory_mb", float, typer.Option(DEFAULTS["schema_memory_mb"], "--schema-memory-mb", envvar="DECIDER_SCHEMA_MEMORY_MB", help="Device memory budget for prepared schemas; least recently used ones are released beyond it.")),
    _option("tokenizer_threads", int, typer.Option(DEFAULTS["tokenizer_threads"], "--tokenizer-threads", envvar="DECIDER_TOKENIZER_THREADS", min=1, help="Threads tokenizing states off the GPU thread.")),
    _option("warmup_state_tokens", str, typer.Option(
        "", "--warmup-state-tokens", envvar="DECIDER_WARMUP_STATE_TOKENS",
        help="Comma-separated state lengths in tokens (e.g. 96,128,192): on CUDA, the graphs of every batch size at "
             "these lengths (and at the lengths the stream's states had so far) are captured when a schema is "
             "prepared, beside the stream (the first schema waits for its own). Default: the lengths seen so far; "
             "a batch no captured graph serves runs eagerly once while its graph is captured beside the stream.")),
    _option("transaction_timeout_ms", int, typer.Option(DEFAULTS["transaction_timeout_ms"], "--transaction-timeout-ms", envvar="DECIDER_TRANSACTION_TIMEOUT_MS", help="Broker-side timeout of an open transaction.")),
    _option("transactional_ids", int, typer.Option(
        DEFAULTS["transactional_ids"], "--transactional-ids", envvar="DECIDER_TRANSACTIONAL_IDS", min=1,
        max=MAX_TRANSACTIONAL_IDS,
        help=f"Transactional ids to commit on in turn, one transaction each (1 to {MAX_TRANSACTIONAL_IDS}). Apache "
             "Kafka refuses a producer's next transaction until the last one's markers are written; on 2 (the "
             "default), back-to-back commits do not wait for them. The ids are the worker's transactional id and that "
             f"id with .t1, .t2, ...; those up to .t{MAX_TRANSACTIONAL_IDS - 1} that it does not use are fenced at "
             "start, so lowering the setting never leaves a transaction open (docs/brokers.md).")),
    _option("commit_linger_ms", int, typer.Option(
        DEFAULTS["commit_linger_ms"], "--commit-linger-ms", envvar="DECIDER_COMMIT_LINGER_MS", min=0,
        max=MAX_COMMIT_LINGER_MS,
        help="How long a scored batch may wait for the next ones to join its transaction when none is running "
             "(default 0). Larger transactions cost the host and the broker less per state; the wait adds to every "
             "record's latency. It pays only where the broker shares the worker's cores (docs/brokers.md).")),
    _option("broker_outage_s", float, typer.Option(DEFAULTS["broker_outage_s"], "--broker-outage-s", envvar="DECIDER_BROKER_OUTAGE_S", help="How long to ride out an unreachable broker (nothing commits meanwhile; the worker resumes by itself when it returns) before exiting with code 5.")),
    _option("stall_after_s", float, typer.Option(
        DEFAULTS["stall_after_s"], "--stall-after-s", envvar="DECIDER_STALL_AFTER_S",
        help="Warn about a partition that makes no progress for this long, and fail /readyz until it does "
             "(docs/semantics.md, Faults).")),
    _option("metrics_port", Optional[int], typer.Option(None, "--metrics-port", envvar="DECIDER_METRICS_PORT", min=1, max=65535, help="Serve /metrics (Prometheus), /healthz and /readyz on this port.")),
    _option("metrics_host", str, typer.Option(DEFAULTS["metrics_host"], "--metrics-host", envvar="DECIDER_METRICS_HOST", help="Address the --metrics-port server listens on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface, for a scraper on another host or container).")),
    _option("log_level", str, typer.Option("info", "--log-level", envvar="DECIDER_LOG_LEVEL", help="debug, info, warning or error.")),
    _option("log_format", str, typer.Option("human", "--log-format", envvar="DECIDER_LOG_FORMAT", help="human, or json: one JSON object a line.")),
    _option("states_topic", str, StatesTopicOpt),
    _option("schemas_topic", str, SchemasTopicOpt),
    _option("dead_letter_topic", str, DeadLetterTopicOpt),
    # Users' own events in (worker.formats.input_mapping); the config file's [input] table holds the same keys.
    _option("input_format", str, typer.Option(
        DEFAULT_INPUT.format, "--input-format", envvar="DECIDER_INPUT_FORMAT",
        help="How the states topic's records read: decider (its StateEvent Avro), json (a UTF-8 JSON object), avro-registry "
             "(Confluent wire format, decoded through --schema-registry-url) or text (the value is the state text).")),
    _option("id_field", Optional[str], typer.Option(None, "--id-field", envvar="DECIDER_INPUT_ID_FIELD", help="Dotted path of the state id (a string or an integer; default: the record key).")),
    _option("text_field", Optional[str], typer.Option(None, "--text-field", envvar="DECIDER_INPUT_TEXT_FIELD", help="Dotted path of the text to score (or --text-template).")),
    _option("text_template", Optional[str], typer.Option(
        None, "--text-template", envvar="DECIDER_INPUT_TEXT_TEMPLATE",
        help="The text to score, with {dotted.path} placeholders ({{ and }} for braces; \\n a newline, \\t a tab).")),
    _option("schema_id_field", Optional[str], typer.Option(None, "--schema-id-field", envvar="DECIDER_INPUT_SCHEMA_ID_FIELD", help="Dotted path of the question schema's id, read per record.")),
    _option("schema_id", Optional[str], typer.Option(
        None, "--schema-id", envvar="DECIDER_INPUT_SCHEMA_ID",
        help="The question schema of every record that has no decider-schema-id header (json, avro-registry, text).")),
    _option("event_time_field", Optional[str], typer.Option(None, "--event-time-field", envvar="DECIDER_INPUT_EVENT_TIME_FIELD", help="Dotted path of the event time: epoch ms or ISO 8601 (default: the record timestamp).")),
    _option("metadata_fields", Optional[str], typer.Option(None, "--metadata-fields", envvar="DECIDER_INPUT_METADATA_FIELDS", help="Comma-separated dotted paths copied into the output record's metadata.")),
    _option("propagate_headers", str, typer.Option(
        ",".join(DEFAULT_INPUT.propagate_headers), "--propagate-headers", envvar="DECIDER_PROPAGATE_HEADERS",
        help="Comma-separated headers copied from each input record to its output record (empty: none).")),
    # Output formats and the Schema Registry (worker.formats.output_formats, worker.formats.registry).
    _option("output_format", str, typer.Option(
        DEFAULTS["output_format"], "--output-format", envvar="DECIDER_OUTPUT_FORMAT",
        help="avro (schemaless, schemas/*.avsc), avro-registry (Confluent wire format, subject <topic>-value) or json; "
             "for probability records and dead letters alike.")),
    _option("schema_registry_url", Optional[str], typer.Option(
        None, "--schema-registry-url", envvar="DECIDER_SCHEMA_REGISTRY_URL",
        help="Schema Registry URL, for avro-registry input or output; client settings in the config file's [schema_registry].")),
    _option("auto_register", bool, typer.Option(
        True, "--auto-register/--no-auto-register", envvar="DECIDER_AUTO_REGISTER",
        help="Register decider's output schemas at start (default), or only check that the subjects hold them.")),
]


# `decider worker --help` and `decider replay --help` group their ~40 options in these sections, in this order; an
# option not named here (the command's own) stays under "Options", first. The table, not typer's rich_help_panel, says
# where an option goes: the options are shared objects (BootstrapOpt, ...), and a panel set on one for the worker
# showed in every other command's help too.
PANELS = {
    "Kafka": ("--bootstrap", "--worker-id", "--group", "--group-protocol", "--name", "--states-topic", "--schemas-topic",
              "--probabilities-topic", "--dead-letter-topic", "--output-topic", "--session-timeout-ms",
              "--transaction-timeout-ms", "--transactional-ids", "--commit-linger-ms", "--broker-outage-s"),
    "Model": ("--model", "--device", "--dtype", "--deterministic", "--tokenizer-threads", "--warmup-state-tokens",
              "--schema-memory-mb"),
    "Batching": ("--max-batch", "--max-wait-ms", "--latency-budget-ms", "--unpadded-batches", "--schema-wait-ms",
                 "--max-state-chars"),
    "Your own topic (input mapping)": ("--input-format", "--id-field", "--text-field", "--text-template", "--schema-id",
                                       "--schema-id-field", "--event-time-field", "--metadata-fields",
                                       "--propagate-headers"),
    "Output format": ("--output-format", "--schema-registry-url", "--auto-register"),
    "Operations": ("--metrics-port", "--metrics-host", "--stall-after-s", "--log-level", "--log-format"),
}
_PANEL_OF = {flag: panel for panel, flags in PANELS.items() for flag in flags}

HELP_MAX_WIDTH = 140
"""``--help`` wraps at the terminal's width (``COLUMNS``, else the terminal's; 80 when there is none), up to this: wider
lines are hard to read."""


def help_width() -> int:
    """The width ``--help`` wraps at (click's own default is 80 columns whatever the terminal)."""
    import shutil

    return min(shutil.get_terminal_size().columns, HELP_MAX_WIDTH)


class PanelledCommand(TyperCommand):
    """A command whose ``--help`` has a section per panel of ``PANELS`` (plain text, as every command's: the app turns
    typer's rich help off).

    typer's rich help drew every panel as a table of seven columns (required, flag, short flag, negative flag, ...): at
    80 columns ``decider worker --help`` left its descriptions ~15 characters and cut environment variable names
    (``DECIDER_BOOTSTR…``), and it labelled flags, which take no value, ``<bool>``. Plain text gives the description
    the rest of the line, wraps the flag onto its own line when it is long and never cuts a word."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        panels: dict[str, list[tuple[int, tuple[str, str]]]] = {"Options": []}
        panels.update((name, []) for name in PANELS)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            flag = next((opt for opt in param.opts if opt.startswith("--")), "")
            panel = _PANEL_OF.get(flag, "Options")
            order = PANELS[panel].index(flag) if panel in PANELS else len(panels[panel])
            panels[panel].append((order, record))
        for name, records in panels.items():
            if records:
                with formatter.section(name):
                    formatter.write_dl([record for _order, record in sorted(records, key=lambda item: item[0])])


def loop_options(command: Callable) -> Callable:
    """Add ``LOOP_OPTIONS`` to ``command``'s options; their values reach it as one dict, ``loop_flags``."""
    names = [p.name for p in LOOP_OPTIONS]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        return command(*args, loop_flags={name: kwargs.pop(name) for name in names}, **kwargs)

    own = [p for p in inspect.signature(command).parameters.values() if p.name != "loop_flags"]
    wrapper.__signature__ = inspect.Signature(own + LOOP_OPTIONS)
    wrapper.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "loop_flags"},
                               **{p.name: p.annotation for p in LOOP_OPTIONS}}
    return wrapper


def kafka_settings(ctx: typer.Context | None) -> Mapping[str, Any]:
    """The config file's [kafka] table (``main`` hands the loaded file to every command as ``ctx.obj``)."""
    return ctx.obj.kafka if ctx is not None and ctx.obj is not None else {}


def cluster(ctx: typer.Context, bootstrap: str) -> Cluster:
    """The cluster at ``bootstrap`` with the config file's client settings."""
    return Cluster(bootstrap, kafka_settings(ctx))


def loop_config(ctx: typer.Context, flags: dict[str, Any], probabilities_topic: str, **own: Any) -> WorkerConfig:
    """The configuration of a loop (worker or replay), from its flags (environment and file included) and the
    config file's [kafka] table; sets up logging first, and checks the model directory last."""
    from worker.ops.logs import setup_logging

    setup_logging(flags["log_level"], flags["log_format"])
    config = WorkerConfig(
        bootstrap=flags["bootstrap"], model_dir=flags["model"], device=flags["device"], dtype=flags["dtype"],
        deterministic=flags["deterministic"],
        topics=Topics(states=flags["states_topic"], schemas=flags["schemas_topic"], probabilities=probabilities_topic,
                      dead_letter=flags["dead_letter_topic"]),
        schema_wait_ms=flags["schema_wait_ms"], max_state_chars=flags["max_state_chars"],
        schema_memory_mb=flags["schema_memory_mb"], tokenizer_threads=flags["tokenizer_threads"],
        warmup_state_tokens=_token_counts(flags["warmup_state_tokens"]),
        transaction_timeout_ms=flags["transaction_timeout_ms"], transactional_ids=flags["transactional_ids"],
        commit_linger_ms=flags["commit_linger_ms"],
        broker_outage_s=flags["broker_outage_s"],
        stall_after_s=flags["stall_after_s"],
        metrics_port=flags["metrics_port"], metrics_host=flags["metrics_host"], kafka=kafka_settings(ctx), **own,
        input=input_mapping(ctx, flags), output_format=flags["output_format"],
        registry=registry_config(ctx, flags["schema_registry_url"], flags["auto_register"]),
    )
    check_model_dir(config.model_dir)
    return config


def check_model_dir(model_dir: str) -> None:
    """``ConfigError`` when ``model_dir`` cannot be a model directory: checked before anything loads, since importing
    torch alone takes seconds."""
    path = Path(model_dir)
    if not path.is_dir():
        what = "a file, not a directory" if path.exists() else "no such directory"
        raise ConfigError(f"--model {model_dir}: {what}; give a local Hugging Face model directory (Qwen3.5 family)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {model_dir}: cannot load the model from {model_dir}: it has no config.json, so it is "
                          "not a Hugging Face model directory")


def registry_settings(ctx: typer.Context | None) -> Mapping[str, Any]:
    """The config file's [schema_registry] table."""
    return ctx.obj.schema_registry if ctx is not None and ctx.obj is not None else {}


def registry_config(ctx: typer.Context | None, url: str | None, auto_register: bool = True) -> RegistryConfig | None:
    """The Schema Registry at ``url`` with the config file's client settings (None without a URL)."""
    return RegistryConfig(url, registry_settings(ctx), auto_register) if url else None


def input_mapping(ctx: typer.Context | None, flags: Mapping[str, Any]) -> InputMapping:
    """The input mapping of a loop's flags. A --text-template typed in a shell (or the environment) gets its
    \\n and \\t turned into a newline and a tab; the config file's TOML strings have their own escapes."""
    template = flags["text_template"]
    if template is not None and ctx is not None and ctx.get_parameter_source("text_template").name in ("COMMANDLINE", "ENVIRONMENT"):
        template = unescape_flag_template(template)
    return InputMapping(
        format=flags["input_format"], id_field=flags["id_field"], text_field=flags["text_field"], text_template=template,
        schema_id_field=flags["schema_id_field"], schema_id=flags["schema_id"], event_time_field=flags["event_time_field"],
        metadata_fields=split_list(flags["metadata_fields"] or "", "--metadata-fields"),
        propagate_headers=split_list(flags["propagate_headers"], "--propagate-headers"))


def _token_counts(value: str) -> tuple[int, ...]:
    """'96, 128' -> (96, 128); exit 2 naming the option on anything else."""
    try:
        return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(f"--warmup-state-tokens {value!r}: expected comma-separated whole numbers, e.g. 128,256") from None


