"""The ``decider`` command line. Every option also reads a ``DECIDER_*`` environment variable, and the config file.

Errors a user can fix (unreachable broker, missing topic, bad model path, bad file) print one
``error: ...`` line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

try:
    from typer._click import exceptions as click_errors  # typer >= 0.24 carries its own copy of click
except ImportError:
    from click import exceptions as click_errors

from worker.cli.calibration import calibrate
from worker.cli.errors import friendly_errors
from worker.cli.schema_app import schema_app
from worker.cli.options import (DEFAULTS, PanelledCommand, help_width, BootstrapOpt, DeadLetterTopicOpt, DeterministicOpt, DeviceOpt, DtypeOpt, ModelOpt, ProbabilitiesTopicOpt,
                                SchemasTopicOpt, StatesTopicOpt, cluster, loop_config, loop_options,
                                registry_config)
from worker.config import MAX_LATENCY_BUDGET_MS, REPLAY_MAX_BATCH, Topics
from worker.exceptions import ConfigError, FatalError
from worker.ops.wording import counted

app = typer.Typer(
    name="decider",
    help="Ask an LLM a fixed set of multiple-choice questions about every event of a Kafka stream, exactly once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain-text --help, at the terminal's width (worker.cli.options.PanelledCommand says why)
)
topics_app = typer.Typer(help="Manage decider's topics.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(topics_app, name="topics")
app.add_typer(schema_app, name="schema")


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

    topics = Topics(states=states_topic, schemas=schemas_topic, probabilities=probabilities_topic, dead_letter=dead_letter_topic)
    brokers = cluster(ctx, bootstrap)
    outcomes = create_topics(brokers, topics, partitions, replication_factor)
    existing = require_topics(brokers, [name for name, outcome in outcomes.items() if outcome == "exists"])
    for name, outcome in outcomes.items():
        count = existing.get(name)
        typer.echo(f"{name}: {outcome}" + ("" if count is None else f" ({counted(count, 'partition')})"))
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


@app.command("produce")
@friendly_errors
def produce(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help='States file, JSON lines: {"id": "...", "state": "...", "metadata": {...}?} ("-" for stdin).'),
    schema_id: str = typer.Option(..., "--schema-id", envvar="DECIDER_SCHEMA_ID", help="Schema to ask about every state; the schemas topic must hold it (or --force)."),
    force: bool = typer.Option(False, "--force", help="Publish even if the schemas topic does not hold --schema-id (workers dead-letter such states as unknown_schema once --schema-wait-ms passes)."),
    bootstrap: str = BootstrapOpt,
    states_topic: str = StatesTopicOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Publish states (keyed by state id) to the states topic.

    Exit codes: 0 published (a file without a state publishes nothing, with a warning on stderr: an empty batch is no
    mistake in a pipeline), 2 a mistake in the file or a --schema-id the schemas topic does not hold (nothing is
    published), 4 broker or topic unavailable."""
    from worker.cli.commands import produce_states, require_schema
    from worker.cli.user_files import no_states_warning, read_state_lines
    from worker.kafka_clients import require_topics

    states = read_state_lines(file, schema_id)
    if not states:
        typer.echo(no_states_warning(file, "nothing published"), err=True)
        return
    topics = Topics(states=states_topic, schemas=schemas_topic)
    require_topics(cluster(ctx, bootstrap), [states_topic], roles=topics)  # a missing topic first: exit code 4
    if not force:
        require_schema(cluster(ctx, bootstrap), topics, schema_id,
                       f"publish it first (decider schema put --id {schema_id} FILE), or pass --force")
    count = produce_states(cluster(ctx, bootstrap), topics, states)
    typer.echo(f"{counted(count, 'state')} published to {states_topic}")


