"""Whether the worker's partitions make progress: the stall checks behind ``decider_partition_stall_seconds``, the
warning that names a stalled partition and what it waits for, and ``/readyz`` (``worker.ops.liveness.PROGRESS``).

A partition can stop while everything else looks healthy, and lag that never drains is worse than a slow worker. Two
ways are watched, from a thread of their own every ``CHECK_EVERY_S`` (so a loop blocked in a call is watched too):

- input: the worker holds a states partition, records wait there (its last stable offset, from the consumer's
  statistics, is past the committed offset), and the committed offset has not moved for --stall-after-s;
- output: the newest record the worker committed to an output partition is not what a read_committed reader gets
  when it fetches from that record's offset. Either the partition's last stable offset stays at or before it (a
  transaction left open there by another producer: Kafka aborts it after that producer's transaction.timeout.ms, the
  embedded broker never does), or the reader skips it. The embedded broker (noida-db 0.2.3) causes the second: its
  Fetch response lists every aborted transaction of the partition that started before the last stable offset, even
  those whose abort marker lies before the fetch offset, and librdkafka, as the protocol says, then drops every later
  batch of that producer id on the partition. A worker keeps its producer id across restarts (the transactional id
  comes from --worker-id, for fencing), so after one SIGKILL mid-transaction a reader that follows the partition
  misses all the worker's later records there. Kafka lists only the aborted transactions that overlap the fetch.

A stall is reported once it has lasted --stall-after-s (a warning, then one every --stall-after-s while it lasts) and
``/readyz`` answers 503 until it clears; ``decider_partition_stall_seconds`` shows it building up before that.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from confluent_kafka import Consumer, KafkaError, TopicPartition

from worker.config import WorkerConfig
from worker.kafka_clients import reader_consumer
from worker.ops import liveness, metrics

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0
"""How often the watch looks: a stall is a matter of minutes, and each output check is one fetch per partition."""
READ_BACK_TIMEOUT_S = 3.0
"""How long one read-back waits for the record (or the end of the partition) before it looks at the last stable offset."""

PartitionKey = tuple[str, int]


@dataclass
class _Input:
    committed: int | None = None  # the next offset to read, as committed (the group's at assignment, then ours)
    end: int | None = None  # the partition's last stable offset, from the consumer's statistics
    since: float = 0.0  # when it last advanced, or last had nothing waiting


class InputProgress:
    """Per assigned states partition: whether records wait while its committed offset stands still. Fed from the
    loop's events and the consumer's statistics (other threads than the watch's), hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[int, _Input] = {}

    def assigned(self, partitions: Iterable[int], now: float) -> None:
        with self._lock:
            for partition in partitions:
                self._partitions.setdefault(partition, _Input(since=now))

    def revoked(self, partitions: Iterable[int]) -> None:
        with self._lock:
            for partition in partitions:
                self._partitions.pop(partition, None)

    def committed(self, offsets: Iterable[tuple[int, int]], now: float) -> None:
        """The loop committed ``(partition, next offset)`` pairs."""
        with self._lock:
            for partition, offset in offsets:
                state = self._partitions.get(partition)
                if state is not None and (state.committed is None or offset > state.committed):
                    state.committed, state.since = offset, now

    def observed(self, partition: int, end: int, group_committed: int) -> None:
        """The consumer's statistics: the partition's last stable offset, and the committed offset librdkafka read at
        assignment (it does not see offsets committed through the producer's transactions: ours come by ``committed``)."""
        with self._lock:
            state = self._partitions.get(partition)
            if state is None:
                return
            state.end = end if end >= 0 else state.end
            if group_committed >= 0 and (state.committed is None or group_committed > state.committed):
                state.committed = group_committed

    def waiting(self, now: float) -> dict[int, tuple[float, int, int]]:
        """Partitions with records waiting: {partition: (seconds without progress, committed, end)}. A partition with
        nothing waiting (or not known yet) restarts its clock: an idle partition is not a stalled one."""
        found = {}
        with self._lock:
            for partition, state in self._partitions.items():
                if state.committed is None or state.end is None or state.end <= state.committed:
                    state.since = now
                else:
                    found[partition] = (now - state.since, state.committed, state.end)
        return found


@dataclass
class _Output:
    offset: int  # the newest record this worker committed to the partition
    committed_at: float
    problem: str | None = None  # what reading it back found, while it is not readable


class OutputVisibility:
    """The newest committed record per output partition, until a read_committed reader has been seen to get it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unverified: dict[PartitionKey, _Output] = {}
        self._problem_since: dict[PartitionKey, float] = {}

    def committed(self, newest: Mapping[PartitionKey, int], now: float) -> None:
        with self._lock:
            for key, offset in newest.items():
                current = self._unverified.get(key)
                if current is None or offset > current.offset:
                    self._unverified[key] = _Output(offset, now, current.problem if current else None)

    def check(self, reader: Consumer, now: float) -> None:
        """Read each unverified record back (one fetch each); a readable one clears its partition."""
        with self._lock:
            pending = dict(self._unverified)
        for key, output in pending.items():
            found = read_back(reader, key, output.offset)
            with self._lock:
                if found == "":
                    if self._unverified.get(key) is output:
                        del self._unverified[key]
                    self._problem_since.pop(key, None)
                elif found is not None:
                    output.problem = found
                    self._problem_since.setdefault(key, now)

    def unreadable(self, now: float) -> dict[PartitionKey, tuple[float, str]]:
        """{partition: (seconds since a read-back first failed, what it found)}."""
        with self._lock:
            return {key: (now - since, self._unverified[key].problem or "")
                    for key, since in self._problem_since.items() if key in self._unverified}


def read_back(reader: Consumer, key: PartitionKey, offset: int) -> str | None:
    """Fetch ``key`` from ``offset`` as a read_committed reader: "" if the record there comes back, else what came
    instead (None: nothing known yet, e.g. no answer in time)."""
    topic, partition = key
    reader.assign([TopicPartition(topic, partition, offset)])
    deadline = time.monotonic() + READ_BACK_TIMEOUT_S
    got = None  # what came instead of the record: a later offset, or the partition's end
    try:
        while got is None and time.monotonic() < deadline:
            message = reader.poll(0.1)
            if message is None:
                continue
            error = message.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                log.debug("reading %s[%d] back from offset %d: %s", topic, partition, offset, error.str())
                return None
            if error is None and message.offset() == offset:
                return ""
            got = "the partition's end" if error is not None else f"offset {message.offset()}"
        # a fetch from past the last stable offset returns nothing at all, not even the end
        stable = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=READ_BACK_TIMEOUT_S)[1]
    finally:
        reader.unassign()
    if stable <= offset:
        return (f"its last stable offset stays at {stable}, at or before offset {offset} that this worker committed: "
                "a transaction open there holds every read_committed reader")
    if got is None:
        log.debug("reading %s[%d] back from offset %d: nothing in %.0f s (last stable offset %d)", topic, partition,
                  offset, READ_BACK_TIMEOUT_S, stable)
        return None
    return (f"a read_committed reader fetching from offset {offset}, which this worker committed, gets {got} instead "
            f"(last stable offset {stable}): the broker lists an aborted transaction of this producer id that ended "
            "before that offset, so readers skip the producer's later records (the embedded broker does this after a "
            "worker was killed mid-transaction; Kafka does not)")


def describe_input_wait(partition: int, cycle: Any, inflight: list[Any]) -> str:
    """What a stalled states partition waits for, as the loop's open cycle (``worker.stream.batcher.Cycle``) and its cycles in
    flight (``worker.stream.inflight.InFlight``) show it. Read from the watch's thread: a snapshot, good enough for a log line."""
    held = [p for p in list(cycle.waiting) if p.source.partition == partition]
    if held:
        schema = (held[0].state or {}).get("schema_id")
        return f"{len(held)} of its states wait for schema {schema!r}, and the states after them in the partition with them"
    for waiting in inflight:
        if any(tp.partition == partition for tp in waiting.cycle.offsets()):
            scored = "scored, not committed" if waiting.future.done() else "not scored yet"
            return f"a cycle with its states was submitted {time.monotonic() - waiting.closed_at:.0f} s ago and is {scored}"
    if any(p.source.partition == partition for p in cycle.entries):
        return "its states are in the open cycle, which has not closed"
    return ("the loop holds none of its states: nothing was fetched (the consumer's position is at the committed "
            "offset), or what was fetched was dropped by aborts")


class ProgressWatch:
    """Watches the loop's partitions from its own thread; ``on_event`` takes the loop's events (assigned, revoked,
    lost, committed). ``describe(partition)`` says what a stalled states partition waits for, as the loop sees it."""

    def __init__(self, states_topic: str, stall_after_s: float, describe: Callable[[int], str] = lambda partition: "") -> None:
        self._reader: Consumer | None = None  # set by ``start``
        self._states_topic, self._stall_after_s = states_topic, stall_after_s
        self._cluster = None  # where ``start`` connects its reader, when ``of`` made the watch
        self._describe = describe
        self.inputs, self.outputs = InputProgress(), OutputVisibility()
        self._reported: dict[str, float] = {}  # stall -> when it was last warned about
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decider-progress", daemon=True)

    @classmethod
    def of(cls, config: WorkerConfig, describe: Callable[[int], str]) -> "ProgressWatch":
        """The watch of a loop run with ``config``; ``start()`` reads back through a reader of ``config``'s cluster."""
        watch = cls(config.topics.states, config.stall_after_s, describe)
        watch._cluster = config.cluster
        return watch

    def start(self, reader: Consumer | None = None) -> None:
        """Watch from now on, reading output partitions back with ``reader`` (default: a read_committed reader of the
        cluster ``of`` was given); the watch closes it."""
        self._reader = reader if reader is not None else reader_consumer(self._cluster)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(READ_BACK_TIMEOUT_S + 1)
        if self._reader is not None:
            self._reader.close()
        liveness.PROGRESS.report(None)

    def chained(self, sink: Callable[[str, dict[str, Any]], None] | None) -> Callable[[str, dict[str, Any]], None]:
        """An event sink that hands each event to the watch, then to ``sink`` (if any)."""
        def emit(kind: str, info: dict[str, Any]) -> None:
            self.on_event(kind, info)
            if sink is not None:
                sink(kind, info)
        return emit

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if kind == "assigned":
            self.inputs.assigned(info["partitions"], now)
        elif kind in ("revoked", "lost"):
            self.inputs.revoked(info["partitions"])
        elif kind == "committed":
            self.inputs.committed(info.get("offsets", ()), now)
            self.outputs.committed(info.get("outputs", {}), now)

    def _run(self) -> None:
        # short bounds (tests, impatient operators) are checked often enough to be met within a quarter of them
        while not self._stop.wait(min(CHECK_EVERY_S, self._stall_after_s / 4)):
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - the watch must outlive a broker hiccup; the loop reports real failures
                log.debug("progress check failed", exc_info=True)

    def check(self, now: float) -> list[str]:
        """Look once; returns the stalls found (each also logged, counted and on /readyz)."""
        for (topic, partition), (end, committed) in liveness.PARTITION_ENDS.snapshot().items():
            if topic == self._states_topic:
                self.inputs.observed(partition, end, committed)
        self.outputs.check(self._reader, now)
        stalls, seen = [], set()
        for partition, (seconds, committed, end) in self.inputs.waiting(now).items():
            label = (self._states_topic, str(partition))
            seen.add(label)
            metrics.PARTITION_STALL_SECONDS.labels(*label).set(seconds)
            if seconds >= self._stall_after_s:
                waits_for = self._describe(partition)
                stalls.append(f"{self._states_topic}[{partition}] has not advanced for {seconds:.0f} s with "
                              f"{end - committed} records waiting (committed {committed}, end {end})"
                              + (f": {waits_for}" if waits_for else ""))
        for (topic, partition), (seconds, problem) in self.outputs.unreadable(now).items():
            label = (topic, str(partition))
            seen.add(label)
            metrics.PARTITION_STALL_SECONDS.labels(*label).set(seconds)
            if seconds >= self._stall_after_s:
                stalls.append(f"{topic}[{partition}] for {seconds:.0f} s: {problem}")
        metrics.clear_stall_seconds(keep=seen)
        self._report(stalls, now)
        return stalls

    def _report(self, stalls: list[str], now: float) -> None:
        for stall in stalls:
            key = stall.split(" ", 1)[0]
            if now - self._reported.get(key, -float("inf")) >= self._stall_after_s:
                self._reported[key] = now
                metrics.PARTITION_STALLS.inc()
                log.warning("stalled partition: %s", stall)
        self._reported = {k: v for k, v in self._reported.items() if any(s.startswith(k + " ") for s in stalls)}
        liveness.PROGRESS.report("; ".join(stalls) if stalls else None)
