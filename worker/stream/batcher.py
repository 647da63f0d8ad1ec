"""Micro-batching: states gathered per schema into the open *cycle*, which becomes one transaction.

A cycle closes at ``max_batch`` states (of all its schemas together: the engine scores them as one GPU batch, each
row reading its own schema's prefix) or ``max_wait`` after its first state, whichever comes first.
Kafka offsets are a per-partition watermark, so output must be committed in input order: every open batch (states of
other schemas, interleaved in the same partitions) is scored together and the whole cycle commits as one transaction. A state that names a
schema not seen yet waits (up to ``--schema-wait-ms``) and holds back only its own partition: when the cycle
closes, that state and every later one of its partition are carried into the next cycle (``carry_held``), the
offset committed for the partition stops just before it, and every other partition commits as usual.

Only bookkeeping lives here: the loop prepares schemas and starts tokenizing (``worker.stream.scorer``) and hands
the cycle the futures; the batcher never calls the scorer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

from confluent_kafka import TopicPartition

from worker.formats.records import OutgoingRecord, Reason, SchemaKey, SourceRecord


@dataclass
class Pending:
    """One consumed state and what became of it so far."""

    source: SourceRecord
    state: dict[str, Any] | None = None  # the decoded StateEvent
    dead_letter: OutgoingRecord | None = None  # decided without scoring ...
    reason: Reason | None = None  # ... for this reason
    batch_key: SchemaKey | None = None  # in this batch ...
    batch_index: int = -1  # ... at this position
    wait_deadline: float | None = None  # waiting for its schema until this monotonic time
    arrived: float = 0.0  # when it arrived (its record's timestamp, on the monotonic clock), once tracked


@dataclass
class Batch:
    """States of one schema version, in arrival order, with the prepared schema's and their tokenization futures."""

    schema: dict[str, Any]
    handle: Future  # of the prepared schema
    opened_at: float
    members: list[Pending] = field(default_factory=list)
    rows: list[Future] = field(default_factory=list)  # of tokenized rows, one per member
    carried: int = 0  # members carried over from an earlier cycle: they do not make the batch full

    @property
    def key(self) -> SchemaKey:
        """(schema id, version) of this batch."""
        return (self.schema["schema_id"], self.schema["version"])


