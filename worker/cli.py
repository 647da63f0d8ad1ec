"""The ``decider`` command line. Every option also reads a ``DECIDER_*`` environment variable.

Errors a user can fix (unreachable broker, missing topic, bad model path, bad file) print one
``error: ...`` line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import typer
from confluent_kafka import KafkaException

try:
    from typer._click import exceptions as click_errors  # typer >= 0.24 carries its own copy of click
except ImportError:
    from click import exceptions as click_errors

from worker.config import (DEFAULT_DEAD_LETTER_TOPIC, DEFAULT_GROUP, DEFAULT_PROBABILITIES_TOPIC, DEFAULT_SCHEMAS_TOPIC,
                           DEFAULT_STATES_TOPIC, Topics, WorkerConfig)
from worker.exceptions import ConfigError, DeciderError, FatalError

app = typer.Typer(
    name="decider",
    help="Ask an LLM a fixed set of multiple-choice questions about every event of a Kafka stream, exactly once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
topics_app = typer.Typer(help="Manage decider's topics.", no_args_is_help=True)
schema_app = typer.Typer(help="Publish or delete question schemas.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")
app.add_typer(schema_app, name="schema")

# ---- shared options -----------------------------------------------------------------------------------------
BootstrapOpt = typer.Option(..., "-b", "--bootstrap", envvar="DECIDER_BOOTSTRAP", help="Kafka bootstrap servers, host:port[,host:port].")
StatesTopicOpt = typer.Option(DEFAULT_STATES_TOPIC, "--states-topic", envvar="DECIDER_STATES_TOPIC", help="Topic of state events.")
SchemasTopicOpt = typer.Option(DEFAULT_SCHEMAS_TOPIC, "--schemas-topic", envvar="DECIDER_SCHEMAS_TOPIC", help="Compacted topic of question schemas.")
ProbabilitiesTopicOpt = typer.Option(DEFAULT_PROBABILITIES_TOPIC, "--probabilities-topic", envvar="DECIDER_PROBABILITIES_TOPIC", help="Output topic of probability records.")
DeadLetterTopicOpt = typer.Option(DEFAULT_DEAD_LETTER_TOPIC, "--dead-letter-topic", envvar="DECIDER_DEAD_LETTER_TOPIC", help="Output topic of dead letters.")


def friendly_errors(command: Callable) -> Callable:
    """Turn the worker's named errors and Kafka errors into one line on stderr and an exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FatalError as exc:
            typer.echo(_redacted(f"error: {exc}"), err=True)
            raise typer.Exit(exc.exit_code) from None
        except DeciderError as exc:
            typer.echo(_redacted(f"error: {exc}"), err=True)
            raise typer.Exit(1) from None
        except KafkaException as exc:
            typer.echo(_redacted(f"error: Kafka: {exc.args[0].str() if exc.args else exc}"), err=True)
            raise typer.Exit(4) from None

    return wrapper


def _redacted(text: str) -> str:
    """``text`` without any secret of the config file's [kafka] table."""
    from worker.kafka_clients import client_settings
    from worker.settings import redact_text

    return redact_text(text, client_settings())


def _topics(states: str, schemas: str, probabilities: str, dead_letter: str) -> Topics:
    return Topics(states=states, schemas=schemas, probabilities=probabilities, dead_letter=dead_letter)


def _setup_logging(level: str, fmt: str = "human") -> None:
    from worker.logs import setup_logging

    setup_logging(level, fmt)


