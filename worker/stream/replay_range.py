"""The range of a ``decider replay``: its two ends as the flags give them (``Bound``: offsets or times), checked against
each other, and resolved to offsets per partition (``ReplayRange``) on the states topic.

Times come in as ISO 8601 or epoch milliseconds and are kept as epoch milliseconds (the committed offsets' metadata
stores the range flags so); every message shows them in ISO 8601 (``shown``), as users type them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from confluent_kafka import Consumer, TopicPartition

from worker.exceptions import ConfigError


@dataclass(frozen=True)
class Bound:
    """One end of the range: an offset (for every partition, or per partition), a timestamp in ms, or open."""

    offset: int | None = None
    per_partition: dict[int, int] | None = None
    time_ms: int | None = None

    @staticmethod
    def parse(offset: str | None, when: str | None, flag: str) -> "Bound":
        """From ``--from-offset/--from-time`` style values: ``N`` or ``P:N,P:N``; ISO 8601 or epoch ms."""
        if offset is not None and when is not None:
            raise ConfigError(f"give either --{flag}-offset or --{flag}-time, not both")
        if offset is not None:
            try:
                if ":" in offset:
                    pairs = (item.split(":", 1) for item in offset.split(","))
                    return Bound(per_partition={int(p): int(o) for p, o in pairs})
                return Bound(offset=int(offset))
            except ValueError:
                raise ConfigError(f"--{flag}-offset {offset!r}: expected N or PARTITION:N[,PARTITION:N...]") from None
        if when is not None:
            return Bound(time_ms=parse_time_ms(when, f"--{flag}-time"))
        return Bound()

    def flags(self, flag: str) -> str:
        """The flag that gives this bound, in one canonical spelling (times in epoch ms: the spelling stored in a
        replay's committed offsets, so that a rerun compares equal; ``shown`` writes them as the user did, in ISO 8601);
        empty for an open end."""
        if self.per_partition is not None:
            return f"--{flag}-offset " + ",".join(f"{p}:{o}" for p, o in sorted(self.per_partition.items()))
        if self.offset is not None:
            return f"--{flag}-offset {self.offset}"
        if self.time_ms is not None:
            return f"--{flag}-time {self.time_ms}"
        return ""


def check_order(start: Bound, end: Bound) -> None:
    """``ConfigError`` when the range ends before it starts (bounds of the same kind; offsets and times are compared
    once resolved, by ``resolve_range``)."""
    if start.offset is not None and end.offset is not None and end.offset < start.offset:
        raise ConfigError(f"--to-offset {end.offset} is before --from-offset {start.offset}: the range ends before it starts")
    if start.time_ms is not None and end.time_ms is not None and end.time_ms < start.time_ms:
        raise ConfigError(f"--to-time {iso_time(end.time_ms)} is before --from-time {iso_time(start.time_ms)}: the range "
                          "ends before it starts")
    if start.per_partition is not None and end.per_partition is not None:
        for partition in sorted(set(start.per_partition) & set(end.per_partition)):
            if end.per_partition[partition] < start.per_partition[partition]:
                raise ConfigError(f"partition {partition}: --to-offset {end.per_partition[partition]} is before "
                                  f"--from-offset {start.per_partition[partition]}: the range ends before it starts")


def parse_time_ms(text: str, flag: str) -> int:
    """Epoch milliseconds from ``text``: an integer (ms) or ISO 8601 (``2026-11-29T10:00:00Z``; no zone means UTC)."""
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected epoch milliseconds or ISO 8601 (2026-11-29T10:00:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def iso_time(ms: int) -> str:
    """Epoch milliseconds in ISO 8601, UTC: ``2026-11-29T10:00:00Z`` (milliseconds only where there are some)."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + (f".{ms % 1000:03d}" if ms % 1000 else "") + "Z"


def shown(flags: str | None) -> str:
    """Range flags as a user reads them: their times in ISO 8601, where ``Bound.flags`` keeps epoch ms."""
    if not flags:
        return "no range flags"
    return re.sub(r"(--(?:from|to)-time) (\d+)", lambda m: f"{m[1]} {iso_time(int(m[2]))}", flags)


@dataclass(frozen=True)
class ReplayRange:
    """Per partition: first offset to score and end offset (exclusive); ``flags``: the range flags that chose them."""

    starts: dict[int, int]
    ends: dict[int, int]
    flags: str | None = None  # None: stored by a version that did not record them

    @property
    def total(self) -> int:
        """Offsets in the range (states plus any transaction markers among them)."""
        return sum(max(0, self.ends[p] - self.starts[p]) for p in self.starts)

    def metadata(self, partition: int) -> str:
        """What the committed offset of ``partition`` carries, so a rerun finds the same range."""
        return f"decider-replay:v1:start={self.starts[partition]}:end={self.ends[partition]}:flags={self.flags or ''}"


def resolve_range(consumer: Consumer, topic: str, partitions: list[int], start: Bound, end: Bound,
                  timeout_s: float = 10.0) -> ReplayRange:
    """Offsets of the range on ``topic``: explicit offsets are clamped to what the partition holds; a timestamp
    resolves to the first offset at or after it (``offsets_for_times``); open ends are the partition's ends."""
    marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s) for p in partitions}

    def resolve(bound: Bound, default_high: bool) -> dict[int, int]:
        if bound.time_ms is not None:
            found = consumer.offsets_for_times([TopicPartition(topic, p, bound.time_ms) for p in partitions], timeout=timeout_s)
            # -1: no record at or after that time, i.e. the range starts/ends at the partition's end.
            return {tp.partition: (tp.offset if tp.offset >= 0 else marks[tp.partition][1]) for tp in found}
        if bound.per_partition is not None:
            unknown = set(bound.per_partition) - set(partitions)
            if unknown:
                raise ConfigError(f"partition(s) {sorted(unknown)} are not replayed (topic {topic} has {sorted(partitions)})")
            return {p: bound.per_partition.get(p, marks[p][1] if default_high else marks[p][0]) for p in partitions}
        if bound.offset is not None:
            return {p: bound.offset for p in partitions}
        return {p: marks[p][1] if default_high else marks[p][0] for p in partitions}

    starts, ends = resolve(start, default_high=False), resolve(end, default_high=True)
    clamp = {p: (lambda o, lo=marks[p][0], hi=marks[p][1]: min(max(o, lo), hi)) for p in partitions}
    starts, ends = {p: clamp[p](o) for p, o in starts.items()}, {p: clamp[p](o) for p, o in ends.items()}
    if start != Bound() and end != Bound():
        for p in partitions:
            if ends[p] < starts[p]:
                raise ConfigError(f"partition {p}: the range ends (offset {ends[p]}, {shown(end.flags('to'))}) before it "
                                  f"starts (offset {starts[p]}, {shown(start.flags('from'))}); check --from-* and --to-*")
    return ReplayRange(starts, ends, " ".join(f for f in (start.flags("from"), end.flags("to")) if f))
