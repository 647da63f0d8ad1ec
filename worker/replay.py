"""``decider replay``: score a historical range of a states topic into a chosen output topic, exactly once.

A replay is the worker's loop (``worker.loop.Worker``) with three differences, made by overriding its hooks:
- a fixed assignment of the range's partitions, outside any consumer group's rebalancing, starting at the
  range's first offsets (or where an earlier run of the same replay committed);
- no deadline: cycles close only when a batch is full (``--max-batch``), and the range's end closes the last;
- it stops by itself once every partition reached its end offset and everything before it is committed.

Exactly once and resumable: every cycle commits its records with its input offsets in one transaction, under
the replay's own group id (``decider-replay.NAME``) and transactional id (so a second run of the same NAME
fences the first). The range is stored in the committed offsets' metadata at the first commit; a rerun
with the same NAME (after a kill -9, say) resumes from the committed offsets and stops at the stored end
offsets, whatever range its own flags would resolve to now.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from worker.batcher import Cycle
from worker.config import WorkerConfig
from worker.exceptions import AbortableError, ConfigError, FatalError
from worker.kafka_clients import base_config
from worker.loop import EventSink, Worker
from worker.metrics import on_consumer_stats

log = logging.getLogger(__name__)

_META = re.compile(r"decider-replay:v1:start=(\d+):end=(\d+)")


def replay_group(name: str) -> str:
    """The consumer group whose committed offsets hold the replay's progress and range."""
    return f"decider-replay.{name}"


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


@dataclass(frozen=True)
class ReplayRange:
    """Per partition: first offset to score and end offset (exclusive)."""

    starts: dict[int, int]
    ends: dict[int, int]

    @property
    def total(self) -> int:
        """Offsets in the range (states plus any transaction markers among them)."""
        return sum(max(0, self.ends[p] - self.starts[p]) for p in self.starts)

    def metadata(self, partition: int) -> str:
        """What the committed offset of ``partition`` carries, so a rerun finds the same range."""
        return f"decider-replay:v1:start={self.starts[partition]}:end={self.ends[partition]}"


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
    starts = {p: clamp[p](o) for p, o in starts.items()}
    ends = {p: max(starts[p], clamp[p](o)) for p, o in ends.items()}
    return ReplayRange(starts, ends)


def replay_consumer_config(config: WorkerConfig) -> dict[str, Any]:
    """The states consumer of a replay: assigned partitions, offsets committed only in transactions."""
    return {
        **base_config(config.bootstrap),
        "group.id": config.group,  # only holds the committed offsets; never joined (assign(), no subscribe)
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        # A partition whose range ends at the topic's end is finished when the reader reaches it.
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 100,
        "statistics.interval.ms": 2000,
        "stats_cb": on_consumer_stats,
    }


