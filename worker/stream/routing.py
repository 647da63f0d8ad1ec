"""Routing: which part of the open cycle a decoded state joins, kept right as the schema topic changes.

A state whose schema is in the table joins that schema version's batch: the schema is prepared on first sight and
the state's tokenization starts with the others routed with it, on the scorer's pool, so its row is usually ready
when the batch closes. A state naming a schema never seen waits (up to ``--schema-wait-ms``, holding back only later
states of its own partition: ``worker.stream.batcher``); one naming a broken or a deleted schema, or one whose wait ran
out, becomes a dead letter. When the schema topic changes, waiting states are routed again, and before a cycle closes
its batches of superseded or deleted versions are too.
"""

from __future__ import annotations

from concurrent.futures import Future

from worker.stream.assignment import EventSink
from worker.stream.batcher import Cycle, Pending, monotonic
from worker.config import WorkerConfig
from worker.stream.outputs import Outputs
from worker.formats.records import Reason
from worker.stream.schema_table import BrokenSchema, Change, SchemaTable
from worker.stream.scorer import Scorer
from worker.stream.tokenizing import RowSlot


TOKENIZE_CHUNK = 16
"""States routed to one schema version whose tokenization goes to the tokenizer pool as one job (``Router.flush``):
one submit and one tokenizer call for them all, and a backlog's first states tokenized while the rest are routed."""


class Router:
    """Routes decoded states into a cycle with the schema table's current view. A state routed to a batch is tokenized
    with the others routed with it: ``flush`` (after each fetched group of messages, and every ``TOKENIZE_CHUNK``
    states of a schema version) hands them to the tokenizer pool."""

    def __init__(self, config: WorkerConfig, table: SchemaTable, scorer: Scorer, outputs: Outputs, emit: EventSink) -> None:
        self._config, self._table, self._scorer, self._outputs, self._emit = config, table, scorer, outputs, emit
        self._schema_wait_s = config.schema_wait_ms / 1000
        self._untokenized: dict[Future, tuple[list[str], list[RowSlot]]] = {}  # by prepared schema's future

    def flush(self) -> None:
        """Start tokenizing every state routed since the last flush, one job per schema version."""
        for handle, (texts, slots) in self._untokenized.items():
            self._scorer.tokenize_many(handle, texts, slots)
        self._untokenized.clear()

    def route(self, pending: Pending, cycle: Cycle, now: float) -> None:
        """Send a decoded state to its schema's batch, to the waiting list, or to the dead letters."""
        schema_id = pending.state["schema_id"]
        schema = self._table.get(schema_id)
        if isinstance(schema, BrokenSchema):
            self._outputs.reject(pending, Reason.SCHEMA_UNPREPARABLE, schema.problem)
        elif schema is not None:
            # One pin per state on the prepared schema (prepared on first sight), released when its cycle ends.
            handle = self._scorer.acquire(schema)
            slot = RowSlot()
            cycle.add_to_batch(pending, schema, handle, slot, now)
            texts, slots = self._untokenized.setdefault(handle, ([], []))
            texts.append(pending.state["state"])
            slots.append(slot)
            if len(slots) >= TOKENIZE_CHUNK:
                self._scorer.tokenize_many(handle, *self._untokenized.pop(handle))
        elif self._table.highest_version(schema_id) and pending.wait_deadline is None:
            # Seen before and tombstoned since. Decided when the cycle closes, after the table caught up with the
            # schema topic (the schema may have been published again just now); no longer than that.
            cycle.add_waiting(pending, now)
        elif self._table.highest_version(schema_id):
            self._outputs.reject(pending, Reason.UNKNOWN_SCHEMA, f"schema {schema_id!r} was deleted (a tombstone in "
                                 f"topic {self._config.topics.schemas}); publish it again to score its states")
        elif pending.wait_deadline is not None and now >= pending.wait_deadline:
            self._outputs.reject(pending, Reason.UNKNOWN_SCHEMA, f"no schema with id {schema_id!r} in topic "
                                 f"{self._config.topics.schemas} after waiting {self._config.schema_wait_ms} ms")
        else:
            cycle.add_waiting(pending, pending.wait_deadline if pending.wait_deadline is not None else now + self._schema_wait_s)

    def apply(self, changes: list[Change], cycle: Cycle) -> None:
        """Schema-topic changes: release superseded prepared versions; route the states that waited again."""
        for change in changes:
            if change.record is None:
                self._scorer.forget(change.schema_id)
                self._emit("schema_deleted", {"schema_id": change.schema_id})
            else:
                self._scorer.forget(change.schema_id, keep_version=change.record["version"])
                self._emit("schema_seen", {"schema_id": change.schema_id, "version": change.record["version"]})
        if changes and cycle.waiting:
            now = monotonic()
            for pending in cycle.take_waiting():
                self.route(pending, cycle, now)
            self.flush()

    def reroute(self, cycle: Cycle, now: float) -> None:
        """Bring a closing cycle up to date: batches of superseded or deleted versions, and expired waits."""
        def latest_version(schema_id: str) -> int | None:
            schema = self._table.get(schema_id)
            return schema["version"] if schema is not None else None

        for batch in cycle.take_stale(latest_version):
            for pending in batch.members:
                self._scorer.release_pin(batch.key)
                self.route(pending, cycle, now)
        for pending in cycle.take_waiting():
            self.route(pending, cycle, now)
        self.flush()
