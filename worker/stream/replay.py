"""``decider replay``: score a historical range of a states topic into a chosen output topic, exactly once.

A replay is the worker's loop (``worker.stream.loop.Worker``) given a ``RangeAssignment`` instead of the consumer group:
- a fixed assignment of the range's partitions, outside any consumer group's rebalancing, starting at the
  range's first offsets (or where an earlier run of the same replay committed);
- no deadline (its config has no ``max_wait_ms``): cycles close only when a batch is full (``--max-batch``),
  and the range's end closes the last;
- it stops by itself once every partition reached its end offset and everything before it is committed.

Exactly once and resumable: every cycle commits its records with its input offsets in one transaction, under
the replay's own group id (``decider-replay.NAME``) and transactional id (so a second run of the same NAME
fences the first). The range is stored in the committed offsets' metadata at the first commit, with the range
flags that chose it; a rerun with the same NAME and the same flags (after a kill -9, say) resumes from the committed
offsets and stops at the stored end offsets, whatever those flags would resolve to now. A rerun with different range
flags is refused: a replay's range never changes (a new --name starts a new one).

Verified (``--verify-against TOPIC``, ``worker.stream.verify``): once the range is complete, the replay's records of
it are compared with the live records of the same states in TOPIC, per schema version: compared, bit-identical,
differing, and not comparable because their scoring fingerprints differ (naming the part). A rerun of a finished
replay scores nothing and verifies again.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from typing import Any, Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from worker.stream.assignment import DropUncommitted, EventSink
from worker.config import Topics, WorkerConfig
from worker.exceptions import AbortableError, ConfigError, FatalError
from worker.kafka_clients import replay_consumer_config, require_topics
from worker.ops.wording import counted
from worker.stream.group_metadata import GroupMetadata
from worker.stream.loop import Worker
from worker.stream.replay_range import Bound, ReplayRange, resolve_range, shown
from worker.stream.turns import TakingTurns
from worker.stream.verify import verify_replay

log = logging.getLogger(__name__)

_META = re.compile(r"decider-replay:v1:start=(\d+):end=(\d+)(?::flags=(.*))?")


def replay_group(name: str) -> str:
    """The consumer group whose committed offsets hold the replay's progress and range."""
    return f"decider-replay.{name}"