@app.command("worker", cls=PanelledCommand)
@friendly_errors
@loop_options
def worker(
    ctx: typer.Context,
    loop_flags: dict,
    worker_id: str = typer.Option(..., "--worker-id", envvar="DECIDER_WORKER_ID", help="Stable id of this worker; its transactional id derives from it. Restart with the same id after a crash."),
    group: str = typer.Option(DEFAULTS["group"], "--group", envvar="DECIDER_GROUP", help="Consumer group shared by the workers."),
    max_batch: int = typer.Option(DEFAULTS["max_batch"], "--max-batch", envvar="DECIDER_MAX_BATCH", help="A batch closes at this many states, counting every schema's (they score as one GPU batch), or at --max-wait-ms."),
    max_wait_ms: int = typer.Option(DEFAULTS["max_wait_ms"], "--max-wait-ms", envvar="DECIDER_MAX_WAIT_MS", help="...or this long after its first state."),
    latency_budget_ms: Optional[int] = typer.Option(
        None, "--latency-budget-ms", envvar="DECIDER_LATENCY_BUDGET_MS", min=1, max=MAX_LATENCY_BUDGET_MS,
        help="Make each state's record visible to read_committed readers within this many ms of its arrival: a batch "
             "closes as soon as the GPU can take it, so batches grow with the load, and under a load that needs "
             "larger batches it first gathers for as long as half the budget allows; misses are counted "
             "(docs/tuning.md, Latency budget). --max-wait-ms still caps the wait. Default: no budget."),
    unpadded_batches: bool = typer.Option(
        DEFAULTS["unpadded_batches"], "--unpadded-batches/--padded-batches", envvar="DECIDER_UNPADDED_BATCHES",
        help="A batch that closes while the one before it is still on the GPU launches only as many states as fill "
             "its CUDA graph's batch size (1-8, 10, 12, ..., 128), and the rest wait in the next batch: a padded row "
             "costs the GPU what a real one does (docs/tuning.md, Latency budget). Default: --unpadded-batches; "
             "--padded-batches launches every state at once."),
    group_protocol: Optional[str] = typer.Option(
        None, "--group-protocol", envvar="DECIDER_GROUP_PROTOCOL",
        help="classic (cooperative-sticky) or consumer (KIP-848, Kafka 4.0+). Default: consumer where the broker has "
             "it and no classic-only setting (--session-timeout-ms, [kafka] partition.assignment.strategy) is given."),
    session_timeout_ms: Optional[int] = typer.Option(
        None, "--session-timeout-ms", envvar="DECIDER_SESSION_TIMEOUT_MS", min=1,
        help="Consumer group session timeout, classic protocol (default 10000); the consumer protocol's is the broker's."),
    probabilities_topic: str = ProbabilitiesTopicOpt,
) -> None:
    """Run the exactly-once stream processor (one per GPU). SIGTERM/SIGINT stop it cleanly.

    Exit codes: 0 stopped cleanly, 1 fatal error, 2 bad configuration or model, 3 fenced by another worker with the same --worker-id, 4 broker unreachable or topic missing at start, 5 broker unreachable for longer than --broker-outage-s, or a Kafka call hung (restart it with the same --worker-id).
    """
    config = loop_config(ctx, loop_flags, probabilities_topic, worker_id=worker_id, group=group, max_batch=max_batch,
                          max_wait_ms=max_wait_ms, latency_budget_ms=latency_budget_ms,
                          unpadded_batches=unpadded_batches,
                          group_protocol=group_protocol, session_timeout_ms=session_timeout_ms)
    from worker.stream.loop import Worker
    from worker.cli.operated import run_logged, stop_on_signals

    run_logged(lambda on_event: Worker(config, stop=stop_on_signals(), on_event=on_event).run(), config)


