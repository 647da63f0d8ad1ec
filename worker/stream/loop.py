"""The exactly-once stream processor: consume states, score them in micro-batches, commit transactionally.

One record's path, one direction: poll -> decode (``worker.formats.records``) -> route to its schema's batch in the
open cycle (``worker.stream.batcher``; the schema is prepared and the state tokenized by ``worker.stream.scorer``) ->
score on the GPU thread -> one output record per state (``worker.stream.outputs``) -> one transaction per cycle with
the input offsets (``worker.stream.transactions``). When a cycle closes is ``worker.stream.closing``'s rule. While
cycle N is scored the loop keeps consuming and tokenizing cycle N+1; N+1 is submitted to the GPU before N commits, so
the GPU is not idle during the commit. Once N's batch is on the device (and N-1 committed), N's transaction is begun
and its offsets sent, so those broker round trips overlap the scoring; its records follow when the scores are ready
(the cycles in flight and the loop's wait on them: ``worker.stream.inflight``). Where states come from and where
committed positions go is the ``Assignment``'s (``worker.stream.assignment``): the consumer group for ``decider
worker``, a fixed range for ``decider replay``.

Failure rules:
- an error inside a transaction -> abort, drop all uncommitted work, seek to the committed offsets;
- the broker unreachable -> nothing commits; the transactional producer is replaced where librdkafka needs it
  (``worker.stream.transactions``), and once the broker answers again the loop rewinds to the committed offsets and
  goes on; after --broker-outage-s without an answer -> ``BrokerOutageError`` (exit 5);
- partitions revoked -> drop their uncommitted work (eager rebalancing: all of it) and abort a transaction opened
  with their offsets; lost -> drop all of it (never commit for partitions we may not own: ``worker.stream.revocation``);
- fenced (another process with this --worker-id) or fatal client error -> ``FatalError`` to the CLI;
- stop requested (SIGTERM/SIGINT) -> score and commit the open cycle if it can close now, else drop it,
  then close the clients.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from worker.config import WorkerConfig
from worker.exceptions import AbortableError, FatalError
from worker.formats.input_decoder import SourceDecoder
from worker.formats.records import SourceRecord, Unscorable
from worker.kafka_clients import require_topics, transactional_producer_config
from worker.ops import liveness, metrics
from worker.stream import gc_pauses
from worker.stream.assignment import Assignment, EventSink, GroupAssignment, check_consumer_error, partition_names, seek_committed
from worker.stream.batcher import Cycle, Pending, monotonic
from worker.stream.closing import CycleClosing
from worker.stream.inflight import CyclesInFlight
from worker.stream.outputs import Outputs, start_encoder
from worker.stream.progress import ProgressWatch, describe_input_wait
from worker.stream.revocation import Partitions, drop_uncommitted
from worker.stream.routing import Router
from worker.stream.schema_table import SchemaTable
from worker.stream.scorer import load_scorer
from worker.stream.transactions import Transactions

log = logging.getLogger(__name__)

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


class Worker:
    """One loop over ``assignment``'s input (default: the consumer group). ``run()`` returns when ``stop`` is set or
    the input is exhausted; raises ``FatalError`` when it cannot go on."""

    def __init__(self, config: WorkerConfig, assignment: Assignment | None = None, stop: threading.Event | None = None,
                 on_event: EventSink | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self._watch = ProgressWatch.of(config, lambda p: describe_input_wait(p, self._cycle, list(self._inflight)))
        self._emit = self._watch.chained(on_event)  # the watch sees every event first
        self._assignment = assignment or GroupAssignment(config, self._emit)
        self._cycle = Cycle()
        self._inflight = CyclesInFlight()
        self._closing = CycleClosing(config.max_batch, config.max_wait_ms, config.latency_budget_ms,
                                     self._inflight.gpu_busy)  # with the latency budget, which learns from every commit

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Connect, load the model, then process until stopped."""
        topics = self.config.topics
        require_topics(self.config.cluster, topics.all(), roles=topics)
        encoder = start_encoder(self.config)  # before the model loads: a registry refusing decider's schemas stops it now
        self._decoder = SourceDecoder(self.config.input, self.config.registry, self.config.max_state_chars)
        engine, self._scorer = load_scorer(self.config)
        self._scorer.on_event = self._emit
        metrics.watch_scorer(self._scorer.graph_stats, self._scorer.prepared, self._scorer.bank_bytes)
        self._outputs = Outputs(topics, self.config.worker_id, engine.model_id, encoder, self._decoder.propagated_headers)
        self._emit("model_loaded", {"model_id": engine.model_id, "device": self.config.device})
        self._table = SchemaTable(self.config.cluster, topics.schemas)
        self._table.catch_up()
        self._emit("schemas_loaded", {"schema_ids": self._table.ids()})
        self._router = Router(self.config, self._table, self._scorer, self._outputs, self._emit)
        self._closing.budget.announce(self.config.max_wait_ms)
        frozen = gc_pauses.freeze_loaded_objects()
        gc_pauses.watch_collections()
        log.info("%d objects of the loaded model and libraries exempted from garbage collection", frozen)
        self._consumer = self._assignment.consumer()
        self._watch.start()
        self._txns = Transactions(transactional_producer_config(self.config), self._consumer, self.config.worker_id,
                                  timeout_s=self.config.transaction_timeout_ms / 1000 / 2,
                                  outage_s=self.config.broker_outage_s)
        try:
            # Before reading any offset: fence a previous instance of this worker id and abort its open
            # transaction, so the committed offsets we start from are final.
            self._txns.init()
            self._assignment.start(self._consumer, self._txns, self._drop_uncommitted)
            while not self.stop.is_set():
                self._step()
            self._drain()
        finally:
            self._close()

    def _drain(self) -> None:
        """Stop requested: commit what can be committed now, drop the rest (it is re-read after restart)."""
        self._router.apply(self._table.catch_up_if_answered(timeout_s=2.0) or [], self._cycle)
        self._router.reroute(self._cycle, monotonic())
        ready = self._cycle
        self._cycle = ready.carry_held(monotonic())
        if len(ready):
            self._inflight.submit(ready, monotonic(), self._closing.budget, self._scorer)
        while self._inflight:
            self._commit_oldest()
        if len(self._cycle):
            log.info("stopping: %d states wait for their schema or come after one in their partition; left "
                     "uncommitted for the next owner", len(self._cycle))
            self._release_pins(self._cycle)
            self._cycle = Cycle()
        else:
            self._assignment.finish(self._txns)  # the input's end offsets: only with nothing held back before them
        self._emit("stopped", {})

    def _close(self) -> None:
        leave = lambda: self._assignment.leave(self._consumer)  # noqa: E731
        for action in (self._txns.close, leave, self._consumer.close, self._table.close, self._scorer.close, self._watch.close):
            try:
                action()
            except Exception as exc:  # closing is best effort: the transaction is already committed or aborted
                log.warning("while closing: %r", exc)

    # ---- the loop --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        liveness.BROKER.check_outage(self.config.broker_outage_s)
        self._consume(self._closing.poll_timeout(monotonic(), self._cycle, bool(self._inflight)))
        self._router.apply(self._table.poll(), self._cycle)
        now = monotonic()
        if self._inflight and self._inflight.oldest.future.done():
            self._commit_oldest()
        self._open_transaction()     # where the oldest cycle in flight is on the device now
        if self._closing.due(now, self._cycle, self._assignment.exhausted):
            self._close_cycle()
        if self._assignment.exhausted() and not len(self._cycle):
            self.stop.set()  # run() drains: the cycles in flight are committed

    def _consume(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a message, then take every message already fetched, up to a full batch.

        Poll one message at a time: rebalance callbacks then run between two messages, never in the middle of a
        fetched batch, so no message of a revoked assignment is routed after the revoke. --max-wait-ms ends the
        *wait* for more states, never the taking of states already here: a backlog is taken in full batches
        (a deadline on taking would cap batches at what one deadline's worth of routing allows, below the
        load the GPU can carry)."""
        message = self._inflight.next_message(self._consumer, self._txns, timeout)
        count = 0
        while message is not None:
            self._take(message)
            count += 1
            if count >= self.config.max_batch or self._cycle.full(self.config.max_batch):
                return
            message = self._consumer.poll(0)

    def _take(self, message) -> None:
        """One polled message: an error to act on, or a record to decode and route."""
        if not self._assignment.accepts(message):
            return
        if message.error() is not None:
            return check_consumer_error(message.error(), self.config)
        timestamp_ms = message.timestamp()[1]
        pending = Pending(SourceRecord(message.topic(), message.partition(), message.offset(), message.key(), message.value(),
                                       message.headers(), timestamp_ms))
        now = monotonic()
        self._cycle.track(pending, now, self._closing.budget.arrival(now, timestamp_ms))
        try:
            pending.state = self._decoder.decode(pending.source)
        except Unscorable as exc:
            pending.state = exc.state  # the ids read before it failed, for the dead letter
            return self._outputs.reject(pending, exc.reason, str(exc))
        self._router.route(pending, self._cycle, monotonic())

    # ---- closing and committing a cycle ----------------------------------------------------------------------
    def _close_cycle(self) -> None:
        """Bring the cycle up to date with the schema topic, then submit it, but for the states held back by a
        wait for a schema: those (per partition, the waiting state and every later one) open the next cycle."""
        closed_at = monotonic()
        with _blocking_step("schema_catch_up"):      # a broker round trip per schema partition
            changes = self._table.catch_up_if_answered()
        if changes is None:
            return  # the broker does not answer: the cycle stays open (nothing could commit anyway)
        self._router.apply(changes, self._cycle)
        self._router.reroute(self._cycle, monotonic())
        ready, self._cycle = self._cycle, self._cycle.carry_held(monotonic())
        self._closing.carried_over(self._cycle)
        if not len(ready):
            return
        self._inflight.submit(ready, closed_at, self._closing.budget, self._scorer)
        # Keep at most one cycle on the GPU while the one before it commits.
        while len(self._inflight) > 1:
            self._commit_oldest()

    def _commit_oldest(self) -> None:
        inflight = self._inflight.oldest
        try:
            with _blocking_step("wait_for_scores", warn=False):     # long on a CPU, by nature
                results = inflight.future.result()
        except Exception as exc:  # the scorer isolates per-state failures; anything else is a bug
            raise FatalError(f"scoring thread failed: {exc!r}") from exc
        if not self._inflight or self._inflight.oldest is not inflight:
            return  # dropped by a rebalance while we waited
        cycle = inflight.cycle
        out = self._outputs.of_cycle(cycle, dict(zip(inflight.keys, results)))
        offsets = inflight.offsets or self._assignment.commit_offsets(cycle.offsets())
        started = time.perf_counter()
        try:
            with _blocking_step("commit"):
                self._txns.commit(out.records, offsets)
        except AbortableError as exc:
            self._aborted(exc)
            return
        commit_ms = (time.perf_counter() - started) * 1000
        self._inflight.pop_oldest()
        self._release_pins(cycle)
        self._assignment.on_committed(offsets)
        committed_at = monotonic()
        launched_at = inflight.launch.launched_at if inflight.launch else None
        self._closing.budget.committed(cycle, inflight.closed_at, inflight.scored_at, committed_at, launched_at)
        scored, dead_letters = sum(out.scored.values()), out.dead_letters_by_code()
        metrics.count_committed(committed_at - (cycle.arrived_at or committed_at), out.scored, dead_letters)
        log.debug("committed %d scored, %s dead letters, offsets %s", scored, dead_letters,
                  partition_names(cycle.offsets(), with_offsets=True))
        self._emit("committed", {"scored": scored, "dead_letters": dead_letters,
                                 "samples": out.samples, "batches": {f"{k[0]} v{k[1]}": len(b.members) for k, b in cycle.batches.items()},
                                 "commit_ms": commit_ms, "commit_steps_ms": self._txns.last_steps_ms,
                                 "opened_ahead": self._txns.last_opened_ahead,
                                 "offsets": [(tp.partition, tp.offset) for tp in cycle.offsets()],
                                 "outputs": self._txns.last_outputs, **inflight.latency_fields(committed_at)})
        self._open_transaction()     # the next cycle's, while the GPU scores it

    def _open_transaction(self) -> None:
        """Begin the transaction of the oldest cycle in flight and send its offsets while the GPU scores it, so that
        these round trips to the broker overlap the scoring. Only once its batch is on the device: a cycle still
        queued behind a schema's preparation (graph captures: seconds) would hold a transaction open meanwhile."""
        if not self._inflight or self._txns.is_open_for(self._inflight.oldest.offsets):
            return
        inflight = self._inflight.oldest
        if inflight.launch is None or inflight.future.done():
            return  # not launched yet, or nothing to overlap any more (``_commit_oldest`` opens it itself)
        offsets = self._assignment.commit_offsets(inflight.cycle.offsets())
        try:
            with _blocking_step("open_transaction"):
                self._txns.open(offsets)
        except AbortableError as exc:
            self._aborted(exc)
            return
        inflight.offsets = offsets

    def _aborted(self, exc: AbortableError) -> None:
        metrics.TRANSACTIONS.labels("aborted").inc()
        self._emit("aborted", {"error": str(exc)})
        self._rewind()

    # ---- failure paths ---------------------------------------------------------------------------------------
    def _rewind(self) -> None:
        """After an abort: forget all uncommitted work and read again from the committed offsets, retried while the
        broker does not answer (without a rewind the next cycle would skip the aborted records)."""
        self._drop_uncommitted("transaction aborted")
        seek_committed(self._assignment, self._consumer, self.config.broker_outage_s)

    def _drop_uncommitted(self, why: str, partitions: Partitions | None = None) -> None:
        """Forget the uncommitted work of ``partitions`` (revoked), or all of it (``worker.stream.revocation``)."""
        if drop_uncommitted(self._cycle, self._inflight, self._txns, why, partitions,
                            lambda key: self._scorer.release_pin(key)):
            self._cycle = Cycle()
            self._closing.forget()

    def _release_pins(self, cycle: Cycle) -> None:
        """Let the scorer evict the schemas ``cycle`` held (after its commit or when it is dropped)."""
        for key in cycle.pins():
            self._scorer.release_pin(key)