class RangeAssignment:
    """A fixed range of the states topic, assigned without a group (``worker.stream.assignment.Assignment``); ``range``
    and ``committed`` (next offset per partition) say how far it got."""

    def __init__(self, config: WorkerConfig, start: Bound, end: Bound, partitions: list[int] | None = None,
                 on_event: EventSink | None = None) -> None:
        self._config = config
        self._start, self._end, self._partitions = start, end, partitions
        self._emit = on_event or (lambda kind, info: None)
        self._consumer: Consumer | None = None
        self.range: ReplayRange | None = None
        self.committed: dict[int, int] = {}
        self._finished: set[int] = set()
        self.metadata = GroupMetadata()   # a replay assigns its partitions itself: no rebalance moves it

    @property
    def complete(self) -> bool:
        """Every partition of the range is scored and committed up to its end offset."""
        return self.range is not None and all(self.committed.get(p, -1) >= e for p, e in self.range.ends.items())

    def done_offsets(self) -> int:
        """Offsets of the range behind the committed positions (the progress bar's position)."""
        if self.range is None:
            return 0
        return sum(max(0, min(self.committed.get(p, s), self.range.ends[p]) - s) for p, s in self.range.starts.items())

    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(replay_consumer_config(self._config))
        return self._consumer

    def check(self) -> None:
        """What the range needs of the broker, checked before the model loads (seconds on a CPU, minutes for a large
        model on a GPU): the topics and partitions exist, the range does not end before it starts, and a rerun of this
        replay gives the range it was started with. ``ConfigError`` (exit 2) otherwise.

        It reads the committed offsets as they were before any open transaction: an earlier run killed mid-
        transaction leaves its offsets pending until this run's producer aborts them (``init_transactions``, after
        the model loads), and a read_committed consumer asks for stable offsets only (Apache Kafka answers
        UNSTABLE_OFFSET_COMMIT, which librdkafka retries until its timeout). The stored range is in the first
        transaction, long committed; ``start`` reads the positions again, stable, once the producer has fenced."""
        topics = self._config.topics
        require_topics(self._config.cluster, topics.all(), roles=topics)
        settings = {**replay_consumer_config(self._config), "isolation.level": "read_uncommitted"}
        for key in ("stats_cb", "statistics.interval.ms"):  # a peek, not the reader the metrics watch
            settings.pop(key)
        peek = Consumer(settings)
        try:
            self._plan(peek)
        finally:
            peek.close()

    def _plan(self, consumer: Consumer) -> tuple[list[int], ReplayRange, dict[int, int], ReplayRange | None]:
        """(the partitions replayed, the range the flags give now, the committed positions, the range an earlier run
        stored); ``ConfigError`` where they do not fit together."""
        topic = self._config.topics.states
        available = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        partitions = self._partitions if self._partitions is not None else available
        if set(partitions) - set(available):
            raise ConfigError(f"--partitions {sorted(set(partitions) - set(available))}: topic {topic} has {available}")
        wanted = resolve_range(consumer, topic, partitions, self._start, self._end)
        positions, stored = self._committed_positions(consumer, topic, partitions)
        if stored is not None and stored.flags is not None and stored.flags != wanted.flags:
            raise ConfigError(f"replay {self._config.worker_id} was started with {shown(stored.flags)}, not "
                              f"{shown(wanted.flags)}: a replay's range never changes. Rerun with its flags to resume "
                              "it, or choose a new --name to replay another range")
        return partitions, wanted, positions, stored

    def start(self, consumer: Consumer, txns: TakingTurns, drop_uncommitted: DropUncommitted) -> None:
        topic = self._config.topics.states
        partitions, wanted, positions, stored = self._plan(consumer)
        name = self._config.worker_id
        if stored is not None:
            log.info("resuming replay %s from its committed offsets %s", name, positions)
        self.range = stored or wanted
        if stored is None:
            # Make the range durable before scoring anything: a rerun after a kill must find the same end
            # offsets for every partition, including those with nothing committed yet.
            try:
                txns.commit([], [TopicPartition(topic, p, self.range.starts[p], metadata=self.range.metadata(p))
                                 for p in partitions])
            except AbortableError as exc:
                raise FatalError(f"could not record the replay's range in group {self._config.group}: {exc}") from exc
            positions = dict(self.range.starts)
        self.committed = {p: positions.get(p, self.range.starts[p]) for p in partitions}
        self._finished = {p for p in partitions if self.committed[p] >= self.range.ends[p]}
        self._emit("replay_started", {"topic": topic, "starts": self.range.starts, "ends": self.range.ends,
                                      "resumed_from": positions, "total": self.range.total})
        todo = [TopicPartition(topic, p, self.committed[p]) for p in partitions if p not in self._finished]
        if todo:
            consumer.assign(todo)

    def _committed_positions(self, consumer: Consumer, topic: str, partitions: list[int]) -> tuple[dict[int, int], ReplayRange | None]:
        """Offsets an earlier run of this replay committed, and the range it stored with them."""
        try:
            committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        except KafkaException as exc:
            raise FatalError(f"cannot read the committed offsets of replay group {self._config.group}: {exc.args[0].str()}") from exc
        positions, starts, ends, flags = {}, {}, {}, None
        for tp in committed:
            if tp.offset >= 0:
                positions[tp.partition] = tp.offset
            match = _META.fullmatch(tp.metadata or "")
            if match:
                starts[tp.partition], ends[tp.partition], flags = int(match[1]), int(match[2]), match[3]
        if not starts:
            return positions, None
        if set(starts) != set(partitions):
            raise ConfigError(f"replay {self._config.worker_id} was started on partitions {sorted(starts)}, not {sorted(partitions)}: "
                              "pass the same --partitions, or choose a new --name")
        return positions, ReplayRange(starts, ends, flags)

    def accepts(self, message: Any) -> bool:
        """Not a record past the range's end, nor the end-of-partition event at it: both finish the partition."""
        partition, error = message.partition(), message.error()
        end = self.range.ends.get(partition) if partition is not None and partition >= 0 else None
        if error is not None and error.code() == KafkaError._PARTITION_EOF:
            if end is not None and message.offset() >= end:
                self._finish(partition)
            return False
        if error is None and end is not None and message.offset() >= end:
            self._finish(partition)  # past the range: not tracked, never scored
            return False
        return True

    def _finish(self, partition: int) -> None:
        if partition not in self._finished:
            self._finished.add(partition)
            self._consumer.pause([TopicPartition(self._config.topics.states, partition)])

    def commit_offsets(self, offsets: list[TopicPartition]) -> list[TopicPartition]:
        """Each offset carries the range, so a rerun finds it."""
        return [TopicPartition(tp.topic, tp.partition, tp.offset, metadata=self.range.metadata(tp.partition)) for tp in offsets]

    def on_committed(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            self.committed[tp.partition] = max(tp.offset, self.committed.get(tp.partition, -1))

    def rewind_positions(self, consumer: Consumer) -> list[TopicPartition]:
        """The committed positions (the range's start where nothing is committed yet) of every partition not done."""
        topic = self._config.topics.states
        for p in list(self._finished):
            if self.committed.get(p, -1) < self.range.ends[p]:
                self._finished.discard(p)
                consumer.resume([TopicPartition(topic, p)])
        return [TopicPartition(topic, p, self.committed.get(p, self.range.starts[p]))
                for p in self.range.ends if p not in self._finished]

    def exhausted(self) -> bool:
        return self.range is not None and self._finished >= set(self.range.ends)

    def finish(self, txns: TakingTurns) -> None:
        """Once the range is read: commit its end offsets themselves (offsets past the last state may be transaction
        markers), so the group's offsets say "done" exactly and a rerun scores nothing."""
        if not self.exhausted():
            return  # stopped early (signal): resumable from the committed offsets
        behind = [TopicPartition(self._config.topics.states, p, e, metadata=self.range.metadata(p))
                  for p, e in self.range.ends.items() if self.committed.get(p, -1) < e]
        if behind:
            try:
                txns.commit([], behind)
                self.on_committed(behind)
            except AbortableError as exc:
                log.warning("final offset commit aborted (%s); a rerun finishes it", exc)

    def leave(self, consumer: Consumer) -> None:
        consumer.unassign()  # never joined a group: nothing to leave


class _Tally:
    """What a replay's summary counts, from the loop's ``committed`` events; drives the progress bar."""

    def __init__(self, assignment: RangeAssignment, name: str, progress: bool) -> None:
        self._assignment, self._name, self._progress = assignment, name, progress
        self.scored = 0
        self.dead_letters: Counter[str] = Counter()
        self.started = time.monotonic()
        self._bar = None

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "replay_started":
            self.started = time.monotonic()  # the rate counts scoring, not loading the model
            if self._progress:
                from tqdm import tqdm

                self._bar = tqdm(total=info["total"], initial=self._assignment.done_offsets(), unit="state",
                                 desc=f"replay {self._name}", mininterval=0.5, dynamic_ncols=True)
        elif kind == "committed":
            self.scored += info.get("scored", 0)
            self.dead_letters.update(info.get("dead_letters") or {})
            self.update_bar()

    def update_bar(self) -> None:
        if self._bar is not None:
            self._bar.update(self._assignment.done_offsets() - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self.update_bar()
            self._bar.close()


def run_replay(config: WorkerConfig, start: Bound, end: Bound, partitions: list[int] | None = None,
               stop: threading.Event | None = None, on_event: EventSink | None = None, progress: bool = True,
               write: Callable[[str], None] = print, verify_against: str | None = None) -> dict[str, Any]:
    """Replay the range with a progress bar (rate, ETA) on stderr; returns the summary it wrote (its last line), with
    the verification's report under ``verify`` when ``verify_against`` names the live records' topic (checked to
    exist before anything is scored; the report's lines are written after the summary)."""
    if verify_against is not None:
        require_topics(config.cluster, [verify_against], roles=Topics(probabilities=verify_against))
    forward = on_event or (lambda kind, info: None)
    tally: _Tally | None = None

    def on_loop_event(kind: str, info: dict[str, Any]) -> None:
        tally.on_event(kind, info)
        forward(kind, info)

    assignment = RangeAssignment(config, start, end, partitions, on_event=on_loop_event)
    assignment.check()  # before the model loads
    tally = _Tally(assignment, config.worker_id, progress)
    # Log lines go through tqdm while the bar is shown, so they print above it instead of into it.
    logs_above_bar = _logging_redirect_tqdm() if progress else contextlib.nullcontext()
    try:
        with logs_above_bar:
            Worker(config, assignment, stop=stop, on_event=on_loop_event).run()
    finally:
        tally.close()
    summary = _summary(config, assignment, tally, write)
    if verify_against is not None and assignment.complete:
        report = verify_replay(config.cluster, config.topics.probabilities, verify_against, config.topics.states,
                               assignment.range.starts, assignment.range.ends, config.registry)
        for line in report.lines():
            write(line)
        summary["verify"] = report.as_dict()
    elif verify_against is not None:
        write("verify: skipped, the replay stopped before the end of its range (rerun it to finish and verify)")
    return summary


def _logging_redirect_tqdm():
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def replay_dead_letter_topic(output_topic: str) -> str:
    """A replay's dead-letter topic when none is given: next to its output topic, never the live one."""
    return f"{output_topic}.dead-letter"


def _summary(config: WorkerConfig, assignment: RangeAssignment, tally: _Tally, write: Callable[[str], None]) -> dict[str, Any]:
    elapsed = time.monotonic() - tally.started
    dead = sum(tally.dead_letters.values())
    summary = {
        "replay": config.worker_id, "complete": assignment.complete, "states_scored": tally.scored,
        "dead_letters": dead, "dead_letters_by_reason": dict(tally.dead_letters),
        "seconds": round(elapsed, 2), "states_per_second": round((tally.scored + dead) / elapsed, 1) if elapsed else 0.0,
        "output_topic": config.topics.probabilities, "dead_letter_topic": config.topics.dead_letter,
        "ends": assignment.range.ends if assignment.range else {}, "committed": assignment.committed,
    }
    status = "complete" if assignment.complete else "interrupted (run the same command again to resume)"
    reasons = f" {dict(tally.dead_letters)}" if tally.dead_letters else ""
    write(f"replay {config.worker_id}: {status}; {counted(summary['states_scored'], 'state')} scored, "
          f"{counted(summary['dead_letters'], 'dead letter')}"
          f"{reasons} in {elapsed:.1f} s ({summary['states_per_second']} states/s) -> {summary['output_topic']}")
    return summary