class ReplayWorker(Worker):
    """The worker's loop over a fixed range; ``run()`` returns when the range is done or ``stop`` is set."""

    def __init__(self, config: WorkerConfig, start: Bound, end: Bound, partitions: list[int] | None = None,
                 stop: threading.Event | None = None, on_event: EventSink | None = None) -> None:
        super().__init__(config, stop=stop, on_event=self._tap)
        self._forward = on_event or (lambda kind, info: None)
        self._max_wait_s = math.inf  # full batches only; the range's end closes the last one
        self._start, self._end, self._partitions = start, end, partitions
        self.range: ReplayRange | None = None
        self.committed: dict[int, int] = {}
        self._finished: set[int] = set()
        self.scored = 0
        self.dead_letters: dict[str, int] = {}

    @property
    def complete(self) -> bool:
        """Every partition of the range is scored and committed up to its end offset."""
        return self.range is not None and all(self.committed.get(p, -1) >= e for p, e in self.range.ends.items())

    # ---- hooks of Worker -----------------------------------------------------------------------------------
    def _make_consumer(self) -> Consumer:
        return Consumer(replay_consumer_config(self.config))

    def _start_consuming(self) -> None:
        topic = self.config.topics.states
        available = sorted(self._consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        partitions = self._partitions if self._partitions is not None else available
        if set(partitions) - set(available):
            raise ConfigError(f"--partitions {sorted(set(partitions) - set(available))}: topic {topic} has {available}")
        wanted = resolve_range(self._consumer, topic, partitions, self._start, self._end)
        positions, stored = self._committed_positions(topic, partitions)
        if stored is not None:
            log.info("resuming replay %s from its committed offsets %s", self.config.worker_id, positions)
        if stored is not None and stored != wanted:
            log.warning("resuming replay %s: the range stored at its first run wins over this run's flags", self.config.worker_id)
        self.range = stored or wanted
        if stored is None:
            # Make the range durable before scoring anything: a rerun after a kill must find the same end
            # offsets for every partition, including those with nothing committed yet.
            try:
                self._txns.commit([], [TopicPartition(topic, p, self.range.starts[p], metadata=self.range.metadata(p))
                                       for p in partitions])
            except AbortableError as exc:
                raise FatalError(f"could not record the replay's range in group {self.config.group}: {exc}") from exc
            positions = dict(self.range.starts)
        self.committed = {p: positions.get(p, self.range.starts[p]) for p in partitions}
        self._finished = {p for p in partitions if self.committed[p] >= self.range.ends[p]}
        self._emit("replay_started", {"topic": topic, "starts": self.range.starts, "ends": self.range.ends,
                                      "resumed_from": positions, "total": self.range.total})
        todo = [TopicPartition(topic, p, self.committed[p]) for p in partitions if p not in self._finished]
        if todo:
            self._consumer.assign(todo)

    def _committed_positions(self, topic: str, partitions: list[int]) -> tuple[dict[int, int], ReplayRange | None]:
        """Offsets an earlier run of this replay committed, and the range it stored with them."""
        try:
            committed = self._consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        except KafkaException as exc:
            raise FatalError(f"cannot read the committed offsets of replay group {self.config.group}: {exc.args[0].str()}") from exc
        positions, starts, ends = {}, {}, {}
        for tp in committed:
            if tp.offset >= 0:
                positions[tp.partition] = tp.offset
            match = _META.fullmatch(tp.metadata or "")
            if match:
                starts[tp.partition], ends[tp.partition] = int(match[1]), int(match[2])
        if not starts:
            return positions, None
        if set(starts) != set(partitions):
            raise ConfigError(f"replay {self.config.worker_id} was started on partitions {sorted(starts)}, not {sorted(partitions)}: "
                              "pass the same --partitions, or choose a new --name")
        return positions, ReplayRange(starts, ends)

    def _commit_offsets(self, cycle: Cycle) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, tp.offset, metadata=self.range.metadata(tp.partition))
                for tp in cycle.offsets()]

    def _route(self, message) -> None:
        partition, error = message.partition(), message.error()
        end = self.range.ends.get(partition) if partition is not None and partition >= 0 else None
        if error is not None and error.code() == KafkaError._PARTITION_EOF:
            if end is not None and message.offset() >= end:
                self._finish(partition)
            return
        if error is None and end is not None and message.offset() >= end:
            self._finish(partition)  # past the range: not tracked, never scored
            return
        super()._route(message)

    def _finish(self, partition: int) -> None:
        if partition not in self._finished:
            self._finished.add(partition)
            self._consumer.pause([TopicPartition(self.config.topics.states, partition)])

    def _step(self) -> None:
        super()._step()
        if self.range is None or self._finished < set(self.range.ends):
            return
        if len(self._cycle) and not self._holding:
            # No deadline closes the last, partial cycle: the range's end does. Its states that wait for a
            # schema are dead-lettered once their wait expires (the loop holds the cycle until then).
            self._close_cycle()
        if not len(self._cycle) and not self._holding:
            self.stop.set()  # run() drains: the cycles in flight are committed

    def _drain(self) -> None:
        super()._drain()
        if self.range is None or self._finished < set(self.range.ends):
            return  # stopped early (signal): resumable from the committed offsets
        # Offsets past the last state may be transaction markers: commit the end offsets themselves, so the
        # group's offsets say "done" exactly (a rerun then scores nothing).
        behind = [TopicPartition(self.config.topics.states, p, e, metadata=self.range.metadata(p))
                  for p, e in self.range.ends.items() if self.committed.get(p, -1) < e]
        if behind:
            try:
                self._txns.commit([], behind)
                for tp in behind:
                    self.committed[tp.partition] = tp.offset
            except AbortableError as exc:
                log.warning("final offset commit aborted (%s); a rerun finishes it", exc)

    def _rewind(self) -> None:
        """After an abort: back to the committed offsets (the range's start where nothing is committed yet)."""
        self._drop_uncommitted("transaction aborted")
        topic = self.config.topics.states
        for p in list(self._finished):
            if self.committed.get(p, -1) < self.range.ends[p]:
                self._finished.discard(p)
                self._consumer.resume([TopicPartition(topic, p)])
        for p in self.range.ends:
            if p not in self._finished:
                self._consumer.seek(TopicPartition(topic, p, self.committed.get(p, self.range.starts[p])))

    def _leave_group(self) -> None:
        self._consumer.unassign()  # never joined a group: nothing to leave

    # ---- progress ------------------------------------------------------------------------------------------
    def _tap(self, kind: str, info: dict[str, Any]) -> None:
        """Keep the committed positions and counts the progress bar and summary show, then pass the event on."""
        if kind == "committed":
            for partition, offset in info.get("offsets", []):
                self.committed[partition] = max(offset, self.committed.get(partition, -1))
            self.scored += info.get("scored", 0)
            for reason, count in (info.get("dead_letters") or {}).items():
                self.dead_letters[reason] = self.dead_letters.get(reason, 0) + count
        self._forward(kind, info)

    def done_offsets(self) -> int:
        """Offsets of the range behind the committed positions (the progress bar's position)."""
        if self.range is None:
            return 0
        return sum(max(0, min(self.committed.get(p, s), self.range.ends[p]) - s) for p, s in self.range.starts.items())


