"""``decider replay --verify-against TOPIC``: compare a replay's records with the live records of the same states.

A replayed state and its live record are paired by the input event they answer (source topic, partition, offset;
the state id must agree too). A pair is *comparable* when both records carry a scoring fingerprint
(``engine.fingerprint``) with the same digest: then, with a deterministic kernel table, they must agree to the bit,
and a pair that does not *differs* (its largest absolute difference over probabilities, raw probabilities and label
masses is reported). A pair whose fingerprints differ is *not comparable*, and the report says in which parts (model,
decider, kernels, prompt, calibration) with both values: a schema version with a new temperature shows there, as
``calibration``, not as a difference. Records written before decider had fingerprints are not comparable either.

Per schema (id, the live record's version, the replayed one's) the report gives how many states were compared, how
many are bit-identical, how many differ (the largest difference, the first few state ids) and how many could not be
compared and why; replayed states with no live record are counted. ``Verification.differing`` decides the exit
code: 0 when every comparable state is identical, 1 when any differs.

Both topics are read whole by a read_committed reader, up to the ends they had when the verification began (the
live topic may still grow): a full read of the live topic, kept in memory only for the replayed states.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

from worker.config import Cluster, Topics
from worker.exceptions import BrokerUnavailableError
from worker.formats.output_formats import PROBABILITIES, OutputDecoder
from worker.formats.registry import RegistryConfig
from worker.kafka_clients import require_topics, whole_pass_reader

log = logging.getLogger(__name__)

FINGERPRINT_PARTS = ("model", "decider", "kernels", "prompt", "calibration")  # engine.fingerprint.PARTS (no torch here)
FIRST_IDS = 5
"""Differing state ids listed per schema."""
READ_TIMEOUT_S = 600.0
"""A topic read that has not reached the ends it began with by then fails (the broker is not answering)."""

Source = tuple[str, int, int]
"""(topic, partition, offset) of the input event a record answers."""


def source_of(record: dict[str, Any]) -> Source:
    return record["source_topic"], int(record["source_partition"]), int(record["source_offset"])


@dataclass
class SchemaComparison:
    """The verification of one schema's states: ``live_version`` and ``replay_version`` are the records' versions."""

    schema_id: str
    live_version: int
    replay_version: int
    compared: int = 0
    identical: int = 0
    differing: int = 0
    largest_difference: float = 0.0
    first_differing: list[str] = field(default_factory=list)
    not_comparable: Counter[str] = field(default_factory=Counter)  # by reason

    @property
    def name(self) -> str:
        versions = (f"v{self.live_version}" if self.live_version == self.replay_version
                    else f"v{self.live_version} (live) / v{self.replay_version} (replay)")
        return f"{self.schema_id} {versions}"

    def line(self) -> str:
        text = f"{self.name}: {self.compared} compared, {self.identical} bit-identical, {self.differing} differ"
        if self.differing:
            text += (f" (largest difference {self.largest_difference:.3g}; first: "
                     f"{', '.join(self.first_differing)})")
        if self.not_comparable:
            reasons = "; ".join(f"{count} {reason}" for reason, count in sorted(self.not_comparable.items()))
            text += f"; {sum(self.not_comparable.values())} not comparable: {reasons}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"schema_id": self.schema_id, "live_version": self.live_version, "replay_version": self.replay_version,
                "compared": self.compared, "identical": self.identical, "differing": self.differing,
                "largest_difference": self.largest_difference, "first_differing": list(self.first_differing),
                "not_comparable": dict(self.not_comparable)}


@dataclass
class Verification:
    """The whole report: per schema a ``SchemaComparison``; ``replayed`` states, ``missing_live`` of them with no
    live record."""

    against: str
    replayed: int = 0
    missing_live: int = 0
    first_missing: list[str] = field(default_factory=list)
    schemas: dict[tuple[str, int, int], SchemaComparison] = field(default_factory=dict)

    @property
    def compared(self) -> int:
        return sum(s.compared for s in self.schemas.values())

    @property
    def differing(self) -> int:
        return sum(s.differing for s in self.schemas.values())

    @property
    def not_comparable(self) -> int:
        return sum(sum(s.not_comparable.values()) for s in self.schemas.values())

    def lines(self) -> list[str]:
        """The report as the command prints it."""
        head = f"verify against {self.against}: {self.replayed} states replayed, {self.replayed - self.missing_live} with a live record"
        if self.missing_live:
            head += f" ({self.missing_live} without, first: {', '.join(self.first_missing)})"
        lines = [head] + [f"  {s.line()}" for _, s in sorted(self.schemas.items())]
        if self.differing:
            lines.append(f"verify: {self.differing} of {self.compared} compared states differ")
        elif self.compared:
            lines.append(f"verify: all {self.compared} compared states are bit-identical"
                         + (f" ({self.not_comparable} not comparable)" if self.not_comparable else ""))
        else:
            lines.append("verify: no state could be compared")
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {"against": self.against, "replayed": self.replayed, "missing_live": self.missing_live,
                "compared": self.compared, "identical": self.compared - self.differing, "differing": self.differing,
                "not_comparable": self.not_comparable, "schemas": [s.as_dict() for _, s in sorted(self.schemas.items())]}


# ---- comparing ----------------------------------------------------------------------------------------------------
def compare(replayed: Iterable[dict[str, Any]], live: dict[Source, dict[str, Any]], against: str) -> Verification:
    """The verification of ``replayed`` records against ``live`` ones (by the source of each)."""
    report = Verification(against)
    for record in replayed:
        report.replayed += 1
        other = live.get(source_of(record))
        if other is None or other["state_id"] != record["state_id"]:
            report.missing_live += 1
            if len(report.first_missing) < FIRST_IDS:
                report.first_missing.append(record["state_id"])
            continue
        key = (record["schema_id"], int(other["schema_version"]), int(record["schema_version"]))
        group = report.schemas.get(key)
        if group is None:
            group = report.schemas[key] = SchemaComparison(*key)
        _compare_pair(group, other, record)
    return report


def _compare_pair(group: SchemaComparison, live: dict[str, Any], replayed: dict[str, Any]) -> None:
    reason = incomparable(live.get("fingerprint"), replayed.get("fingerprint"))
    if reason is not None:
        group.not_comparable[reason] += 1
        return
    group.compared += 1
    difference = largest_difference(live, replayed)
    if difference == 0.0 and _same_bits(live, replayed):
        group.identical += 1
        return
    group.differing += 1
    group.largest_difference = max(group.largest_difference, difference)
    if len(group.first_differing) < FIRST_IDS:
        group.first_differing.append(replayed["state_id"])


def incomparable(live: dict[str, str] | None, replayed: dict[str, str] | None) -> str | None:
    """Why two records with these fingerprints cannot be compared bit for bit, or None when they can."""
    if live is None or replayed is None:
        which = " and ".join(side for side, fp in (("live", live), ("replayed", replayed)) if fp is None)
        return f"no fingerprint in the {which} record"
    if live.get("digest") == replayed.get("digest"):
        return None
    parts = [p for p in FINGERPRINT_PARTS if live.get(p) != replayed.get(p)] or ["digest"]
    values = ", ".join(f"{p} {live.get(p)!r} (live) vs {replayed.get(p)!r} (replay)" for p in parts)
    return f"fingerprints differ in {', '.join(parts)}: {values}"


def _numbers(record: dict[str, Any]) -> list[list[float | None]]:
    """Per question its probabilities, raw probabilities and label mass, as one list (None where absent)."""
    rows = []
    for q in record["questions"]:
        raw = q.get("raw_probabilities")
        rows.append(list(q["probabilities"]) + (list(raw) if raw is not None else [None]) + [q.get("label_mass")])
    return rows


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two records' numbers (infinite when their shapes differ)."""
    rows_a, rows_b = _numbers(a), _numbers(b)
    if [q["id"] for q in a["questions"]] != [q["id"] for q in b["questions"]] or \
            [len(r) for r in rows_a] != [len(r) for r in rows_b]:
        return math.inf
    largest = 0.0
    for row_a, row_b in zip(rows_a, rows_b):
        for x, y in zip(row_a, row_b):
            if (x is None) != (y is None):
                return math.inf
            if x is not None:
                largest = max(largest, abs(x - y))
    return largest