@app.command("replay", cls=PanelledCommand)
@friendly_errors
@loop_options
def replay(
    ctx: typer.Context,
    loop_flags: dict,
    name: str = typer.Option(..., "--name", envvar="DECIDER_REPLAY_NAME", help="Name of this replay: its progress and range are committed under group decider-replay.NAME; rerun with the same name and range flags to resume (another range needs a new name)."),
    output_topic: str = typer.Option(..., "--output-topic", envvar="DECIDER_REPLAY_OUTPUT_TOPIC", help="Topic the probability records go to."),
    from_offset: Optional[str] = typer.Option(None, "--from-offset", help="First offset: N for every partition, or P:N[,P:N] (default: each partition's oldest)."),
    from_time: Optional[str] = typer.Option(None, "--from-time", help="First record at or after this time: ISO 8601 (UTC unless a zone is given) or epoch ms."),
    to_offset: Optional[str] = typer.Option(None, "--to-offset", help="End offset, exclusive: N or P:N[,P:N] (default: the partition's end at the first run)."),
    to_time: Optional[str] = typer.Option(None, "--to-time", help="End before the first record at or after this time."),
    partitions: Optional[str] = typer.Option(None, "--partitions", help="Comma-separated partitions to replay (default: all)."),
    max_batch: int = typer.Option(REPLAY_MAX_BATCH, "--max-batch", envvar="DECIDER_MAX_BATCH", help="States per batch; a replay always waits for full batches."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar with rate and ETA on stderr; meanwhile each transaction is logged at debug only."),
    verify_against: Optional[str] = typer.Option(None, "--verify-against", envvar="DECIDER_REPLAY_VERIFY_AGAINST", help="Once the range is scored, compare its records with the live records of the same states in this topic (e.g. decider.probabilities): per schema version, how many were compared, bit-identical, differing, or not comparable because their scoring fingerprints differ (and in which part). Exit code 1 if any comparable state differs."),
) -> None:
    """Score a historical range of the states topic (offsets or timestamps) into --output-topic, exactly once.

    Resumable: after a kill, the same command (same --name) continues from the committed offsets and stops at
    the end offsets stored by the first run. Dead letters go to --dead-letter-topic, by default
    OUTPUT_TOPIC.dead-letter (never the live worker's). Exit codes as for worker, plus 6: stopped before the end
    (rerun to resume), and with --verify-against 1: a comparable state's replayed record differs from its live one
    (0: every comparable state is bit-identical).
    """
    import logging

    from worker.stream.replay import replay_dead_letter_topic, replay_group, run_replay
    from worker.stream.replay_range import Bound, check_order

    # The range first: the flags alone here, against the topic in run_replay, both before the model loads.
    try:
        chosen = [int(p) for p in partitions.split(",")] if partitions else None
    except ValueError:
        raise ConfigError(f"--partitions {partitions!r}: expected comma-separated partition numbers") from None
    start, end = Bound.parse(from_offset, from_time, "from"), Bound.parse(to_offset, to_time, "to")
    check_order(start, end)
    if ctx.get_parameter_source("dead_letter_topic").name == "DEFAULT":  # never the live worker's topic by default
        loop_flags = {**loop_flags, "dead_letter_topic": replay_dead_letter_topic(output_topic)}
    config = loop_config(ctx, loop_flags, output_topic, worker_id=name, group=replay_group(name), max_batch=max_batch,
                          max_wait_ms=None)
    summary: dict = {}
    from worker.cli.operated import run_logged, stop_on_signals

    def run(on_event) -> None:
        summary.update(run_replay(config, start, end, chosen, stop=stop_on_signals(), on_event=on_event, progress=progress,
                                  write=lambda line: typer.echo(line, err=True), verify_against=verify_against))

    # While the progress bar runs, a line per transaction would only repeat it: those go to debug, the summary stays.
    run_logged(run, config, commits_at=logging.DEBUG if progress else logging.INFO)
    if not summary.get("complete"):
        raise typer.Exit(6)
    if summary.get("verify", {}).get("differing"):
        raise typer.Exit(1)


@app.command("tail")
@friendly_errors
def tail(
    ctx: typer.Context,
    bootstrap: str = BootstrapOpt,
    topic: str = typer.Option("probabilities", "--topic", envvar="DECIDER_TAIL_TOPIC", help="probabilities or dead-letter."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object a line (default: a short human-readable line)."),
    from_beginning: bool = typer.Option(False, "--from-beginning", help="Start at the oldest record instead of new ones."),
    max_records: Optional[int] = typer.Option(None, "--max", min=0, help="Stop after this many records."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0, help="Stop once no new record arrived for this many seconds."),
    probabilities_topic: str = ProbabilitiesTopicOpt,
    dead_letter_topic: str = DeadLetterTopicOpt,
    schema_registry_url: Optional[str] = typer.Option(None, "--schema-registry-url", envvar="DECIDER_SCHEMA_REGISTRY_URL", help="Schema Registry URL, to read avro-registry output (avro and json need none)."),
) -> None:
    """Print committed output records in any --output-format (read_committed: aborted attempts never show)."""
    from worker.cli import commands

    if topic not in ("probabilities", "dead-letter"):
        raise ConfigError(f"--topic must be probabilities or dead-letter, not {topic!r}")
    name = probabilities_topic if topic == "probabilities" else dead_letter_topic
    registry = registry_config(ctx, schema_registry_url)
    for record in commands.tail(cluster(ctx, bootstrap), name, topic, from_beginning, max_records, timeout, registry):
        typer.echo(commands.json_line(record) if as_json else commands.summary_line(topic, record))
        sys.stdout.flush()


@app.command("broker")
@friendly_errors
def broker(
    port: int = typer.Option(9092, "--port", envvar="DECIDER_BROKER_PORT", min=1, max=65535, help="Kafka port to listen on (127.0.0.1)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", envvar="DECIDER_BROKER_DATA_DIR", help="Where the broker keeps its data (default: a temporary directory, deleted on exit). The embedded broker is not crash-durable (a kill -9 can lose acknowledged records); Apache Kafka is."),
    kafka: bool = typer.Option(False, "--kafka", help="Run the pinned Apache Kafka 4.4 (KRaft, one node; needs Java 17+, and Maven the first time, to fetch its jars into ~/.cache/decider) instead of the embedded development broker (noida-db, no Java)."),
) -> None:
    """Run a local Kafka broker in the foreground (the embedded development broker, or Apache Kafka with --kafka); Ctrl-C stops it."""
    from worker.cli.local_broker import run_local_broker

    run_local_broker(kafka, port, data_dir)


@app.command("demo")
@friendly_errors
def demo(
    model: Optional[str] = typer.Option(None, "--model", envvar="DECIDER_MODEL", help="Model directory (default: a tiny random model written to a temp dir: the numbers are meaningless, the pipeline is real)."),
    port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="Port of the embedded broker (default: a free one)."),
    records_shown: int = typer.Option(3, "--show", help="How many decoded records to print."),
) -> None:
    """Run the whole pipeline locally: embedded broker, topics, schema, states, a CPU worker, the records."""
    from worker.cli.demo import run_demo

    run_demo(model_dir=model, port=port, records_shown=records_shown)


@app.command("tiny-model")
@friendly_errors
def tiny_model(
    directory: Path = typer.Argument(..., help="Directory to write it to (created; it must be new or empty)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights: a seed always writes the same model."),
) -> None:
    """Write a tiny random Qwen3.5-family model (a complete Hugging Face directory, no network) for --model, to try
    decider on a CPU: its answers are meaningless, the pipeline is real."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        what = "is not empty" if directory.is_dir() else "is a file"
        raise ConfigError(f"{directory} {what}; give a new or empty directory for the tiny model")
    from engine.testing import write_tiny_model

    write_tiny_model(directory, seed=seed)
    typer.echo(f"tiny random model written to {directory} (random weights: its answers are meaningless); "
               f"use it with --model {directory}")


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
    deterministic: Optional[bool] = DeterministicOpt,
) -> None:
    """Score states offline, no Kafka: one JSON line of probabilities per state, for trying a schema and a model.

    Exit codes: 0 scored (a states file without a state scores nothing, with a warning on stderr), 2 a mistake in a
    file, the model directory or the device."""
    from worker.cli.offline import score_file, write_scores

    write_scores(score_file(model, schema, states, device, dtype, schema_id, batch_size, deterministic), sys.stdout)


app.command("calibrate")(friendly_errors(calibrate))


@app.callback()
def _root(
    config: Optional[Path] = typer.Option(None, "--config", envvar="DECIDER_CONFIG", help="TOML file of settings (flag > environment > file > default); see docs/configuration.md."),
) -> None:
    """Ask an LLM a fixed set of multiple-choice questions about every event of a Kafka stream, exactly once."""
    # --config is taken out of the arguments by main() before parsing (the file supplies the parse's
    # defaults); declared here so that --help shows it.


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the ``decider`` console script: read the config file (if any), then run the command with the
    file's values as the parse's defaults and the file itself as ``ctx.obj``."""
    import os

    from worker.config_file import load_config_file, split_config_flag

    try:
        path, args = split_config_flag(sys.argv[1:] if argv is None else argv, os.environ)
        file_config = load_config_file(path, typer.main.get_command(app)) if path is not None else None
    except FatalError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(_run_command(args, file_config))


def _run_command(args: list[str], file_config) -> int:
    """Run the command line with the config file's values as the parse's defaults and the file as ``ctx.obj``;
    -> its exit code. A mistake on the command line itself (an unknown option, a value of the wrong type or out of
    range) is one line on stderr and exit code 2, like every other user error."""
    try:
        outcome = app(args=args, default_map=file_config.default_map if file_config else None, obj=file_config,
                      prog_name="decider", standalone_mode=False, max_content_width=help_width())
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