def run_replay(worker: ReplayWorker, progress: bool = True, write: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``worker`` with a progress bar (rate, ETA) on stderr; returns the summary it printed."""
    started = time.monotonic()
    bar = None

    def on_progress(kind: str, info: dict[str, Any]) -> None:
        nonlocal bar, started
        if kind == "replay_started":
            started = time.monotonic()  # the rate counts scoring, not loading the model
        if not progress:
            return
        if kind == "replay_started":
            from tqdm import tqdm

            bar = tqdm(total=info["total"], initial=worker.done_offsets(), unit="state", desc=f"replay {worker.config.worker_id}",
                       mininterval=0.5, dynamic_ncols=True)
        elif kind == "committed" and bar is not None:
            bar.update(worker.done_offsets() - bar.n)

    previous = worker._forward
    worker._forward = lambda kind, info: (previous(kind, info), on_progress(kind, info))
    try:
        worker.run()
    finally:
        if bar is not None:
            bar.update(worker.done_offsets() - bar.n)
            bar.close()
    elapsed = time.monotonic() - started
    summary = {
        "replay": worker.config.worker_id, "complete": worker.complete, "states_scored": worker.scored,
        "dead_letters": sum(worker.dead_letters.values()), "dead_letters_by_reason": worker.dead_letters,
        "seconds": round(elapsed, 2), "states_per_second": round((worker.scored + sum(worker.dead_letters.values())) / elapsed, 1) if elapsed else 0.0,
        "output_topic": worker.config.topics.probabilities, "dead_letter_topic": worker.config.topics.dead_letter,
        "ends": worker.range.ends if worker.range else {}, "committed": worker.committed,
    }
    status = "complete" if worker.complete else "interrupted (run the same command again to resume)"
    reasons = f" {worker.dead_letters}" if worker.dead_letters else ""
    write(f"replay {worker.config.worker_id}: {status}; {summary['states_scored']} states scored, {summary['dead_letters']} dead letters"
          f"{reasons} in {elapsed:.1f} s ({summary['states_per_second']} states/s) -> {summary['output_topic']}")
    return summary