def _stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT set the returned flag; the loop then drains and exits cleanly."""
    stop = threading.Event()

    def request_stop(signum, _frame):
        logging.getLogger("decider").info("%s received: finishing the open batch and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # kill -USR1 <pid> prints every thread's stack to stderr: where a stuck worker is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


ModelOpt = typer.Option(..., "--model", envvar="DECIDER_MODEL", help="Local Hugging Face model directory (Qwen3.5 family).")
DeviceOpt = typer.Option("cpu", "--device", envvar="DECIDER_DEVICE", help="cpu, cuda or cuda:N.")
DtypeOpt = typer.Option(None, "--dtype", envvar="DECIDER_DTYPE", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA).")
SchemaWaitOpt = typer.Option(10_000, "--schema-wait-ms", envvar="DECIDER_SCHEMA_WAIT_MS", help="How long a state naming an unknown schema waits before it is dead-lettered.")
MaxStateCharsOpt = typer.Option(32_768, "--max-state-chars", envvar="DECIDER_MAX_STATE_CHARS", help="Longer states are dead-lettered (state_too_large).")
TokenizerThreadsOpt = typer.Option(2, "--tokenizer-threads", envvar="DECIDER_TOKENIZER_THREADS", min=1, help="Threads tokenizing states off the GPU thread.")
TransactionTimeoutOpt = typer.Option(30_000, "--transaction-timeout-ms", envvar="DECIDER_TRANSACTION_TIMEOUT_MS", help="Broker-side timeout of an open transaction.")
LogLevelOpt = typer.Option("info", "--log-level", envvar="DECIDER_LOG_LEVEL", help="debug, info, warning or error.")
MetricsHostOpt = typer.Option("127.0.0.1", "--metrics-host", envvar="DECIDER_METRICS_HOST", help="Address the --metrics-port server listens on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface, for a scraper on another host or container).")
LogFormatOpt = typer.Option("human", "--log-format", envvar="DECIDER_LOG_FORMAT", help="human, or json: one JSON object a line.")
WarmupOpt = typer.Option(
    "", "--warmup-state-tokens", envvar="DECIDER_WARMUP_STATE_TOKENS",
    help="Comma-separated state lengths in tokens (e.g. 96,128,192). On CUDA, when a schema version is prepared, "
         "capture its graphs for every batch size up to --max-batch at these lengths before its first batch, instead "
         "of one at a time as batches of new sizes arrive (each capture briefly stalls the stream). ~0.1-0.5 s a "
         "graph, once per schema version. Default: capture on first sight.")


def _require_model_dir(model: str) -> None:
    if not Path(model).is_dir():
        raise FatalError(f"--model {model}: no such directory", exit_code=2)


def _token_counts(value: str) -> tuple[int, ...]:
    """'96, 128' -> (96, 128); exit 2 naming the option on anything else."""
    try:
        return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(f"--warmup-state-tokens {value!r}: expected comma-separated whole numbers, e.g. 128,256") from None


# ---- commands -----------------------------------------------------------------------------------------------
@topics_app.command("create")
@friendly_errors
def topics_create(
    ctx: typer.Context,
    bootstrap: str = BootstrapOpt,
    partitions: int = typer.Option(4, "--partitions", envvar="DECIDER_PARTITIONS", min=1, help="Partitions of the states, probabilities and dead-letter topics (the schemas topic has 1)."),
    replication_factor: int = typer.Option(1, "--replication-factor", envvar="DECIDER_REPLICATION_FACTOR", help="Replication factor of every topic."),
    states_topic: str = StatesTopicOpt,
    schemas_topic: str = SchemasTopicOpt,
    probabilities_topic: str = ProbabilitiesTopicOpt,
    dead_letter_topic: str = DeadLetterTopicOpt,
) -> None:
    """Create the four topics (idempotent; the schemas topic is compacted). Existing topics are never changed:
    exit code 2 if one has fewer partitions than a --partitions given explicitly (flag, environment or config file)."""
    from worker.kafka_clients import create_topics, require_topics

    topics = _topics(states_topic, schemas_topic, probabilities_topic, dead_letter_topic)
    outcomes = create_topics(bootstrap, topics, partitions, replication_factor)
    existing = require_topics(bootstrap, [name for name, outcome in outcomes.items() if outcome == "exists"])
    for name, outcome in outcomes.items():
        count = existing.get(name)
        typer.echo(f"{name}: {outcome}" + ("" if count is None else f" ({count} partition{'' if count == 1 else 's'})"))
    if ctx.get_parameter_source("partitions").name != "DEFAULT":
        _require_partitions(topics, existing, partitions)


def _require_partitions(topics: Topics, existing: dict[str, int], requested: int) -> None:
    """ConfigError if a states/output topic that already existed has fewer partitions than requested."""
    short = {name: existing[name] for name in (topics.states, topics.probabilities, topics.dead_letter)
             if existing.get(name, requested) < requested}
    if short:
        have = ", ".join(f"{name} has {count}" for name, count in short.items())
        raise ConfigError(f"--partitions {requested}: {have}; existing topics keep their partitions (add some with "
                          f"kafka-topics.sh --alter --partitions {requested}, which moves keys to other partitions, or "
                          "delete and re-create the topics)")


@schema_app.command("put")
@friendly_errors
def schema_put(
    file: Path = typer.Argument(..., help='Schema file: {"mode": "packed", "questions": [{"id", "question", "options", "temperature"?}, ...]}.'),
    schema_id: str = typer.Option(..., "--id", envvar="DECIDER_SCHEMA_ID", help="Schema id (the record key)."),
    version: Optional[int] = typer.Option(None, "--version", help="Explicit version; default: the latest published version + 1."),
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Publish a question schema as a new version of ID."""
    from worker.clients import put_schema

    record = put_schema(bootstrap, Topics(schemas=schemas_topic), schema_id, file, version)
    typer.echo(f"schema {schema_id} version {record['version']} published ({len(record['questions'])} questions)")


