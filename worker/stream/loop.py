"""The exactly-once stream processor: consume states, score them in micro-batches, commit transactionally.

One record's path, one direction: poll -> decode (``worker.formats.records``) -> route to its schema's batch in the
open cycle (``worker.stream.batcher``; the schema is prepared and the state tokenized by ``worker.stream.scorer``) -> score
on the GPU thread -> one output record per state (``worker.stream.outputs``) -> one transaction per cycle with the
input offsets (``worker.stream.transactions``). While cycle N is scored the loop keeps consuming and tokenizing cycle
N+1; N+1 is submitted to the GPU before N commits, so the GPU is not idle during the commit. Once N's batch is on
the device (and N-1 committed), N's transaction is begun and its offsets sent, so those broker round trips overlap
the scoring; its records follow when the scores are ready. Where states come
from and where committed positions go is the ``Assignment``'s (``worker.stream.assignment``): the consumer group for
``decider worker``, a fixed range for ``decider replay``.

Failure rules:
- an error inside a transaction -> abort, drop all uncommitted work, seek to the committed offsets;
- the broker unreachable -> nothing commits; the transactional producer is replaced where librdkafka needs it
  (``worker.stream.transactions``), and once the broker answers again the loop rewinds to the committed offsets and goes on;
  after --broker-outage-s without an answer -> ``BrokerOutageError`` (exit 5);
- partitions revoked or lost -> drop all uncommitted work and abort a transaction opened for it (never commit for
  partitions we may not own);
- fenced (another process with this --worker-id) or fatal client error -> ``FatalError`` to the CLI;
- stop requested (SIGTERM/SIGINT) -> score and commit the open cycle if it can close now, else drop it,
  then close the clients.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import astuple, dataclass, field

from confluent_kafka import KafkaException

from worker.ops import liveness, metrics
from worker.stream import gc_pauses
from worker.stream.assignment import Assignment, EventSink, GroupAssignment, check_consumer_error, partition_names, seek_committed
from worker.stream.batcher import Cycle, Pending, monotonic
from worker.config import WorkerConfig
from worker.exceptions import AbortableError, FatalError
from worker.kafka_clients import require_topics, transactional_producer_config
from worker.formats.input_decoder import SourceDecoder
from worker.stream.outputs import Outputs, start_encoder
from worker.formats.records import SchemaKey, SourceRecord, Unscorable
from worker.stream.latency_budget import CycleBudget
from worker.stream.routing import Router
from worker.stream.schema_table import SchemaTable
from worker.stream.scorer import BatchJob, LaunchTimes, load_scorer
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


@dataclass
class InFlight:
    """A closed cycle whose scoring was submitted and whose transaction is not committed yet."""

    cycle: Cycle
    keys: list[SchemaKey]  # the cycle's batches, in the order of the scorer's results
    future: Future
    closed_at: float  # when the loop decided to close the cycle
    planned_visible_at: float | None = None  # when the latency budget's plan expects it visible
    submitted_at: float | None = None  # when the loop handed it to the GPU thread (schemas caught up, batches built)
    launched: Future = field(default_factory=Future)  # its ``LaunchTimes``, once its batch is queued on the device
    scored_at: float | None = None  # when its scores were ready (set on the scoring thread)
    offsets: list | None = None  # what its transaction commits, once ``Transactions.open`` sent them ahead
    wakes_loop: bool = False  # its launch and its scores put a wake-up on the loop's queue (once it waited on them)

    def on_launched(self, times: LaunchTimes) -> None:
        """(GPU thread) Its batch is queued on the device."""
        self.launched.set_result(times)

    def wake(self, wakeups: queue.SimpleQueue) -> None:
        """Have ``wakeups`` told (once) when its batch is launched and when its scores are ready."""
        if not self.wakes_loop:
            self.wakes_loop = True
            for future in (self.launched, self.future):
                future.add_done_callback(lambda _: wakeups.put(None))

    @property
    def launch(self) -> LaunchTimes | None:
        """When the GPU thread took it, had its states and queued its batch; None until then."""
        return self.launched.result() if self.launched.done() else None


class Worker:
    """One loop over ``assignment``'s input (default: the consumer group). ``run()`` returns when ``stop`` is set or
    the input is exhausted; raises ``FatalError`` when it cannot go on."""

    def __init__(self, config: WorkerConfig, assignment: Assignment | None = None, stop: threading.Event | None = None,
                 on_event: EventSink | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self._emit = on_event or (lambda kind, info: None)
        self._assignment = assignment or GroupAssignment(config, self._emit)
        # No --max-wait-ms (replay): only full batches close a cycle, and the input's end closes the last one.
        self._max_wait_s = math.inf if config.max_wait_ms is None else config.max_wait_ms / 1000
        self._cycle = Cycle()
        self._carried = (0, 0)  # states (all, waiting) the open cycle took over, held back, from the one before it
        self._inflight: deque[InFlight] = deque()
        # a cycle in flight's launch and scores wake the loop's wait through this (``_next_message``): a C-level
        # queue, where concurrent.futures.wait built and tore down waiters in Python on every wait
        self._wakeups: queue.SimpleQueue = queue.SimpleQueue()
        self._budget = CycleBudget(config.latency_budget_ms, self._max_wait_s, self._gpu_busy)

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
        self._budget.announce(self.config.max_wait_ms)
        frozen = gc_pauses.freeze_loaded_objects()
        gc_pauses.watch_collections()
        log.info("%d objects of the loaded model and libraries exempted from garbage collection", frozen)
        self._consumer = self._assignment.consumer()
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
        self._router.apply(self._catch_up_schemas(timeout_s=2.0) or [], self._cycle)
        self._router.reroute(self._cycle, monotonic())
        ready = self._cycle
        self._cycle = ready.carry_held(monotonic())
        if len(ready):
            self._submit_cycle(ready)
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
        for action in (self._txns.close, leave, self._consumer.close, self._table.close, self._scorer.close):
            try:
                action()
            except Exception as exc:  # closing is best effort: the transaction is already committed or aborted
                log.warning("while closing: %r", exc)

    # ---- the loop --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        liveness.BROKER.check_outage(self.config.broker_outage_s)
        self._consume(self._poll_timeout())
        self._router.apply(self._table.poll(), self._cycle)
        now = monotonic()
        if self._inflight and self._inflight[0].future.done():
            self._commit_oldest()
        self._open_transaction()     # where the oldest cycle in flight is on the device now
        if self._should_close(now):
            self._close_cycle()
        if self._assignment.exhausted() and not len(self._cycle):
            self.stop.set()  # run() drains: the cycles in flight are committed

    def _should_close(self, now: float) -> bool:
        cycle = self._cycle
        if not len(cycle):
            return False
        wait_deadline = cycle.wait_deadline()
        if wait_deadline is not None and now >= wait_deadline:
            return True  # a wait for a schema ran out: its state becomes a dead letter, its partition flows again
        if cycle.waiting and (len(cycle), len(cycle.waiting)) == self._carried:
            return False  # nothing but the states held back last time, all still waiting: nothing could commit now
        # No deadline closes the last, partial cycle of a finite input: its end does.
        return (cycle.due(now, self.config.max_batch, self._max_wait_s) or self._budget.due(now, cycle)
                or self._assignment.exhausted())

    def _poll_timeout(self) -> float:
        now = monotonic()
        until_due = self._cycle.seconds_until_due(now, self._max_wait_s)
        wait_deadline = self._cycle.wait_deadline()
        if wait_deadline is not None:
            until_due = min(until_due if until_due is not None else math.inf, max(0.0, wait_deadline - now))
        # While a cycle is on the GPU the wait ends when its scores are ready (``_next_message``); wait briefly all
        # the same, so that messages fetched meanwhile are routed while it runs.
        timeout = 0.005 if self._inflight else 0.1
        if until_due is not None:
            close_by = self._budget.close_by(now, self._cycle)
            until_due = until_due if close_by is None else min(until_due, max(0.0, close_by - now))
        return min(timeout, until_due) if until_due is not None else timeout

    def _consume(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a message, then take every message already fetched, up to a full batch.

        Poll one message at a time: rebalance callbacks then run between two messages, never in the middle of a
        fetched batch, so no message of a revoked assignment is routed after the revoke. --max-wait-ms ends the
        *wait* for more states, never the taking of states already here: a backlog is taken in full batches
        (a deadline on taking would cap batches at what one deadline's worth of routing allows, below the
        load the GPU can carry)."""
        message = self._next_message(timeout)
        count = 0
        while message is not None:
            self._take(message)
            count += 1
            if count >= self.config.max_batch or self._cycle.full(self.config.max_batch):
                return
            message = self._consumer.poll(0)

    def _next_message(self, timeout: float):
        """The next message, waiting up to ``timeout`` for one or, while a cycle is being scored, for its scores (and
        for its launch, when its transaction is to be opened then): a consumer's poll cannot be woken by another
        thread, so the loop waits on the scores and takes the messages fetched meanwhile when they are ready. The
        cycle is then committed at once rather than at the end of a poll (a wait of up to its timeout, spent from
        every record's latency)."""
        if not self._inflight:
            return self._consumer.poll(timeout)
        oldest = self._inflight[0]
        opened = self._txns.is_open_for(oldest.offsets)
        awaited = [oldest.future] if opened else [oldest.future, oldest.launched]
        if timeout <= 0 or any(future.done() for future in awaited):
            return self._consumer.poll(0)     # its commit, or the opening of its transaction, is due now
        message = self._consumer.poll(0)
        if message is None:
            self._wait_for(oldest, awaited, timeout)
            message = self._consumer.poll(0)
        return message

    def _wait_for(self, inflight: InFlight, awaited: list[Future], timeout: float) -> None:
        """Wait up to ``timeout`` for one of ``awaited`` (``inflight``'s launch or scores) to be done. Another cycle's
        progress may end the wait early: the loop then merely looks again."""
        inflight.wake(self._wakeups)
        while True:                            # forget the wake-ups of what is already done
            try:
                self._wakeups.get_nowait()
            except queue.Empty:
                break
        if any(future.done() for future in awaited):
            return
        with contextlib.suppress(queue.Empty):
            self._wakeups.get(timeout=timeout)

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
        self._cycle.track(pending, now, self._budget.arrival(now, timestamp_ms))
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
            changes = self._catch_up_schemas()
        if changes is None:
            return  # the broker does not answer: the cycle stays open (nothing could commit anyway)
        self._router.apply(changes, self._cycle)
        self._router.reroute(self._cycle, monotonic())
        ready, self._cycle = self._cycle, self._cycle.carry_held(monotonic())
        self._carried = (len(self._cycle), len(self._cycle.waiting))
        if not len(ready):
            return
        self._submit_cycle(ready, closed_at)
        # Keep at most one cycle on the GPU while the one before it commits.
        while len(self._inflight) > 1:
            self._commit_oldest()

    def _catch_up_schemas(self, timeout_s: float = 5.0) -> list | None:
        """The schema topic's changes up to its end now; None when the broker does not answer."""
        try:
            changes = self._table.catch_up(timeout_s=timeout_s)
        except KafkaException as exc:
            liveness.BROKER.failed(f"schema topic: {exc.args[0].str()}")
            return None
        liveness.BROKER.succeeded()
        return changes

    def _submit_cycle(self, cycle: Cycle, closed_at: float | None = None) -> None:
        closed_at = monotonic() if closed_at is None else closed_at
        if cycle.opened_at is not None:
            metrics.FILL_WAIT.observe(monotonic() - cycle.opened_at)
        keys = list(cycle.batches)
        jobs = [BatchJob(cycle.batches[key].handle, list(cycle.batches[key].rows)) for key in keys]
        if jobs:  # one GPU batch, every schema's states together
            metrics.BATCH_SIZE.observe(sum(len(job.rows) for job in jobs))
        inflight = InFlight(cycle, keys, Future(), closed_at, self._budget.submitted(closed_at, cycle))
        inflight.submitted_at = monotonic()
        inflight.future = self._scorer.submit(jobs, on_launched=lambda times: inflight.on_launched(times))
        inflight.future.add_done_callback(lambda _: setattr(inflight, "scored_at", monotonic()))
        self._inflight.append(inflight)

    def _commit_oldest(self) -> None:
        inflight = self._inflight[0]
        try:
            with _blocking_step("wait_for_scores", warn=False):     # long on a CPU, by nature
                results = inflight.future.result()
        except Exception as exc:  # the scorer isolates per-state failures; anything else is a bug
            raise FatalError(f"scoring thread failed: {exc!r}") from exc
        if not self._inflight or self._inflight[0] is not inflight:
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
        self._inflight.popleft()
        self._release_pins(cycle)
        self._assignment.on_committed(offsets)
        committed_at = monotonic()
        launched_at = inflight.launch.launched_at if inflight.launch else None
        self._budget.committed(cycle, inflight.closed_at, inflight.scored_at, committed_at, launched_at)
        scored, dead_letters = sum(out.scored.values()), out.dead_letters_by_code()
        metrics.count_committed(committed_at - (cycle.arrived_at or committed_at), out.scored, dead_letters)
        log.debug("committed %d scored, %s dead letters, offsets %s", scored, dead_letters,
                  partition_names(cycle.offsets(), with_offsets=True))
        self._emit("committed", {"scored": scored, "dead_letters": dead_letters,
                                 "samples": out.samples, "batches": {f"{k[0]} v{k[1]}": len(b.members) for k, b in cycle.batches.items()},
                                 "commit_ms": commit_ms, "commit_steps_ms": self._txns.last_steps_ms,
                                 "opened_ahead": self._txns.last_opened_ahead,
                                 "offsets": [(tp.partition, tp.offset) for tp in cycle.offsets()],
                                 **self._latency_fields(inflight, committed_at)})
        self._open_transaction()     # the next cycle's, while the GPU scores it

    def _open_transaction(self) -> None:
        """Begin the transaction of the oldest cycle in flight and send its offsets while the GPU scores it, so that
        these round trips to the broker overlap the scoring. Only once its batch is on the device: a cycle still
        queued behind a schema's preparation (graph captures: seconds) would hold a transaction open meanwhile."""
        if not self._inflight or self._txns.is_open_for(self._inflight[0].offsets):
            return
        inflight = self._inflight[0]
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

    @staticmethod
    def _latency_fields(inflight: InFlight, committed_at: float) -> dict[str, float | None]:
        """A committed cycle's first state's arrival-to-visible time, what the plan expected under a budget, and
        where the time went: when, after that arrival, the cycle closed, the loop handed it to the GPU thread (after
        the schema catch-up), that thread took it and had its tokenized states, its batch was queued on the device and
        its scores were ready (None where it did not happen: a cycle of dead letters only is never launched)."""
        arrived_at = inflight.cycle.arrived_at
        if arrived_at is None:
            return {}
        since_arrival = lambda at: None if at is None else round((at - arrived_at) * 1000, 2)  # noqa: E731
        taken, gathered, launched = astuple(inflight.launch) if inflight.launch else (None, None, None)
        # the arrival on the monotonic clock places cycles on one clock finer than the log's milliseconds (the GPU's
        # idle time between two cycles, for one)
        return {"arrived_monotonic_ms": round(arrived_at * 1000, 3),
                "arrival_to_visible_ms": since_arrival(committed_at),
                "planned_visible_ms": since_arrival(inflight.planned_visible_at),
                "closed_ms": since_arrival(inflight.closed_at), "submitted_ms": since_arrival(inflight.submitted_at),
                "taken_ms": since_arrival(taken),
                "gathered_ms": since_arrival(gathered), "launched_ms": since_arrival(launched),
                "scored_ms": since_arrival(inflight.scored_at)}

    def _gpu_busy(self) -> bool:
        """Whether the last submitted cycle is still being scored."""
        return bool(self._inflight) and not self._inflight[-1].future.done()

    # ---- failure paths ---------------------------------------------------------------------------------------
    def _rewind(self) -> None:
        """After an abort: forget all uncommitted work and read again from the committed offsets, retried while the
        broker does not answer (without a rewind the next cycle would skip the aborted records)."""
        self._drop_uncommitted("transaction aborted")
        seek_committed(self._assignment, self._consumer, self.config.broker_outage_s)

    def _drop_uncommitted(self, why: str) -> None:
        dropped = len(self._cycle) + sum(len(f.cycle) for f in self._inflight)
        self._txns.discard(why)  # a transaction opened ahead for dropped states must not commit their offsets
        for cycle in [self._cycle, *(f.cycle for f in self._inflight)]:
            self._release_pins(cycle)
        self._cycle, self._inflight = Cycle(), deque()
        self._carried = (0, 0)
        self._budget.forget_order()
        if dropped:
            log.info("%s: dropped %d uncommitted states (they will be read again)", why, dropped)

    def _release_pins(self, cycle: Cycle) -> None:
        """Let the scorer evict the schemas ``cycle`` held (after its commit or when it is dropped)."""
        for key in cycle.pins():
            self._scorer.release_pin(key)
