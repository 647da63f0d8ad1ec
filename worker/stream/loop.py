"""The exactly-once stream processor: consume states, score them in micro-batches, commit transactionally.

One record's path, one direction: poll -> decode (``worker.formats.records``) -> route to its schema's batch in the open
cycle (``worker.stream.intake``, ``worker.stream.batcher``; the schema is prepared and the state tokenized by
``worker.stream.scorer``) -> score on the GPU thread -> one output record per state (``worker.stream.outputs``) -> a
transaction with the input offsets on the committer's thread (``worker.stream.committer``,
``worker.stream.transactions``). When a cycle closes is ``worker.stream.closing``'s rule. While cycle N is scored the
loop keeps consuming and tokenizing cycle N+1; N+1 is submitted to the GPU before N is scored, so the GPU is not idle
between them. A scored cycle is handed to the committer, which commits it (with every cycle handed while its previous
transaction ran) while the loop goes on consuming and launching (the cycles in flight and the loop's wait on them:
``worker.stream.inflight``). Where states come from and where committed positions go is the ``Assignment``'s
(``worker.stream.assignment``): the consumer group for ``decider worker``, a fixed range for ``decider replay``.

Failure rules:
- an error inside a transaction -> abort, drop all uncommitted work (the committer takes nothing until then), seek to
  the committed offsets;
- the broker unreachable -> nothing commits; the transactional producer is replaced where librdkafka needs it
  (``worker.stream.transactions``), and once the broker answers again the loop rewinds to the committed offsets and
  goes on; after --broker-outage-s without an answer -> ``BrokerOutageError`` (exit 5);
- partitions revoked -> let the transaction running end, then drop their uncommitted work (eager rebalancing: all of
  it); lost -> drop all of it (never commit for partitions we may not own: ``worker.stream.revocation``);
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
from worker.kafka_clients import require_topics
from worker.ops import liveness, metrics
from worker.stream import gc_pauses
from worker.stream.assignment import Assignment, EventSink, GroupAssignment, partition_names, seek_committed
from worker.stream.batcher import Cycle, monotonic
from worker.stream.closing import CycleClosing
from worker.stream.committer import Committer, Handed, Outcome
from worker.stream.inflight import CyclesInFlight, InFlight
from worker.stream.intake import Intake
from worker.stream.outputs import Outputs, start_encoder
from worker.stream.progress import ProgressWatch, describe_input_wait
from worker.stream.revocation import Partitions, drop_uncommitted
from worker.stream.routing import Router
from worker.stream.schema_table import SchemaTable
from worker.stream.scorer import load_scorer
from worker.stream.turns import worker_transactions

log = logging.getLogger(__name__)

MAX_HANDED = 16
"""Cycles handed to the committer and not yet committed beyond which the loop waits for it (a broker slower than the
GPU): the transactions merge what waits, but every state held there waits too."""

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
        self._rewind_due = False  # a transaction failed during a rebalance callback: seek at the next step
        self._schemas_unanswered = False  # the broker did not answer the schema table's catch-up: close no cycle
        self._unpadded_noted = False  # the first batch --unpadded-batches cut is logged

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
        self._intake = Intake(self.config, self._assignment, self._decoder, self._outputs, self._router,
                              self._closing.budget)
        self._closing.budget.announce(self.config.max_wait_ms)
        frozen = gc_pauses.freeze_loaded_objects()
        gc_pauses.watch_collections()
        log.debug("%d objects of the loaded model and libraries exempted from garbage collection", frozen)
        self._consumer = self._assignment.consumer()
        self._watch.start()
        self._txns = worker_transactions(self.config, self._consumer)
        try:
            # Before reading any offset: fence a previous instance of this worker id and abort its open
            # transaction, so the committed offsets we start from are final.
            self._txns.init()
            self._assignment.start(self._consumer, self._txns, self._drop_uncommitted)
            self._committer = Committer(self._txns, self._inflight.wake, self.config.commit_linger_ms / 1000)
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
            liveness.BROKER.check_outage(self.config.broker_outage_s)  # a schema table the broker never confirms
            for inflight in self._inflight.unhanded():
                if not self._hand(inflight):
                    break
            self._committer.wait_for_outcome()
            self._take_outcomes()
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
        committer = getattr(self, "_committer", None)
        for action in (*([committer.close] if committer else []), self._txns.close, leave, self._consumer.close, self._table.close, self._scorer.close, self._watch.close):
            try:
                action()
            except Exception as exc:  # closing is best effort: the transaction is already committed or aborted
                log.warning("while closing: %r", exc)

    # ---- the loop --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        liveness.BROKER.check_outage(self.config.broker_outage_s)
        if self._rewind_due:
            self._rewind()
        timeout = self._closing.poll_timeout(monotonic(), self._cycle, bool(self._inflight))
        self._intake.take_fetched(self._inflight.next_message(self._consumer, timeout), self._consumer,
                                  lambda: self._cycle)
        self._router.apply(self._table.poll(), self._cycle)
        self._take_outcomes()
        # The open cycle closes before the scored ones' records are made: when a cycle's scores free the GPU, the next
        # batch is launched first (making a cycle of 128's records took ~4.5 ms, with the GPU idle, on the H100 of run
        # DK), then the records; and once more after them, for a cycle that came due meanwhile.
        if self._closing.due(monotonic(), self._cycle, self._assignment.exhausted):
            self._close_cycle()
        self._hand_scored()
        if self._closing.due(monotonic(), self._cycle, self._assignment.exhausted):
            self._close_cycle()
        if self._assignment.exhausted() and not len(self._cycle):
            self.stop.set()  # run() drains: the cycles in flight are committed

    # ---- closing and committing a cycle ----------------------------------------------------------------------
    def _close_cycle(self) -> None:
        """Submit the open cycle, but for the states held back by a wait for a schema: those (per partition, the
        waiting state and every later one) open the next cycle. The schema table is not caught up first (a broker round
        trip per schema partition, serial with the GPU): the cycle is scored with what the table has applied, and the
        broker's answer is checked before its records are made (``_schemas_confirmed``)."""
        if self._schemas_unanswered and next(self._inflight.unhanded(), None) is not None:
            return  # the broker did not confirm a scored cycle's schemas: nothing could commit anyway
        self._schemas_unanswered = False  # (that cycle was dropped since: a revocation or a rewind)
        closed_at = monotonic()
        self._router.reroute(self._cycle, closed_at)
        ready, self._cycle = self._cycle, self._cycle.carry_held(monotonic())
        if self.config.unpadded_batches and not len(self._cycle) and self._inflight.unscored():
            self._cycle = self._unpadded_tail(ready)
        self._closing.carried_over(self._cycle)
        if not len(ready):
            return
        self._inflight.submit(ready, closed_at, self._closing.budget, self._scorer, self._table.view())
        # Keep at most one cycle queued on the GPU behind the one it scores: states arriving meanwhile make the
        # next cycle larger rather than one more launch to wait behind.
        while self._inflight.unscored() > 1:
            if not self._hand(next(self._inflight.unhanded())):
                return

    def _unpadded_tail(self, ready: Cycle) -> Cycle:
        """The states of ``ready`` past those that fill its CUDA graph's batch size, moved into a new cycle (empty when
        none are): ``ready`` waits behind a cycle on the GPU, and the next one closes as soon as the GPU can take it,
        so they wait about one cycle longer while the GPU scores no padded row."""
        handles = [ready.batches[pending.batch_key].handle for pending in ready.entries if pending.batch_key is not None]
        keep = self._scorer.unpadded_count(handles)
        if keep >= len(handles):
            return Cycle()
        tail = ready.carry_tail(keep, monotonic())
        if not self._unpadded_noted:
            self._unpadded_noted = True
            log.info("unpadded batches: a batch of %d states launched %d, its CUDA graph's batch size, and left %d to the "
                     "next batch (counted in decider_unpadded_carried_states_total; --padded-batches launches them all)",
                     len(handles), keep, len(handles) - keep)
        metrics.UNPADDED_CARRIED.inc(len(handles) - keep)
        return tail

    def _schemas_confirmed(self, inflight: InFlight) -> bool:
        """Whether ``inflight`` was routed with every schema record published before it closed. Almost always known
        by the end offsets asked for at its close; where the table had not applied one of them then, it catches up
        now, and if a schema the cycle's states name changed, all uncommitted work is dropped and read again (so that
        its states are routed with the schema as it was before they were consumed). False: not handed now."""
        view = inflight.table_view
        if view is None:
            return True
        if self._table.missed(view) is False:
            inflight.table_view = None
            return True
        with _blocking_step("schema_catch_up"):      # a broker round trip per schema partition
            changes = self._table.catch_up_if_answered()
        self._schemas_unanswered = changes is None
        if changes is None:
            return False  # the broker does not answer: asked again at a later step
        self._router.apply(changes, self._cycle)
        named = {pending.state.get("schema_id") for pending in inflight.cycle.entries if pending.state}
        if self._table.changed_since(view, named):
            self._emit("schemas_changed_while_scored", {"states": len(inflight.cycle)})
            self._drop_uncommitted("a schema the closed cycle's states name changed before they were consumed")
            seek_committed(self._assignment, self._consumer, self.config.broker_outage_s)
            return False
        inflight.table_view = None
        return True

    # ---- handing scored cycles to the committer, and what it reports ----------------------------------------------
    def _hand_scored(self) -> None:
        """Hand every cycle whose scores are ready to the committer, oldest first."""
        for inflight in self._inflight.unhanded():
            if not inflight.future.done() or not self._hand(inflight):
                return
        while self._committer.pending > MAX_HANDED:   # the broker is slower than the GPU: wait for it
            with _blocking_step("wait_for_commit"):
                self._committer.wait_for_outcome(timeout=1.0)
            self._take_outcomes()

    def _hand(self, inflight: InFlight) -> bool:
        """Wait for ``inflight``'s scores, make its records and hand them to the committer with its offsets; False when
        it cannot be handed now (``_schemas_confirmed``)."""
        try:
            with _blocking_step("wait_for_scores", warn=False):     # long on a CPU, by nature
                results = inflight.future.result()
        except Exception as exc:  # the scorer isolates per-state failures; anything else is a bug
            raise FatalError(f"scoring thread failed: {exc!r}") from exc
        if not self._schemas_confirmed(inflight):
            return False
        cycle = inflight.cycle
        inflight.out = self._outputs.of_cycle(cycle, dict(zip(inflight.keys, results)))
        inflight.offsets = self._assignment.commit_offsets(cycle.offsets())
        inflight.handed = True
        self._committer.hand(Handed(inflight, inflight.out.records, inflight.offsets,
                                    self._assignment.metadata.current(self._consumer)))
        return True

    def _take_outcomes(self, seek: bool = True) -> None:
        """Account for the transactions the committer ended: their cycles are committed, or the first that failed
        is aborted (``seek``: rewind now, else at the next step)."""
        for outcome in self._committer.outcomes():
            if outcome.error is None:
                for position, part in enumerate(outcome.handed):
                    self._committed(part.cycle, outcome, position)
            elif isinstance(outcome.error, AbortableError):
                return self._aborted(outcome.error, seek)
            else:
                raise outcome.error  # fenced, the broker gone past --broker-outage-s, a fatal client error

    def _committed(self, inflight: InFlight, outcome: Outcome, position: int) -> None:
        """``inflight`` was committed, the ``position``-th cycle of ``outcome``'s transaction."""
        if self._inflight.pop_oldest() is not inflight:
            raise FatalError("committed a cycle that was not the oldest in flight")  # a bug: the order is the contract
        cycle, out, committed_at = inflight.cycle, inflight.out, outcome.committed_at
        self._release_pins(cycle)
        self._assignment.on_committed(inflight.offsets)
        launch = inflight.launch
        self._closing.budget.committed(cycle, inflight.closed_at, inflight.scored_at, committed_at,
                                       launch.launched_at if launch else None, inflight.queued_s())
        scored, dead_letters = sum(out.scored.values()), out.dead_letters_by_code()
        metrics.count_committed(committed_at - (cycle.arrived_at or committed_at), out.scored, dead_letters,
                                first_in_transaction=position == 0)
        if log.isEnabledFor(logging.DEBUG):  # the offsets' names are made only for a line that is written
            log.debug("committed %d scored, %s dead letters, offsets %s", scored, dead_letters,
                      partition_names(cycle.offsets(), with_offsets=True))
        self._emit("committed", {"scored": scored, "dead_letters": dead_letters,
                                 "samples": out.samples, "batches": {f"{k[0]} v{k[1]}": len(b.members) for k, b in cycle.batches.items()},
                                 "commit_ms": outcome.commit_ms, "commit_steps_ms": outcome.steps_ms,
                                 "cycles_in_transaction": len(outcome.handed), "transaction_cycle": position,
                                 "offsets": [(tp.partition, tp.offset) for tp in cycle.offsets()],
                                 "outputs": outcome.outputs, **inflight.latency_fields(committed_at)})

    # ---- failure paths ---------------------------------------------------------------------------------------
    def _aborted(self, exc: AbortableError, seek: bool = True) -> None:
        metrics.TRANSACTIONS.labels("aborted").inc()
        self._assignment.metadata.forget()   # the broker may have refused it as stale
        self._emit("aborted", {"error": str(exc)})
        self._forget("transaction aborted", None)
        self._committer.resume()
        if seek:
            self._rewind()
        else:
            self._rewind_due = True

    def _rewind(self) -> None:
        """After an abort: forget all uncommitted work and read again from the committed offsets, retried while the
        broker does not answer (without a rewind the next cycle would skip the aborted records)."""
        self._rewind_due = False
        self._forget("transaction aborted", None)
        seek_committed(self._assignment, self._consumer, self.config.broker_outage_s)

    def _drop_uncommitted(self, why: str, partitions: Partitions | None = None) -> None:
        """Forget the uncommitted work of ``partitions`` (revoked), or all of it (``worker.stream.revocation``): once
        the transaction running has ended (what it commits stays committed); the cycles handed to the committer
        and not begun come back to the loop first."""
        for part in self._committer.hold():
            part.cycle.handed = False
        try:
            self._take_outcomes(seek=False)
            self._forget(why, partitions)
        finally:
            self._committer.release()

    def _forget(self, why: str, partitions: Partitions | None) -> None:
        if drop_uncommitted(self._cycle, self._inflight, why, partitions, lambda key: self._scorer.release_pin(key)):
            self._cycle = Cycle()
            self._closing.forget()

    def _release_pins(self, cycle: Cycle) -> None:
        """Let the scorer evict the schemas ``cycle`` held (after its commit or when it is dropped)."""
        for key in cycle.pins():
            self._scorer.release_pin(key)