@schema_app.command("delete")
@friendly_errors
def schema_delete(
    schema_id: str = typer.Option(..., "--id", envvar="DECIDER_SCHEMA_ID", help="Schema id to delete."),
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Delete a schema (tombstone); later states naming it go to the dead-letter topic."""
    from worker.clients import delete_schema

    delete_schema(bootstrap, Topics(schemas=schemas_topic), schema_id)
    typer.echo(f"schema {schema_id} deleted")


@app.command("produce")
@friendly_errors
def produce(
    file: Path = typer.Argument(..., help='States file, JSON lines: {"id": "...", "state": "...", "metadata": {...}?} ("-" for stdin).'),
    schema_id: str = typer.Option(..., "--schema-id", envvar="DECIDER_SCHEMA_ID", help="Schema to ask about every state."),
    bootstrap: str = BootstrapOpt,
    states_topic: str = StatesTopicOpt,
) -> None:
    """Publish states (keyed by state id) to the states topic."""
    from worker.clients import produce_states, read_state_lines

    count = produce_states(bootstrap, Topics(states=states_topic), read_state_lines(file, schema_id))
    typer.echo(f"{count} states published to {states_topic}")


@app.command("worker")
@friendly_errors
def worker(
    bootstrap: str = BootstrapOpt,
    model: str = ModelOpt,
    device: str = DeviceOpt,
    worker_id: str = typer.Option(..., "--worker-id", envvar="DECIDER_WORKER_ID", help="Stable id of this worker; its transactional id derives from it. Restart with the same id after a crash."),
    group: str = typer.Option(DEFAULT_GROUP, "--group", envvar="DECIDER_GROUP", help="Consumer group shared by the workers."),
    max_batch: int = typer.Option(32, "--max-batch", envvar="DECIDER_MAX_BATCH", help="A batch closes at this many states..."),
    max_wait_ms: int = typer.Option(50, "--max-wait-ms", envvar="DECIDER_MAX_WAIT_MS", help="...or this long after its first state."),
    schema_wait_ms: int = SchemaWaitOpt,
    max_state_chars: int = MaxStateCharsOpt,
    schema_memory_mb: float = typer.Option(2048.0, "--schema-memory-mb", envvar="DECIDER_SCHEMA_MEMORY_MB", help="Device memory budget for prepared schemas; least recently used ones are released beyond it."),
    dtype: Optional[str] = DtypeOpt,
    tokenizer_threads: int = TokenizerThreadsOpt,
    warmup_state_tokens: str = WarmupOpt,
    transaction_timeout_ms: int = TransactionTimeoutOpt,
    session_timeout_ms: int = typer.Option(10_000, "--session-timeout-ms", envvar="DECIDER_SESSION_TIMEOUT_MS", help="Consumer group session timeout."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", envvar="DECIDER_METRICS_PORT", min=1, max=65535, help="Serve Prometheus metrics on this port."),
    metrics_host: str = MetricsHostOpt,
    log_level: str = LogLevelOpt,
    log_format: str = LogFormatOpt,
    states_topic: str = StatesTopicOpt,
    schemas_topic: str = SchemasTopicOpt,
    probabilities_topic: str = ProbabilitiesTopicOpt,
    dead_letter_topic: str = DeadLetterTopicOpt,
) -> None:
    """Run the exactly-once stream processor (one per GPU). SIGTERM/SIGINT stop it cleanly.

    Exit codes: 0 stopped cleanly, 1 fatal error, 2 bad configuration or model, 3 fenced by another worker with the same --worker-id, 4 broker unreachable or topic missing, 5 a Kafka call hung (restart it).
    """
    _setup_logging(log_level, log_format)
    config = WorkerConfig(
        bootstrap=bootstrap, model_dir=model, worker_id=worker_id, device=device, dtype=dtype, group=group,
        topics=_topics(states_topic, schemas_topic, probabilities_topic, dead_letter_topic),
        max_batch=max_batch, max_wait_ms=max_wait_ms, schema_wait_ms=schema_wait_ms, max_state_chars=max_state_chars,
        schema_memory_mb=schema_memory_mb, tokenizer_threads=tokenizer_threads,
        warmup_state_tokens=_token_counts(warmup_state_tokens),
        transaction_timeout_ms=transaction_timeout_ms, session_timeout_ms=session_timeout_ms, metrics_port=metrics_port,
    )
    _require_model_dir(model)
    from worker.loop import Worker

    _run_logged(lambda on_event: Worker(config, stop=_stop_on_signals(), on_event=on_event).run(), metrics_port, metrics_host)


def _run_logged(run: Callable, metrics_port: Optional[int], metrics_host: str = "127.0.0.1") -> None:
    """Run a loop with its events logged, counted in the metrics and driving /readyz; log a fatal end."""
    from worker import logs, metrics
    from worker.kafka_clients import client_settings
    from worker.settings import redact

    health = None
    if metrics_port:
        from worker.health import Health, serve

        health = Health()
        serve(metrics_port, health, metrics_host)
    if client_settings():
        logging.getLogger("decider").info("kafka client settings from the config file: %s", redact(client_settings()))
    sinks = [logs.log_event, metrics.on_event] + ([health.on_event] if health else [])

    def on_event(kind: str, info: dict) -> None:
        for sink in sinks:
            sink(kind, info)

    try:
        run(on_event)
    except FatalError as exc:
        kind = "fenced" if exc.exit_code == 3 else "fatal"
        logs.log_fatal(kind, _redacted(str(exc)), exc.exit_code)
        raise


@app.command("replay")
@friendly_errors
def replay(
    bootstrap: str = BootstrapOpt,
    model: str = ModelOpt,
    name: str = typer.Option(..., "--name", envvar="DECIDER_REPLAY_NAME", help="Name of this replay: its progress is committed under group decider-replay.NAME; rerun with the same name to resume."),
    output_topic: str = typer.Option(..., "--output-topic", envvar="DECIDER_REPLAY_OUTPUT_TOPIC", help="Topic the probability records go to."),
    dead_letter_topic: str = DeadLetterTopicOpt,
    states_topic: str = StatesTopicOpt,
    schemas_topic: str = SchemasTopicOpt,
    from_offset: Optional[str] = typer.Option(None, "--from-offset", help="First offset: N for every partition, or P:N[,P:N] (default: each partition's oldest)."),
    from_time: Optional[str] = typer.Option(None, "--from-time", help="First record at or after this time: ISO 8601 (UTC unless a zone is given) or epoch ms."),
    to_offset: Optional[str] = typer.Option(None, "--to-offset", help="End offset, exclusive: N or P:N[,P:N] (default: the partition's end at the first run)."),
    to_time: Optional[str] = typer.Option(None, "--to-time", help="End before the first record at or after this time."),
    partitions: Optional[str] = typer.Option(None, "--partitions", help="Comma-separated partitions to replay (default: all)."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    max_batch: int = typer.Option(64, "--max-batch", envvar="DECIDER_MAX_BATCH", help="States per batch; a replay always waits for full batches."),
    schema_wait_ms: int = SchemaWaitOpt,
    max_state_chars: int = MaxStateCharsOpt,
    schema_memory_mb: float = typer.Option(2048.0, "--schema-memory-mb", envvar="DECIDER_SCHEMA_MEMORY_MB", help="Device memory budget for prepared schemas."),
    tokenizer_threads: int = TokenizerThreadsOpt,
    warmup_state_tokens: str = WarmupOpt,
    transaction_timeout_ms: int = TransactionTimeoutOpt,
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", envvar="DECIDER_METRICS_PORT", min=1, max=65535, help="Serve /metrics, /healthz and /readyz on this port."),
    metrics_host: str = MetricsHostOpt,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar with rate and ETA on stderr."),
    log_level: str = LogLevelOpt,
    log_format: str = LogFormatOpt,
) -> None:
    """Score a historical range of the states topic (offsets or timestamps) into --output-topic, exactly once.

    Resumable: after a kill, the same command (same --name) continues from the committed offsets and stops at
    the end offsets stored by the first run. Exit codes as for worker, plus 6: stopped before the end (rerun to resume).
    """
    from worker.config import WorkerConfig
    from worker.replay import Bound, ReplayWorker, replay_group, run_replay

    _setup_logging(log_level, log_format)
    config = WorkerConfig(
        bootstrap=bootstrap, model_dir=model, worker_id=name, device=device, dtype=dtype, group=replay_group(name),
        topics=_topics(states_topic, schemas_topic, output_topic, dead_letter_topic),
        max_batch=max_batch, max_wait_ms=0, schema_wait_ms=schema_wait_ms, max_state_chars=max_state_chars,
        schema_memory_mb=schema_memory_mb, tokenizer_threads=tokenizer_threads,
        warmup_state_tokens=_token_counts(warmup_state_tokens),
        transaction_timeout_ms=transaction_timeout_ms, metrics_port=metrics_port,
    )
    _require_model_dir(model)
    try:
        chosen = [int(p) for p in partitions.split(",")] if partitions else None
    except ValueError:
        raise FatalError(f"--partitions {partitions!r}: expected comma-separated partition numbers", exit_code=2) from None
    start, end = Bound.parse(from_offset, from_time, "from"), Bound.parse(to_offset, to_time, "to")
    summary: dict = {}

    def run(on_event) -> None:
        worker = ReplayWorker(config, start, end, chosen, stop=_stop_on_signals(), on_event=on_event)
        summary.update(run_replay(worker, progress=progress, write=lambda line: typer.echo(line, err=True)))

    _run_logged(run, metrics_port, metrics_host)
    if not summary.get("complete"):
        raise typer.Exit(6)


@app.command("tail")
@friendly_errors
def tail(
    bootstrap: str = BootstrapOpt,
    topic: str = typer.Option("probabilities", "--topic", envvar="DECIDER_TAIL_TOPIC", help="probabilities or dead-letter."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object a line (default: a short human-readable line)."),
    from_beginning: bool = typer.Option(False, "--from-beginning", help="Start at the oldest record instead of new ones."),
    max_records: Optional[int] = typer.Option(None, "--max", min=0, help="Stop after this many records."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0, help="Stop once no new record arrived for this many seconds."),
    probabilities_topic: str = ProbabilitiesTopicOpt,
    dead_letter_topic: str = DeadLetterTopicOpt,
) -> None:
    """Print committed output records (read_committed: aborted attempts never show)."""
    from worker import clients

    if topic not in ("probabilities", "dead-letter"):
        raise FatalError(f"--topic must be probabilities or dead-letter, not {topic!r}", exit_code=2)
    name = probabilities_topic if topic == "probabilities" else dead_letter_topic
    for record in clients.tail(bootstrap, name, topic, from_beginning, max_records, timeout):
        typer.echo(clients.json_line(record) if as_json else _summary(topic, record))
        sys.stdout.flush()


def _summary(topic: str, record: dict) -> str:
    if "undecodable" in record:
        return f"(undecodable record at {record['kafka']}: {record['undecodable']})"
    if topic == "dead-letter":
        return (f"{record['reason']:<20} state={record.get('state_id')} from {record['source_topic']}[{record['source_partition']}]"
                f"@{record['source_offset']}: {record['message']}")
    answers = "  ".join(
        f"{q['id']}=" + max(zip(q["probabilities"], q["options"]))[1] + f" ({max(q['probabilities']):.2f})" for q in record["questions"]
    )
    return f"{record['state_id']}  {record['schema_id']} v{record['schema_version']}  {answers}"


@app.command("broker")
@friendly_errors
def broker(
    port: int = typer.Option(9092, "--port", envvar="DECIDER_BROKER_PORT", min=1, max=65535, help="Kafka port to listen on (127.0.0.1)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", envvar="DECIDER_BROKER_DATA_DIR", help="Where the broker keeps its data (default: a temporary directory, deleted on exit). Not crash-durable: a kill -9 of the broker can lose acknowledged records."),
) -> None:
    """Run the embedded development broker (noida-db's Kafka) in the foreground; Ctrl-C stops it."""
    from worker.embedded_broker import EmbeddedBroker

    stop = _stop_on_signals()
    with EmbeddedBroker(port=port, data_dir=data_dir) as embedded:
        kept = "kept" if data_dir else "deleted on exit"
        typer.echo(f"embedded Kafka broker (pid {embedded.process.pid}) listening on {embedded.bootstrap}; data in "
                   f"{embedded.data_path} ({kept}; a development broker, not crash-durable); Ctrl-C stops it")
        typer.echo(f"next: decider topics create -b {embedded.bootstrap}")
        while not stop.wait(0.5):
            if embedded.process.poll() is not None:
                raise FatalError(f"the broker exited with code {embedded.process.returncode}")
    typer.echo("broker stopped")


@app.command("demo")
@friendly_errors
def demo(
    model: Optional[str] = typer.Option(None, "--model", envvar="DECIDER_MODEL", help="Model directory (default: a tiny random model written to a temp dir: the numbers are meaningless, the pipeline is real)."),
    port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="Port of the embedded broker (default: a free one)."),
    records_shown: int = typer.Option(3, "--show", help="How many decoded records to print."),
) -> None:
    """Run the whole pipeline locally: embedded broker, topics, schema, states, a CPU worker, the records."""
    from worker.demo import run_demo

    run_demo(model_dir=model, port=port, records_shown=records_shown)


@app.command("score")
@friendly_errors
def score(
    model: str = ModelOpt,
    schema: Path = typer.Option(..., "--schema", help='Schema file: {"mode"?: "packed"|"independent", "questions": [{"id", "question", "options", "temperature"?}]}.'),
    states: Path = typer.Option(..., "--states", help='States file, one JSON object a line: {"id": "...", "state": "..."} (- reads stdin).'),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    schema_id: Optional[str] = typer.Option(None, "--schema-id", help="schema_id written in the output (default: the schema file's name)."),
    batch_size: int = typer.Option(32, "--batch-size", help="States scored per forward pass."),
) -> None:
    """Score states offline, no Kafka: one JSON line of probabilities per state, for trying a schema and a model."""
    from worker.offline import score_file, write_scores

    write_scores(score_file(model, schema, states, device, dtype, schema_id, batch_size), sys.stdout)


@app.callback()
def _root(
    config: Optional[Path] = typer.Option(None, "--config", envvar="DECIDER_CONFIG", help="TOML file of settings (flag > environment > file > default); see README, Configuration."),
) -> None:
    """Ask an LLM a fixed set of multiple-choice questions about every event of a Kafka stream, exactly once."""
    # --config is taken out of the arguments by main() before parsing (the file supplies the parse's
    # defaults); declared here so that --help shows it.


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the ``decider`` console script: read the config file (if any), then run the command."""
    import os

    from worker.kafka_clients import use_client_settings
    from worker.settings import load_config_file, split_config_flag

    try:
        path, args = split_config_flag(sys.argv[1:] if argv is None else argv, os.environ)
        file_config = load_config_file(path, typer.main.get_command(app)) if path is not None else None
    except FatalError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if file_config is not None:
        use_client_settings(file_config.kafka)
    sys.exit(_run_command(args, file_config.default_map if file_config else None))


def _run_command(args: list[str], default_map: Optional[dict]) -> int:
    """Run the command line; -> its exit code. A mistake on the command line itself (an unknown option, a value
    of the wrong type or out of range) is one line on stderr and exit code 2, like every other user error."""
    try:
        outcome = app(args=args, default_map=default_map, prog_name="decider", standalone_mode=False)
    except getattr(click_errors, "NoArgsIsHelpError", ()) as exc:  # a bare "decider" or group: the help
        exc.show()
        return exc.exit_code
    except click_errors.UsageError as exc:
        where = f"; see {exc.ctx.command_path} --help" if exc.ctx is not None else ""
        typer.echo(f"error: {' '.join(exc.format_message().split()).rstrip('.')}{where}", err=True)
        return 2
    except click_errors.ClickException as exc:
        exc.show()
        return exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 1
    return outcome if isinstance(outcome, int) else 0


if __name__ == "__main__":
    main()
