"""``decider calibrate``: fit a schema's calibration from data and publish it as the schema's next version.

- ``--method order``: PriDe (``engine.calibration.fit_order``) on states of the schema read from the states topic
  (decider's StateEvent records): the model's prior over option positions becomes each question's ``option_bias``.
  It estimates the whole position prior from the raw scores, so it replaces an earlier ``option_bias`` and a
  ``contextual`` calibration (which corrects the same prior from content-free states).
- ``--method temperature``: labelled feedback (JSON ``{"state_id", "question_id", "label"}``, the label an option's
  text) joined with the committed probability records of the schema's latest version; a temperature per question
  fitted by log-loss on 80% of the answers (``worker.cli.temperature_fit``), judged by ECE and Brier on the other 20%.

Both print what they found, write it with ``--report DIR`` (``worker.cli.calibration_report``), and publish a new
schema version unless ``--dry-run``. Workers prepare the new version when they next see it; live scoring and
replays of that version apply the same parameters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

import schemas
from worker.cli import calibration_report as report_files
from worker.cli import temperature_fit as fit
from worker.cli.commands import latest_schema, publish_schema
from worker.cli.options import (BootstrapOpt, DeviceOpt, DtypeOpt, ProbabilitiesTopicOpt, SchemasTopicOpt,
                                StatesTopicOpt, cluster)
from worker.config import Cluster, Topics
from worker.exceptions import BrokerUnavailableError, ConfigError
from worker.formats.output_formats import OutputDecoder
from worker.formats.records import engine_questions, question_schema_record, schema_document
from worker.kafka_clients import as_cluster, check_broker, require_topics, whole_pass_reader
from worker.stream.schema_table import BrokenSchema

METHODS = ("order", "temperature")
Echo = Callable[[str], None]


def calibrate(
    ctx: typer.Context,
    bootstrap: str = BootstrapOpt,
    schema_id: str = typer.Option(..., "--schema-id", envvar="DECIDER_SCHEMA_ID", help="The schema to calibrate (its latest version)."),
    method: str = typer.Option(..., "--method", help="order: the options' position prior (PriDe), as option_bias; temperature: a temperature per question from labelled feedback."),
    sample: int = typer.Option(200, "--sample", min=1, help="order: how many of the schema's states (from the start of the states topic) to score under every cyclic order of the options."),
    model: Optional[str] = typer.Option(None, "--model", envvar="DECIDER_MODEL", help="order: the model directory the workers score with."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    feedback_topic: Optional[str] = typer.Option(None, "--feedback-topic", envvar="DECIDER_FEEDBACK_TOPIC", help='temperature: topic of labelled answers, JSON {"state_id", "question_id", "label"} (label: the option\'s text).'),
    min_labels: int = typer.Option(200, "--min-labels", min=2, help="temperature: refuse unless every question has at least this many labelled answers."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write the figures as report.json and a picture per question (PNG) here."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report only: publish nothing."),
    states_topic: str = StatesTopicOpt,
    schemas_topic: str = SchemasTopicOpt,
    probabilities_topic: str = ProbabilitiesTopicOpt,
) -> None:
    """Fit a schema's calibration from data and publish it as the schema's next version (--dry-run: report only).

    Exit codes: 0 done, 2 bad flags or too little data, 4 broker unreachable or topic missing."""
    if method not in METHODS:
        raise ConfigError(f"--method must be order or temperature, not {method!r}")
    topics = Topics(states=states_topic, schemas=schemas_topic, probabilities=probabilities_topic)
    run = Run(cluster(ctx, bootstrap), topics, schema_id, report, dry_run)
    if method == "order":
        if model is None:
            raise ConfigError("--method order needs --model: the model the workers score with")
        from worker.cli.offline import load_schema_engine

        calibrate_order(run, sample, lambda: load_schema_engine(model, device, dtype))
    else:
        if feedback_topic is None:
            raise ConfigError("--method temperature needs --feedback-topic: the topic of labelled answers")
        calibrate_temperature(run, feedback_topic, min_labels)


@dataclass
class Run:
    """What every method needs: where to read and publish, the schema, and where its figures go."""

    cluster: Cluster | str
    topics: Topics
    schema_id: str
    report: Path | None = None
    dry_run: bool = False
    echo: Echo = typer.echo
    schema: dict[str, Any] = field(init=False)
    next_version: int = field(init=False)

    def __post_init__(self) -> None:
        require_topics(self.cluster, [self.topics.schemas], roles=self.topics)
        schema, self.next_version = latest_schema(self.cluster, self.topics, self.schema_id)
        if schema is None:
            raise ConfigError(f"no schema {self.schema_id!r} in topic {self.topics.schemas}; publish it with "
                              "decider schema put first")
        if isinstance(schema, BrokenSchema):
            raise ConfigError(f"schema {self.schema_id!r} is unusable: {schema.problem}")
        self.schema = schema

    @property
    def name(self) -> str:
        return f"schema {self.schema_id} v{self.schema['version']}"

    def finish(self, changed: dict[str, Any], figures: dict[str, Any], pictures: Callable[[Path], list[Path]],
               what: str) -> dict[str, Any] | None:
        """Write the report, publish the schema with ``changed`` applied (unless a dry run); -> the new record."""
        document = {**schema_document(self.schema), **changed}
        record = None if self.dry_run else question_schema_record(document, self.schema_id, self.next_version)
        if record is not None:
            publish_schema(self.cluster, self.topics, record)
            self.echo(f"published {what} as schema {self.schema_id} version {record['version']}")
        else:
            self.echo(f"dry run: nothing published ({what} would be schema {self.schema_id} version "
                      f"{self.next_version})")
        if self.report is not None:
            directory = report_files.report_dir(self.report)
            figures = {**figures, "schema_id": self.schema_id, "schema_version": self.schema["version"],
                       "published_version": None if record is None else record["version"], "schema": document}
            written = [report_files.write_json(directory, figures), *pictures(directory)]
            self.echo(f"report: {', '.join(str(p) for p in written)}")
        return record


# ---- order ---------------------------------------------------------------------------------------------------------
def calibrate_order(run: Run, sample: int, schema_engine: Callable[[], Any]) -> dict[str, Any] | None:
    """PriDe on up to ``sample`` states of the schema; ``schema_engine()`` gives the SchemaEngine to score with."""
    texts = sample_states(run.cluster, run.topics, run.schema_id, sample)
    if not texts:
        raise ConfigError(f"no states of schema {run.schema_id!r} in topic {run.topics.states} (decider's StateEvent "
                          "records) to score; publish some with decider produce")
    from engine.calibration import fit_order

    questions = [{k: v for k, v in q.items() if k != "option_bias"} for q in engine_questions(run.schema)]
    started = time.monotonic()
    fits = fit_order(schema_engine(), questions, texts, independent=run.schema.get("mode") == "independent")
    orders = max(len(q["options"]) for q in questions)
    run.echo(f"{run.name}: position prior from {len(texts)} states, each scored under {orders} cyclic orders of the "
             f"options ({time.monotonic() - started:.1f} s); disagreement = how often the top option changes with the "
             "order")
    rows = []
    for q, prior in zip(run.schema["questions"], fits):
        bias = [round(x, 6) for x in prior.log_prior]
        shares = _shares(bias)
        run.echo(f"  {q['id']}: prior " + " ".join(f"{chr(65 + i)} {s:.2f}" for i, s in enumerate(shares))
                 + f"; disagreement {prior.disagreement_before:.1%} -> {prior.disagreement_after:.1%}")
        rows.append({"id": q["id"], "option_bias": bias, "position_prior": shares,
                     "disagreement_before": prior.disagreement_before, "disagreement_after": prior.disagreement_after})
    if run.schema.get("calibration", "none") != "none":
        run.echo(f"  calibration {run.schema['calibration']} -> none (the option_bias corrects the same prior)")
    by_id = {row["id"]: row["option_bias"] for row in rows}
    changed = {"calibration": "none", "questions": [{**q, "option_bias": by_id[q["id"]]}
                                                    for q in schema_document(run.schema)["questions"]]}

    def pictures(directory: Path) -> list[Path]:
        return [report_files.position_prior_chart(directory, row["id"], row["option_bias"]) for row in rows]

    return run.finish(changed, {"method": "order", "states": len(texts), "questions": rows}, pictures,
                      f"option_bias of {len(rows)} questions")


def _shares(log_prior: list[float]) -> list[float]:
    weights = [math.exp(x) for x in log_prior]
    return [w / sum(weights) for w in weights]


def sample_states(cluster: Cluster | str, topics: Topics, schema_id: str, limit: int) -> list[str]:
    """The texts of the first ``limit`` states of ``schema_id`` in the states topic (others and undecodable records
    skipped)."""
    texts = []
    for message in read_topic(cluster, topics.states, Topics(states=topics.states)):
        try:
            state = schemas.decode_state(message.value() or b"")
        except ValueError:
            continue
        if state["schema_id"] == schema_id and state["state"].strip():
            texts.append(state["state"])
            if len(texts) >= limit:
                break
    return texts


# ---- temperature ---------------------------------------------------------------------------------------------------
NOT_JSON, NOT_AN_ANSWER = "not JSON", "not an object of strings state_id, question_id, label"
UNKNOWN_QUESTION, UNKNOWN_STATE = "unknown question", "unknown state (no committed record of this version)"
UNKNOWN_LABEL = "label not an option"
SKIPPED = (NOT_JSON, NOT_AN_ANSWER, UNKNOWN_QUESTION, UNKNOWN_STATE, UNKNOWN_LABEL)
"""Why a feedback record is skipped, in the order the checks run (and the summary line lists them)."""


@dataclass
class FeedbackCounts:
    """What became of the feedback records: joined, or skipped and why."""

    read: int = 0
    joined: int = 0
    skipped: Counter = field(default_factory=Counter)

    def line(self, topic: str, name: str) -> str:
        """The summary line: records read, answers joined, and the skipped ones by why."""
        why = ", ".join(f"{self.skipped[reason]} {reason}" for reason in SKIPPED if self.skipped[reason])
        return (f"feedback from {topic}: {self.read} records, {self.joined} labelled answers joined with {name}'s "
                f"committed probability records" + (f"; skipped {sum(self.skipped.values())}: {why}" if why else ""))


def calibrate_temperature(run: Run, feedback_topic: str, min_labels: int) -> dict[str, Any] | None:
    """Fit each question's temperature on labelled feedback joined with the schema's committed records."""
    records, other_versions = committed_records(run)
    counts = FeedbackCounts()
    labelled = join_feedback(read_topic(run.cluster, feedback_topic), records, run.schema, counts)
    run.echo(counts.line(feedback_topic, run.name) + (f" ({other_versions} records of other versions not used)"
                                                      if other_versions else ""))
    short = [f"{q['id']!r} has {len(labelled[q['id']])}" for q in run.schema["questions"]
             if len(labelled[q["id"]]) < min_labels]
    if short:
        raise ConfigError(f"too few labelled answers to fit temperatures for {run.name}: {', '.join(short)} (at least "
                          f"{min_labels} a question, --min-labels); collect more feedback or lower --min-labels")
    fitted = [_fit_question(q, labelled[q["id"]]) for q in run.schema["questions"]]
    rows = [row for row, _ in fitted]
    for row in rows:
        bound = {"upper": "; the search's upper bound: under these labels the probabilities are worth no more than "
                          "uniform ones", "lower": "; the search's lower bound"}.get(row["at_bound"], "")
        run.echo(f"  {row['id']}: temperature {row['temperature_before']:.3g} -> {row['temperature_after']:.3g} "
                 f"(fitted on {row['train']}{bound}); held out {row['held_out']}: ECE {row['ece_before']:.3f} -> "
                 f"{row['ece_after']:.3f}, Brier {row['brier_before']:.3f} -> {row['brier_after']:.3f}")
    by_id = {row["id"]: row["temperature_after"] for row in rows}
    changed = {"questions": [{**q, "temperature": by_id[q["id"]]} for q in schema_document(run.schema)["questions"]]}

    def pictures(directory: Path) -> list[Path]:
        return [report_files.reliability_diagram(directory, row["id"], *bins,
                                                 (row["temperature_before"], row["temperature_after"]))
                for row, bins in fitted]

    figures = {"method": "temperature", "feedback_topic": feedback_topic, "ece_bins": fit.ECE_BINS,
               "feedback": {"records": counts.read, "joined": counts.joined, "skipped": dict(counts.skipped)},
               "questions": rows}
    return run.finish(changed, figures, pictures, f"the temperatures of {len(rows)} questions")


def _fit_question(question: dict[str, Any], items: list[tuple[str, fit.Labelled]]
                  ) -> tuple[dict[str, Any], tuple[list[fit.ReliabilityBin], list[fit.ReliabilityBin]]]:
    """(the question's figures, its held-out reliability bins before and after the fitted temperature)."""
    train = [item for qid, item in items if not fit.held_out(item.state_id, qid)]
    test = [item for qid, item in items if fit.held_out(item.state_id, qid)]
    if not train or not test:
        raise ConfigError(f"question {question['id']!r}: {len(items)} labelled answers leave none to "
                          f"{'fit on' if not train else 'judge the fit on'}; collect more feedback")
    factor = fit.fit_factor(train)
    before = question.get("temperature") or 1.0
    bins_before, bins_after = fit.reliability(test), fit.reliability(test, factor)
    low, high = fit.TEMPERATURE_RANGE
    row = {"id": question["id"], "labels": len(items), "train": len(train), "held_out": len(test),
           "temperature_before": before, "temperature_after": round(before * factor, 6), "factor": factor,
           "at_bound": "upper" if factor > high * 0.99 else "lower" if factor < low * 1.01 else None,
           "log_loss_before": fit.log_loss(test), "log_loss_after": fit.log_loss(test, factor),
           "ece_before": fit.ece(test), "ece_after": fit.ece(test, factor),
           "brier_before": fit.brier(test), "brier_after": fit.brier(test, factor),
           "reliability_before": [dataclasses.asdict(b) for b in bins_before],
           "reliability_after": [dataclasses.asdict(b) for b in bins_after]}
    return row, (bins_before, bins_after)


def committed_records(run: Run) -> tuple[dict[str, dict[str, Any]], int]:
    """(state id -> its latest committed probability record of the schema's latest version, how many records of the
    schema's other versions were passed over)."""
    decoder = OutputDecoder("probabilities")
    version, latest, other = run.schema["version"], {}, 0
    for message in read_topic(run.cluster, run.topics.probabilities, Topics(probabilities=run.topics.probabilities)):
        try:
            record = decoder.decode(message.value() or b"", message.topic())
        except ValueError:
            continue
        if record.get("schema_id") != run.schema_id:
            continue
        if record.get("schema_version") == version:
            latest[record["state_id"]] = record
        else:
            other += 1
    return latest, other


def join_feedback(messages: Iterator[Any], records: dict[str, dict[str, Any]], schema: dict[str, Any],
                  counts: FeedbackCounts) -> dict[str, list[tuple[str, fit.Labelled]]]:
    """Per question id, (question id, labelled answer) of each usable feedback record; the others counted in
    ``counts.skipped`` by why (a later label of the same answer replaces an earlier one)."""
    options = {q["id"]: list(q["options"]) for q in schema["questions"]}
    found: dict[tuple[str, str], fit.Labelled] = {}
    for message in messages:
        counts.read += 1
        reason, answer = _feedback_answer(message.value(), records, options)
        if reason is not None:
            counts.skipped[reason] += 1
            continue
        state_id, question_id, label = answer
        probabilities = next(q["probabilities"] for q in records[state_id]["questions"] if q["id"] == question_id)
        found[(state_id, question_id)] = fit.Labelled(state_id, tuple(probabilities), label)
    counts.joined = len(found)
    labelled: dict[str, list[tuple[str, fit.Labelled]]] = defaultdict(list)
    for (_, question_id), item in found.items():
        labelled[question_id].append((question_id, item))
    return labelled


def _feedback_answer(value: bytes | None, records: dict[str, dict[str, Any]], options: dict[str, list[str]]):
    """(why a feedback value is unusable, None) or (None, (state id, question id, label index))."""
    try:
        item = json.loads((value or b"").decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return NOT_JSON, None
    if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("state_id", "question_id", "label")):
        return NOT_AN_ANSWER, None
    if item["question_id"] not in options:
        return UNKNOWN_QUESTION, None
    if item["state_id"] not in records:
        return UNKNOWN_STATE, None
    if item["label"] not in options[item["question_id"]]:
        return UNKNOWN_LABEL, None
    return None, (item["state_id"], item["question_id"], options[item["question_id"]].index(item["label"]))


# ---- reading -------------------------------------------------------------------------------------------------------
def read_topic(cluster: Cluster | str, topic: str, roles: Topics | None = None, timeout_s: float = 60.0
               ) -> Iterator[Any]:
    """Every record of ``topic`` a read_committed reader sees, from the start of each partition to its end as of now.
    Each partition is fetched whole in one response where it fits (64 MiB): the embedded broker's list of aborted
    transactions would otherwise hide a restarted worker's later records (docs/brokers.md, the development broker). ``roles``: the decider
    topic set it belongs to (None: a topic of the user's own, such as the feedback topic)."""
    if roles is None:
        existing = check_broker(cluster)
        if topic not in existing:
            raise BrokerUnavailableError(f"topic {topic} does not exist on {as_cluster(cluster).bootstrap}; it is "
                                         "the user's own (labelled answers come from your labelling tool)")
    counts = require_topics(cluster, [topic], roles=roles)
    consumer = whole_pass_reader(cluster)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(counts[topic])])
    at_end: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(at_end) < counts[topic]:
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(f"reading {topic}: not at its end after {timeout_s:.0f} s")
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() != KafkaError._PARTITION_EOF:
                    raise BrokerUnavailableError(f"reading {topic}: {message.error().str()}")
                at_end.add(message.partition())
                continue
            deadline = time.monotonic() + timeout_s
            yield message
    finally:
        consumer.close()
