"""The exactly-once stream processor: consume states, score them in micro-batches, commit transactionally.

One main thread owns both Kafka clients; scoring runs on the scorer's GPU thread and tokenization on its
pool. Every consumed record ends up in exactly one cycle (``worker.batcher``), and every cycle commits
as one transaction holding its probability records, its dead letters and its input offsets
(``worker.transactions``). While cycle N is scored the loop keeps consuming and tokenizing cycle N+1;
N+1 is submitted to the GPU before N commits, so the GPU is not idle during the commit.

Failure rules:
- an error inside a transaction -> abort, drop all uncommitted work, seek to the committed offsets;
- partitions revoked or lost -> drop all uncommitted work (never commit for partitions we may not own);
- fenced (another process with this --worker-id) or fatal client error -> ``FatalError`` to the CLI;
- stop requested (SIGTERM/SIGINT) -> score and commit the open cycle if it can close now, else drop it,
  then close the clients.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

import schemas
from worker import gc_pauses, metrics
from worker.batcher import Cycle, Pending, monotonic
from worker.config import WorkerConfig
from worker.dead_letters import Reason, SourceRecord, dead_letter
from worker.exceptions import AbortableError, ConfigError, FatalError, FencedError
from worker.kafka_clients import require_topics, transactional_producer_config, worker_consumer
from worker.records import probability_record, state_problem
from worker.schema_table import BrokenSchema, Change, SchemaTable
from worker.scorer import Scorer, device_thread
from worker.transactions import OutgoingRecord, Transactions

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]

SLOW_STEP_S = 0.1
"""A blocking step of the loop that takes this long is logged as a warning: the states consumed meanwhile wait."""


@contextlib.contextmanager
def _blocking_step(step: str, warn: bool = True):
    """Time a step that blocks the loop into ``decider_loop_step_seconds``; warn when it took SLOW_STEP_S or more."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - started
        metrics.LOOP_STEP_SECONDS.labels(step).observe(seconds)
        if warn and seconds >= SLOW_STEP_S:
            log.warning("slow step: %s took %.0f ms, and the loop consumed nothing meanwhile", step, seconds * 1000)


@dataclass
class InFlight:
    """A closed cycle whose scoring was submitted and whose transaction is not committed yet."""

    cycle: Cycle
    keys: list
    future: Future


def load_scorer(config: WorkerConfig) -> tuple[Any, Scorer]:
    """Load the model and wrap it; ``ConfigError`` with the engine's message on a bad model directory."""
    if config.device == "cpu":
        # OpenMP's default active wait makes torch's idle pool threads spin between ops; next to the Kafka
        # clients and tokenizer threads that starved CPU scoring (~15 vs ~150 states/s on 2 cores). It only
        # takes effect if set before torch starts OpenMP, i.e. before the import below in a fresh process.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine import Engine, SchemaEngine  # torch is imported only by processes that score

    gpu = device_thread()
    try:
        engine = gpu.submit(Engine.load, config.model_dir, device=config.device, dtype=config.resolved_dtype).result()
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot load the model from {config.model_dir}: {exc}") from exc
    except RuntimeError as exc:  # e.g. CUDA requested on a machine without it
        raise ConfigError(f"cannot load the model on {config.device}: {exc}") from exc
    except Exception as exc:  # a damaged checkpoint can fail anywhere in the loaders: still the user's input
        raise ConfigError(f"cannot load the model from {config.model_dir}: {type(exc).__name__}: {exc}") from exc
    schema_engine = gpu.submit(SchemaEngine, engine).result()
    return engine, Scorer(schema_engine, config.schema_memory_bytes, config.tokenizer_threads, gpu_thread=gpu,
                          warmup_state_tokens=config.warmup_state_tokens, max_batch=config.max_batch)