def _same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Exactly equal numbers (0.0 and -0.0 apart, which a difference of 0 does not tell)."""
    return all(repr(x) == repr(y) for row_a, row_b in zip(_numbers(a), _numbers(b)) for x, y in zip(row_a, row_b))


# ---- reading ------------------------------------------------------------------------------------------------------
def read_probabilities(cluster: Cluster, topic: str, registry: RegistryConfig | None = None,
                       keep: Callable[[dict[str, Any]], bool] = lambda record: True,
                       timeout_s: float = READ_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """The probability records of ``topic`` (any ``--output-format``) that ``keep`` accepts, as a read_committed
    reader sees them from the beginning to the ends the topic had when this began. Undecodable records are skipped
    (and counted in the log)."""
    partitions = require_topics(cluster, [topic], roles=Topics(probabilities=topic))[topic]
    decoder = OutputDecoder(PROBABILITIES, registry.client() if registry is not None else None)
    consumer = whole_pass_reader(cluster)
    try:
        ends = {}
        for p in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        undecodable, deadline = 0, time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(f"reading {topic} for the verification: partitions {sorted(ends)} did not "
                                             f"reach their ends in {timeout_s:.0f} s")
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() != KafkaError._PARTITION_EOF:
                    raise BrokerUnavailableError(f"reading {topic} for the verification: {message.error().str()}")
                ends.pop(message.partition(), None)
                continue
            end = ends.get(message.partition())
            if end is None or message.offset() >= end:
                continue
            if message.offset() >= end - 1:
                ends.pop(message.partition())
            try:
                record = decoder.decode(message.value(), topic)
            except ValueError:
                undecodable += 1
                continue
            if keep(record):
                yield record
        if undecodable:
            log.warning("verify: %d records of %s could not be decoded and were skipped", undecodable, topic)
    finally:
        consumer.close()


def verify_replay(cluster: Cluster, output_topic: str, against: str, states_topic: str, starts: dict[int, int],
                  ends: dict[int, int], registry: RegistryConfig | None = None) -> Verification:
    """Compare the replay's records in ``output_topic`` that answer the range [starts, ends) of ``states_topic``
    with the live records in ``against``."""
    def in_range(record: dict[str, Any]) -> bool:
        partition, offset = record["source_partition"], record["source_offset"]
        return (record["source_topic"] == states_topic and partition in starts
                and starts[partition] <= offset < ends[partition])

    replayed = {source_of(r): r for r in read_probabilities(cluster, output_topic, registry, in_range)}
    live = {source_of(r): r for r in read_probabilities(cluster, against, registry,
                                                        lambda r: source_of(r) in replayed)}
    return compare(replayed.values(), live, against)