class Cycle:
    """Everything consumed since the last commit: the unit of one transaction."""

    def __init__(self) -> None:
        self.entries: list[Pending] = []  # consume order: output follows input order
        self.batches: dict[SchemaKey, Batch] = {}
        self.waiting: list[Pending] = []
        self.opened_at: float | None = None
        self.arrived_at: float | None = None  # the earliest arrival of its states (the latency budget's clock)
        self._next_offsets: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def track(self, pending: Pending, now: float, arrived: float | None = None) -> None:
        """Record that ``pending`` was consumed at ``now``: it is part of this cycle's transaction and offsets.
        ``arrived``: when it arrived, if earlier than ``now`` (its record's timestamp, on the same clock)."""
        if self.opened_at is None:
            self.opened_at = now
        arrived = now if arrived is None else min(arrived, now)
        pending.arrived = arrived
        self.arrived_at = arrived if self.arrived_at is None else min(self.arrived_at, arrived)
        self.entries.append(pending)
        source = pending.source
        self._next_offsets[(source.topic, source.partition)] = source.offset + 1

    def offsets(self) -> list[TopicPartition]:
        """The offsets to commit with this cycle: next offset to read, per partition consumed."""
        return [TopicPartition(topic, partition, offset) for (topic, partition), offset in self._next_offsets.items()]

    def add_to_batch(self, pending: Pending, schema: dict[str, Any], handle: Future, row: Future, now: float) -> None:
        """Queue ``pending`` in ``schema``'s batch, with the futures of the prepared schema and of its tokenized row."""
        key: SchemaKey = (schema["schema_id"], schema["version"])
        batch = self.batches.get(key)
        if batch is None:
            batch = self.batches[key] = Batch(schema=schema, handle=handle, opened_at=now)
        pending.batch_key, pending.batch_index = key, len(batch.members)
        pending.wait_deadline = None
        batch.members.append(pending)
        batch.rows.append(row)

    def add_waiting(self, pending: Pending, deadline: float) -> None:
        """Hold ``pending`` until its schema appears or ``deadline`` passes."""
        pending.wait_deadline = deadline
        self.waiting.append(pending)

    def full(self, max_batch: int) -> bool:
        """Whether the batches hold ``max_batch`` states together (every schema's states score as one GPU batch; states
        carried over, which stay held back, do not count)."""
        if len(self.entries) < max_batch:   # the batches' states are some of its entries: asked for every state taken
            return False
        return sum(len(b.members) - b.carried for b in self.batches.values()) >= max_batch

    def due(self, now: float, max_batch: int, max_wait_s: float) -> bool:
        """Whether the cycle should close now: a batch is full, or a batch (or a lone dead letter) has waited max_wait."""
        if not self.entries:
            return False
        return self.full(max_batch) or self.seconds_until_due(now, max_wait_s) == 0

    def seconds_until_due(self, now: float, max_wait_s: float) -> float | None:
        """How long until ``due`` turns true by time alone (None when the cycle is empty)."""
        if not self.entries:
            return None
        first = min((b.opened_at for b in self.batches.values()), default=self.opened_at)
        return max(0.0, first + max_wait_s - now)

    def wait_deadline(self) -> float | None:
        """When the first wait for a schema runs out (None when no state waits): the cycle closes then, so that
        the state goes to the dead letters and its partition flows again."""
        return min((p.wait_deadline for p in self.waiting), default=None)

    def carry_held(self, now: float) -> "Cycle":
        """Move every state held back by a wait for its schema into a new cycle, which is returned: per partition,
        the first waiting state and every state after it. This cycle keeps the rest (it can commit now) and commits
        each held partition's offset up to, not including, its first waiting state."""
        first_held: dict[tuple[str, int], int] = {}
        for pending in self.waiting:
            where = (pending.source.topic, pending.source.partition)
            first_held[where] = min(first_held.get(where, pending.source.offset), pending.source.offset)
        return self._carry_from(first_held, now, held=True)

    def carry_tail(self, scored: int, now: float) -> "Cycle":
        """Keep this cycle's first ``scored`` batched states (in consume order, with the dead letters among them) and
        move every state after them into a new cycle, which is returned: it goes on with their batches, is open and
        arrived since the earliest of them arrived (each batch since its earliest), and its states count towards a full
        batch. Per partition, the states moved are its last ones, so the offsets this cycle commits stop before them.
        Call it on a cycle with no state waiting for its schema (``carry_held`` first)."""
        kept = 0
        for cut, pending in enumerate(self.entries):
            if pending.batch_key is not None:
                if kept == scored:
                    break
                kept += 1
        else:
            return Cycle()
        first_moved: dict[tuple[str, int], int] = {}
        for pending in self.entries[cut:]:
            first_moved.setdefault((pending.source.topic, pending.source.partition), pending.source.offset)
        tail = self._carry_from(first_moved, now, held=False)   # tracked with their own arrivals (``_carry_in``)
        # open since the earliest of them arrived, not since now, nor since this cycle's first state: a state moved on
        # at each close would otherwise pass the first one's arrival on
        tail.opened_at = tail.arrived_at
        for batch in tail.batches.values():
            batch.opened_at = min(member.arrived for member in batch.members)
        return tail

    def _carry_from(self, first: dict[tuple[str, int], int], now: float, held: bool) -> "Cycle":
        """Move, per partition of ``first``, the state at its offset and every later one into a new cycle (``held``:
        they wait for a schema, and do not make a batch full); this cycle's offsets stop before them."""
        carried = Cycle()
        if not first:
            return carried
        kept = []
        for pending in self.entries:
            where = (pending.source.topic, pending.source.partition)
            if where in first and pending.source.offset >= first[where]:
                carried._carry_in(pending, self.batches.get(pending.batch_key), now, held)
            else:
                kept.append(pending)
        self.entries = kept
        if held:
            self.waiting = []
        self._keep_batch_members({id(p) for p in kept})
        for (topic, partition), offset in first.items():
            self._next_offsets[(topic, partition)] = offset
        return carried

    def _carry_in(self, pending: Pending, batch: Batch | None, now: float, held: bool = True) -> None:
        """Take ``pending`` over from the cycle it was moved out of (``batch``: its batch there, if any; ``held``:
        waiting for a schema, not counted towards a full batch)."""
        self.track(pending, now, None if held else pending.arrived)
        if pending.dead_letter is not None:
            return
        if batch is not None:
            self.add_to_batch(pending, batch.schema, batch.handle, batch.rows[pending.batch_index], now)
            if held:
                self.batches[batch.key].carried += 1
        else:
            self.add_waiting(pending, pending.wait_deadline)

    def forget_partitions(self, partitions: Collection[tuple[str, int]], scored: bool = False) -> list[Pending]:
        """Remove the states of ``partitions`` (topic, partition: the worker gave them up in a rebalance) and their
        offsets, so that nothing of them commits; returns the removed states. A cycle being scored (``scored``) keeps its
        batches whole, since its scores come back by position in them; an open cycle drops them from its batches too."""
        gone = set(partitions)
        removed = [p for p in self.entries if (p.source.topic, p.source.partition) in gone]
        if not removed and not gone & self._next_offsets.keys():
            return []
        self.entries = [p for p in self.entries if (p.source.topic, p.source.partition) not in gone]
        self.waiting = [p for p in self.waiting if (p.source.topic, p.source.partition) not in gone]
        for where in gone:
            self._next_offsets.pop(where, None)
        if not scored:
            self._keep_batch_members({id(p) for p in self.entries})
            if not self.entries:
                self.opened_at = self.arrived_at = None
        return removed

    def _keep_batch_members(self, kept: set[int]) -> None:
        """Drop from the batches the members not in ``kept`` (by ``id``), and batches left empty."""
        for key in list(self.batches):
            batch = self.batches[key]
            batch.carried = sum(1 for m in batch.members[:batch.carried] if id(m) in kept)  # carried ones come first
            pairs = [(m, r) for m, r in zip(batch.members, batch.rows) if id(m) in kept]
            if not pairs:
                del self.batches[key]
                continue
            batch.members, batch.rows = [m for m, _ in pairs], [r for _, r in pairs]
            for index, member in enumerate(batch.members):
                member.batch_index = index

    def take_waiting(self) -> list[Pending]:
        """Remove and return the states waiting for a schema (the caller routes each one again)."""
        waiting, self.waiting = self.waiting, []
        return waiting

    def take_stale(self, latest_version: Callable[[str], int | None]) -> list[Batch]:
        """Remove and return the batches whose schema got a new version (or a tombstone) since they opened, so
        the caller can release their schema and route their states to the latest version known now."""
        stale = [self.batches.pop(key) for key in list(self.batches) if latest_version(key[0]) != key[1]]
        for batch in stale:
            for member in batch.members:
                member.batch_key, member.batch_index = None, -1
        return stale

    def pins(self) -> Iterator[SchemaKey]:
        """The schema key of every batched state: one pin each on its prepared schema, held until the cycle ends."""
        for key, batch in self.batches.items():
            for _ in batch.members:
                yield key


def monotonic() -> float:
    """The clock batches are timed with."""
    return time.monotonic()