class Worker:
    """One worker process's loop. ``run()`` returns when ``stop`` is set; raises ``FatalError`` when it cannot go on."""

    def __init__(self, config: WorkerConfig, stop: threading.Event | None = None, on_event: EventSink | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self._emit = on_event or (lambda kind, info: None)
        self._max_wait_s = config.max_wait_ms / 1000
        self._schema_wait_s = config.schema_wait_ms / 1000
        self._cycle = Cycle()
        self._inflight: deque[InFlight] = deque()
        self._holding = False  # the open cycle is due but waits for a schema: consume nothing meanwhile

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Connect, load the model, then process until stopped."""
        topics = self.config.topics
        require_topics(self.config.bootstrap, topics.all())
        engine, self._scorer = load_scorer(self.config)
        self._scorer.on_event = self._emit
        metrics.watch_scorer(self._scorer.engine_stats, self._scorer.prepared)
        self._model_id = engine.model_id
        self._emit("model_loaded", {"model_id": engine.model_id, "device": self.config.device})
        self._table = SchemaTable(self.config.bootstrap, topics.schemas)
        self._table.catch_up()
        self._emit("schemas_loaded", {"schema_ids": self._table.ids()})
        frozen = gc_pauses.freeze_loaded_objects()
        gc_pauses.watch_collections()
        log.info("%d objects of the loaded model and libraries exempted from garbage collection", frozen)
        self._consumer = self._make_consumer()
        self._txns = Transactions(transactional_producer_config(self.config), self._consumer, self.config.worker_id,
                                  timeout_s=self.config.transaction_timeout_ms / 1000 / 2)
        try:
            # Before reading any offset: fence a previous instance of this worker id and abort its open
            # transaction, so the committed offsets we start from are final.
            self._txns.init()
            self._start_consuming()
            while not self.stop.is_set():
                self._step()
            self._drain()
        finally:
            self._close()

    # Hooks ``worker.replay`` overrides: a fixed assignment instead of the group, and offsets carrying the range.
    def _make_consumer(self):
        return worker_consumer(self.config)

    def _start_consuming(self) -> None:
        self._consumer.subscribe([self.config.topics.states], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    def _commit_offsets(self, cycle: Cycle) -> list[TopicPartition]:
        return cycle.offsets()

    def _drain(self) -> None:
        """Stop requested: commit what can be committed now, drop the rest (it is re-read after restart)."""
        self._sync_schemas(self._table.catch_up(timeout_s=2.0))
        self._reroute_cycle(monotonic())
        if self._cycle.waiting:
            log.info("stopping: %d states still wait for their schema; left for the next owner", len(self._cycle.waiting))
            self._drop_uncommitted("stopping")
            return
        if len(self._cycle):
            self._submit_cycle()
        while self._inflight:
            self._commit_oldest()
        self._emit("stopped", {})

    def _close(self) -> None:
        # A static member does not leave the group on close(); unsubscribing does, so a stopped worker's
        # partitions go to the others now rather than after session.timeout.ms.
        for action in (self._txns.close, self._leave_group, self._consumer.close, self._table.close, self._scorer.close):
            try:
                action()
            except Exception as exc:  # closing is best effort: the transaction is already committed or aborted
                log.warning("while closing: %r", exc)

    def _leave_group(self) -> None:
        self._consumer.unsubscribe()
        # Serve the revoke and let the LeaveGroup request go out before close() tears the client down.
        deadline = monotonic() + 1.0
        while self._consumer.assignment() and monotonic() < deadline:
            self._consumer.poll(0.05)
        self._consumer.poll(0.2)

    # ---- the loop --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        if self._holding:
            # The due cycle cannot commit past a state that waits for its schema, and must not grow
            # meanwhile, so the consumer is not polled: at most --schema-wait-ms, far below
            # max.poll.interval.ms. (pause()/resume() would do the same but costs ~1 s of refetch.)
            time.sleep(0.02)
        else:
            self._consume(self._poll_timeout())
        self._sync_schemas(self._table.poll())
        now = monotonic()
        if self._inflight and self._inflight[0].future.done():
            self._commit_oldest()
        if self._holding or self._cycle.due(now, self.config.max_batch, self._max_wait_s):
            self._close_cycle()

    def _poll_timeout(self) -> float:
        until_due = self._cycle.seconds_until_due(monotonic(), self._max_wait_s)
        # A cycle on the GPU is committed by the first step after it finishes: wait briefly, so that a quiet
        # stream (no message ends the wait early) does not add the wait to that cycle's latency.
        timeout = 0.005 if self._inflight else 0.1
        return min(timeout, until_due) if until_due is not None else timeout

    def _consume(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a message, then take every message already fetched, up to a full batch.

        Poll one message at a time: rebalance callbacks then run between two messages, never in the middle of a
        fetched batch, so no message of a revoked assignment is routed after the revoke. --max-wait-ms ends the
        *wait* for more states, never the taking of states already here: under a backlog, stopping at the
        deadline made batches no bigger than what one deadline's worth of routing allowed, so the worker fell
        behind a load it could carry with fuller batches, and latency grew without bound."""
        message = self._consumer.poll(timeout)
        count = 0
        while message is not None:
            self._route(message)
            count += 1
            if count >= self.config.max_batch or self._cycle.full(self.config.max_batch):
                return
            message = self._consumer.poll(0)

    def _route(self, message) -> None:
        error = message.error()
        if error is not None:
            # librdkafka reports a fatal consumer error as a _FATAL event whose text names the cause.
            fatal = error.fatal() or error.code() in (KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID)
            if fatal and "fenc" in error.str().lower():
                raise FencedError(f"consumer fenced: another worker joined group {self.config.group} with --worker-id "
                                  f"{self.config.worker_id} and took over; this instance stops. Give each worker a unique --worker-id.")
            if fatal:
                raise FatalError(f"fatal consumer error: {error.str()}")
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer: %s", error.str())
            return
        source = SourceRecord(message.topic(), message.partition(), message.offset(), message.key(), message.value())
        pending = Pending(source)
        self._cycle.track(pending, monotonic())
        if source.value is None:
            return self._dead(pending, Reason.UNDECODABLE, "the record has no value (null)")
        try:
            state = schemas.decode_state(source.value)
        except ValueError as exc:
            return self._dead(pending, Reason.UNDECODABLE, str(exc))
        problem = state_problem(state)
        if problem:
            return self._dead(pending, Reason.INVALID_FIELDS, problem)
        if len(state["state"]) > self.config.max_state_chars:
            return self._dead(pending, Reason.STATE_TOO_LARGE,
                              f"state has {len(state['state'])} characters; the limit is {self.config.max_state_chars} (--max-state-chars)")
        pending.state = state
        self._route_state(pending, monotonic())

    def _route_state(self, pending: Pending, now: float) -> None:
        """Send a decoded state to its schema's batch, to the waiting list, or to the dead letters."""
        schema_id = pending.state["schema_id"]
        schema = self._table.get(schema_id)
        if isinstance(schema, BrokenSchema):
            self._dead(pending, Reason.SCHEMA_UNPREPARABLE, schema.problem)
        elif schema is not None:
            self._cycle.add_to_batch(pending, schema, self._scorer, now)
        elif pending.wait_deadline is not None and now >= pending.wait_deadline:
            self._dead(pending, Reason.UNKNOWN_SCHEMA,
                       f"no schema with id {schema_id!r} in topic {self.config.topics.schemas} after waiting {self.config.schema_wait_ms} ms")
        else:
            self._cycle.add_waiting(pending, pending.wait_deadline if pending.wait_deadline is not None else now + self._schema_wait_s)

    def _dead(self, pending: Pending, reason: Reason, message: str) -> None:
        state = pending.state or {}
        pending.outcome = dead_letter(pending.source, reason, message, self.config.topics.dead_letter, self.config.worker_id,
                                      state_id=state.get("state_id"), schema_id=state.get("schema_id"))

    def _sync_schemas(self, changes: list[Change]) -> None:
        for change in changes:
            if change.record is None:
                self._scorer.forget(change.schema_id)
                self._emit("schema_deleted", {"schema_id": change.schema_id})
            else:
                self._scorer.forget(change.schema_id, keep_version=change.record["version"])
                self._emit("schema_seen", {"schema_id": change.schema_id, "version": change.record["version"]})
        if changes and self._cycle.waiting:
            now = monotonic()
            for pending in self._cycle.take_waiting():
                self._route_state(pending, now)

    def _reroute_cycle(self, now: float) -> None:
        """Apply schema changes to the open cycle: newest versions, tombstones, expired waits."""
        def latest_version(schema_id: str) -> int | None:
            schema = self._table.get(schema_id)
            return schema["version"] if schema is not None else None

        for pending in self._cycle.take_stale(latest_version, self._scorer) + self._cycle.take_waiting():
            self._route_state(pending, now)

    # ---- closing a cycle -------------------------------------------------------------------------------------
    def _close_cycle(self) -> None:
        """Bring the cycle up to date with the schema topic, then submit it, or pause until its waits resolve."""
        with _blocking_step("schema_catch_up"):      # a broker round trip per schema partition
            changes = self._table.catch_up()
        self._sync_schemas(changes)
        self._reroute_cycle(monotonic())
        self._holding = bool(self._cycle.waiting)
        if self._holding:
            return
        self._submit_cycle()
        # Keep at most one cycle on the GPU while the one before it commits.
        while len(self._inflight) > 1:
            self._commit_oldest()

    def _submit_cycle(self) -> None:
        cycle, self._cycle = self._cycle, Cycle()
        keys, jobs = cycle.jobs()
        if cycle.opened_at is not None:
            metrics.FILL_WAIT.observe(monotonic() - cycle.opened_at)
        for job in jobs:
            metrics.BATCH_SIZE.observe(len(job.rows))
        future = self._scorer.submit(jobs) if jobs else _done([])
        self._inflight.append(InFlight(cycle, keys, future))

    def _commit_oldest(self) -> None:
        inflight = self._inflight[0]
        try:
            with _blocking_step("wait_for_scores", warn=False):     # long on a CPU, by nature
                outcomes = inflight.future.result()
        except Exception as exc:  # the scorer isolates per-state failures; anything else is a bug
            raise FatalError(f"scoring thread failed: {exc!r}") from exc
        if not self._inflight or self._inflight[0] is not inflight:
            return  # dropped by a rebalance while we waited
        records, counts = self._outputs(inflight, outcomes)
        started = time.perf_counter()
        try:
            with _blocking_step("commit"):
                self._txns.commit(records, self._commit_offsets(inflight.cycle))
        except AbortableError as exc:
            metrics.TRANSACTIONS.labels("aborted").inc()
            log.warning("transaction aborted (%s); rewinding to the committed offsets", exc)
            self._emit("aborted", {"error": str(exc)})
            self._rewind()
            return
        self._inflight.popleft()
        inflight.cycle.release_pins(self._scorer)
        metrics.TRANSACTIONS.labels("committed").inc()
        metrics.CYCLE_SECONDS.observe(monotonic() - (inflight.cycle.opened_at or monotonic()))
        log.debug("committed %d scored, %s dead letters, offsets %s", counts["scored"], counts["dead_letters"],
                  _names(inflight.cycle.offsets(), with_offsets=True))
        self._emit("committed", {**counts, "commit_ms": (time.perf_counter() - started) * 1000,
                                 "offsets": [(tp.partition, tp.offset) for tp in inflight.cycle.offsets()]})

    def _outputs(self, inflight: InFlight, outcomes: list) -> tuple[list[OutgoingRecord], dict[str, Any]]:
        """The cycle's records in input order: a probability record or a dead letter per consumed state."""
        by_key = dict(zip(inflight.keys, outcomes))
        batches = inflight.cycle.batches
        records: list[OutgoingRecord] = []
        scored, dead, samples = 0, {}, []
        for pending in inflight.cycle.entries:
            if pending.outcome is None:
                result = by_key[pending.batch_key][pending.batch_index]
                if result.reason is not None:
                    self._dead(pending, Reason(result.reason), result.error or result.reason)
                else:
                    record = probability_record(pending.state, batches[pending.batch_key].schema, result.probabilities,
                                                self._model_id, (pending.source.topic, pending.source.partition, pending.source.offset),
                                                self.config.worker_id, truncated=result.truncated)
                    pending.outcome = OutgoingRecord(self.config.topics.probabilities, pending.source.key, schemas.encode_probability(record))
                    scored += 1
                    metrics.STATES_SCORED.labels(record["schema_id"]).inc()
                    if len(samples) < 3:
                        samples.append(record)
            if pending.outcome.topic == self.config.topics.dead_letter:
                reason = schemas.decode_dead_letter(pending.outcome.value)["reason"]
                dead[reason] = dead.get(reason, 0) + 1
                metrics.DEAD_LETTERS.labels(reason).inc()
            records.append(pending.outcome)
        return records, {"scored": scored, "dead_letters": dead, "samples": samples,
                         "batches": {f"{k[0]} v{k[1]}": len(b.members) for k, b in batches.items()}}

    # ---- failure paths ---------------------------------------------------------------------------------------
    def _rewind(self) -> None:
        """After an abort: forget all uncommitted work and read again from the committed offsets."""
        self._drop_uncommitted("transaction aborted")
        assignment = self._consumer.assignment()
        if not assignment:
            return
        try:
            for tp in self._consumer.committed(assignment, timeout=10):
                # No committed offset yet: the group starts from the beginning (auto.offset.reset=earliest).
                target = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                self._consumer.seek(TopicPartition(tp.topic, tp.partition, target))
        except KafkaException as exc:
            # Without a rewind the next cycle would skip the aborted records. Exiting is safe: a restart
            # with the same --worker-id resumes from the committed offsets.
            raise FatalError(f"could not rewind to the committed offsets after an abort: {exc.args[0].str()}; "
                             "restart the worker (same --worker-id) to resume from them") from exc

    def _drop_uncommitted(self, why: str) -> None:
        dropped = len(self._cycle) + sum(len(f.cycle) for f in self._inflight)
        for cycle in [self._cycle, *(f.cycle for f in self._inflight)]:
            cycle.release_pins(self._scorer)
        self._cycle, self._inflight = Cycle(), deque()
        self._holding = False
        if dropped:
            log.info("%s: dropped %d uncommitted states (they will be read again)", why, dropped)

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", _names(partitions))
        self._emit("assigned", {"partitions": [p.partition for p in partitions]})

    def _on_revoke(self, consumer, partitions: list[TopicPartition]) -> None:
        # Eager rebalancing revokes everything; uncommitted work is dropped, never committed, because
        # the next owner starts from the committed offsets and would score those states again.
        log.info("revoked %s", _names(partitions))
        self._drop_uncommitted("partitions revoked")
        self._emit("revoked", {"partitions": [p.partition for p in partitions]})

    def _on_lost(self, consumer, partitions: list[TopicPartition]) -> None:
        # Lost (session expired): another worker may already own them; committing would be wrong, and a
        # transaction with stale group metadata would be rejected anyway.
        log.warning("lost %s", _names(partitions))
        self._drop_uncommitted("partitions lost")
        self._emit("lost", {"partitions": [p.partition for p in partitions]})


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _names(partitions: list[TopicPartition], with_offsets: bool = False) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" + (f"@{p.offset}" if with_offsets else "") for p in partitions) or "nothing"
