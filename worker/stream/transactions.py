"""The exactly-once commit: output records, dead letters and input offsets in one Kafka transaction.

This module owns every call on the transactional producer, each one guarded by ``worker.stream.watchdog``.
``commit()`` runs the numbered steps; ``abort()`` is the single abort path. Callers see three outcomes: success,
``AbortableError`` (the transaction was aborted: rewind the consumer to its committed offsets and redo the work), or
``FencedError`` / ``FatalError`` (stop the process).

When the broker stops answering mid-transaction, aborting is not enough: librdkafka does not implement the client
side of KIP-890, so a request that timed out (an EndTxn above all) may still reach the broker later and act on a
later transaction. Its maintainers' advice (librdkafka issue 5423) is followed: a producer whose call timed out, or
whose abort fails, or that hit a fatal error other than fencing, is replaced by a new one with the same
transactional id. The new producer's ``init_transactions`` bumps the epoch, which fences every request of the old
one and aborts its open transaction; it is retried until the broker answers, for at most --broker-outage-s
(then ``BrokerOutageError``, exit 5). The caller sees an ``AbortableError`` as for any abort.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from worker.ops import liveness
from worker.exceptions import AbortableError, BrokerOutageError, FatalError, FencedError
from worker.formats.records import OutgoingRecord
from worker.stream.watchdog import Watchdog

log = logging.getLogger(__name__)

T = TypeVar("T")

# librdkafka reports fencing as _FENCED (its normalized code) or the broker's codes.
_FENCING_CODES = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
# The broker did not answer: the request may still be applied later.
_NO_ANSWER_CODES = {KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE, KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT,
                    KafkaError._ALL_BROKERS_DOWN, KafkaError.REQUEST_TIMED_OUT}


class _StepClock:
    """Milliseconds between laps: where a transaction's time went (a slow commit's step: a broker round trip, or this
    thread waiting for the GIL between two client calls)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.ms[step] = round((now - self._last) * 1000, 3)
        self._last = now


class Transactions:
    """Runs one transaction at a time on a transactional producer, committing ``consumer``'s offsets with it."""

    def __init__(
        self,
        producer_config: dict,
        consumer: Consumer,
        worker_id: str,
        timeout_s: float = 30.0,
        outage_s: float = 300.0,
        broker: liveness.BrokerLiveness = liveness.BROKER,
        watchdog: Watchdog | None = None,
    ) -> None:
        """``watchdog``: one to share with the worker's other ids' `Transactions` (their calls never overlap: one
        transaction at a time); None starts one of its own."""
        self._producer_config = producer_config
        self._consumer = consumer
        self._worker_id = worker_id
        self._timeout_s = timeout_s
        # How long one call may block before the watchdog ends the process. librdkafka bounds a transactional
        # request by transaction.timeout.ms (twice timeout_s), not by the call's own timeout: with the broker dead,
        # send_offsets_to_transaction(timeout=5) raised _TIMED_OUT after 10.0 s at 10,000 ms, 20.0 s at 20,000 and
        # 60.0 s at 60,000. The grace past that keeps a call ending by itself on a loaded machine from reading as a
        # hang (1 s of grace, as before, is within a busy 2-core machine's scheduling delays).
        self._hung_after_s = 2 * timeout_s + max(5.0, timeout_s)
        self._outage_s = outage_s
        self._broker = broker
        self._open = False  # a transaction is begun and not yet committed or aborted
        self._in_doubt = False  # a request went unanswered: this producer must be replaced, not reused
        self._failing_since: float | None = None  # monotonic time of the first failure since the last commit
        self._delivery_errors: list[KafkaError] = []
        self._watchdog = watchdog or Watchdog(broker)
        self._generation = 0
        self._producer = self._new_producer()
        # the last committed transaction's ms per step (produce: begin and the records queued; offsets: sent, while
        # librdkafka delivers the records; flush; commit)
        self.last_steps_ms: dict[str, float] = {}
        # the newest offset of a record the last committed transaction wrote, per (topic, partition): what
        # ``worker.stream.progress`` reads back to see that read_committed readers get it
        self.last_outputs: dict[tuple[str, int], int] = {}
        self._delivered: dict[tuple[str, int], int] = {}

    def _new_producer(self) -> Producer:
        self._generation += 1
        generation = self._generation
        self._fatal: KafkaError | None = None
        # error_cb collects client-level errors (fencing is reported there as a fatal error) instead of
        # letting them surface from flush() in the middle of delivery callbacks; a replaced producer's are ignored.
        return Producer({**self._producer_config, "error_cb": lambda error: self._on_error(generation, error)})

    def init(self) -> None:
        """Register the transactional id: fences any older instance with the same --worker-id and
        aborts whatever transaction it left open, so its partial output never becomes visible."""
        self._init_until_answered()

    def commit(self, records: Sequence[OutgoingRecord], offsets: Sequence[TopicPartition], group_metadata: Any = None) -> None:
        """Publish ``records`` and commit ``offsets`` (next offset to read, per input partition) atomically, in the
        name of ``group_metadata`` (the consumer's ``consumer_group_metadata()``; None: asked now). A thread other
        than the consumer's must pass it: librdkafka answers that call on the consumer group's own queue, which does
        not answer while the consumer's thread is in a rebalance callback."""
        self._guarded(lambda: self._commit_steps(records, offsets, group_metadata))

    def _guarded(self, steps: Callable[[], None]) -> None:
        # an AbortableError leaves no transaction open: aborted here, or its producer replaced
        try:
            with self._broker.call("commit"):
                steps()
        except AbortableError as exc:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._abort_or_replace(str(exc))
            raise
        self._failing_since = None
        self._broker.succeeded()

    def _commit_steps(self, records: Sequence[OutgoingRecord], offsets: Sequence[TopicPartition], metadata: Any) -> None:
        steps = _StepClock()
        # 1. Begin: nothing produced from here on is visible until step 5 succeeds.
        self._call("begin_transaction", lambda _timeout: self._producer.begin_transaction())
        self._open = True
        # Timed apart: confluent-kafka holds the GIL through this call, a round trip to librdkafka's main thread, so
        # every other thread of the worker waits as long as it takes
        steps.lap("begin")
        # 2. Queue every output record and dead letter: librdkafka registers their partitions with the transaction
        #    and sends them on its own threads ...
        self._delivery_errors.clear()
        self._delivered = {}
        for record in records:
            self._produce(record)
        self._producer.poll(0)
        steps.lap("produce")
        # 3. ... while this thread sends the input offsets with the group metadata, so the group coordinator rejects
        #    them if this worker no longer owns those partitions (zombie fencing: the transaction then aborts, its
        #    records with it). The two chains of round trips (partitions + records; offsets to the transaction and
        #    group coordinators) overlap: behind a broker 2 ms away each way a transaction took 15.6 ms so, 25.1 ms
        #    with the offsets sent first. The order inside a transaction does not matter for atomicity.
        if offsets:
            metadata = metadata or self._consumer.consumer_group_metadata()
            self._call(
                "send_offsets_to_transaction",
                lambda timeout: self._producer.send_offsets_to_transaction(list(offsets), metadata, timeout),
            )
        steps.lap("offsets")
        # 4. Flush, then check every delivery report: a lost record must not be committed around.
        remaining = self._flush()
        steps.lap("flush")
        if self._fatal is not None:
            self._raise_classified("produce", self._fatal)
        if remaining:
            self._in_doubt = True
            raise AbortableError(f"{remaining} records were not delivered within {self._timeout_s:.0f} s")
        if self._delivery_errors:
            self._in_doubt = any(e.code() in _NO_ANSWER_CODES for e in self._delivery_errors)
            raise AbortableError(f"record delivery failed: {self._delivery_errors[0].str()}")
        # 5. Commit: records and offsets become visible together, or not at all.
        self._call("commit_transaction", self._producer.commit_transaction)
        self._open = False
        self.last_outputs = self._delivered
        steps.lap("commit")
        self.last_steps_ms = steps.ms

    def abort(self) -> None:
        """Abort the open transaction, if any. The single abort path; safe to call twice."""
        if not self._open:
            return
        self._open = False
        try:
            self._call("abort_transaction", self._producer.abort_transaction)
        except AbortableError as exc:
            raise FatalError(str(exc)) from exc
        log.debug("transaction aborted")  # the loop reports it as the "aborted" event

    def close(self) -> None:
        """Abort whatever is open and release the producer's queue."""
        try:
            if not self._in_doubt:
                self.abort()
        finally:
            self._producer.flush(0)

    # ---- after a failed step: abort, or replace the producer -------------------------------------------------
    def _abort_or_replace(self, why: str) -> None:
        """Abort the failed transaction; where a request went unanswered or the abort fails, replace the producer."""
        if not self._in_doubt:
            try:
                self.abort()
                return
            except FatalError as exc:
                if isinstance(exc, FencedError):
                    raise
                why = f"{why}; then {exc}"
        self._replace_producer(why)

    def _replace_producer(self, why: str) -> None:
        """A new producer with the same transactional id: its epoch fences the old one's requests still in flight
        and aborts its open transaction. Retried until the broker answers, at most --broker-outage-s."""
        log.warning("replacing the transactional producer (%s): a new one with the same transactional id fences the "
                    "old one's requests and aborts its open transaction", why)
        old, self._producer = self._producer, self._new_producer()
        self._open = False
        self._in_doubt = False
        # Destroying a producer may wait for its requests in flight: let that happen off the loop's thread.
        threading.Thread(target=_retire, args=(old,), name="decider-producer-retire", daemon=True).start()
        del old
        self._init_until_answered()

    def _init_until_answered(self) -> None:
        deadline = (self._failing_since or time.monotonic()) + self._outage_s
        reported = 0.0
        while True:
            try:
                self._call("init_transactions", self._producer.init_transactions, replaceable=False)
                self._broker.succeeded()
                return
            except AbortableError as exc:  # the broker did not answer (fatal errors, fencing included, stop here)
                self._broker.failed(str(exc))
                if time.monotonic() >= deadline:
                    raise BrokerOutageError(
                        f"no transaction coordinator answered for {self._outage_s:.0f} s (--broker-outage-s): {exc}; "
                        "restart the worker (same --worker-id) once the broker is back") from exc
                if time.monotonic() - reported >= 10:
                    reported = time.monotonic()
                    log.warning("the broker does not answer (%s); retrying for %.0f s more", exc,
                                deadline - time.monotonic())
                time.sleep(0.5)

    # ---- one call on the producer --------------------------------------------------------------------------
    def _produce(self, record: OutgoingRecord) -> None:
        while True:
            try:
                self._producer.produce(record.topic, key=record.key, value=record.value, headers=record.headers,
                                       on_delivery=self._on_delivery)
                return
            except BufferError:
                # The local queue is full: let deliveries drain, then retry the same record.
                self._producer.poll(0.05)
            except KafkaException as exc:
                self._raise_classified("produce", exc.args[0])

    def _flush(self) -> int:
        try:
            return self._producer.flush(self._timeout_s)
        except (KafkaException, SystemError) as exc:
            # A transactional failure during flush (fencing, for one) is raised from inside the delivery
            # callbacks; the client then surfaces it as SystemError caused by the KafkaException.
            cause = exc if isinstance(exc, KafkaException) else exc.__cause__
            if isinstance(cause, KafkaException):
                self._raise_classified("flush", cause.args[0])
            if self._fatal is not None:  # at times a bare SystemError ("returned NULL"): error_cb has the reason
                self._raise_classified("flush", self._fatal)
            self._in_doubt = True
            raise AbortableError(f"flush failed: {exc!r}") from exc

    def _on_error(self, generation: int, error: KafkaError) -> None:
        if generation != self._generation:
            return
        if error.fatal():
            self._fatal = error
        else:
            log.debug("producer: %s", error.str())

    def _on_delivery(self, error: KafkaError | None, message) -> None:
        if error is not None:
            self._delivery_errors.append(error)
        else:
            key = (message.topic(), message.partition())
            self._delivered[key] = max(message.offset(), self._delivered.get(key, -1))

    def _call(self, step: str, action: Callable[[float], T], replaceable: bool = True) -> T:
        """Run one transactional API call (given the seconds it may take); retry only what librdkafka marks
        retriable, and only within ``timeout_s`` in total, so a broker that never comes back turns into an
        abort (or an exit) instead of a worker that waits forever."""
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                with self._watchdog.guard(step, self._timeout_s, self._hung_after_s), self._broker.call(step):
                    return action(max(remaining, 0.1))
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                attempt += 1
                if error.retriable() and not error.fatal() and deadline - time.monotonic() > 0.2:
                    log.log(logging.WARNING if attempt == 1 else logging.DEBUG, "%s failed (%s), retrying", step, error.str())
                    time.sleep(min(0.05 * 2**attempt, 1.0, max(deadline - time.monotonic() - 0.1, 0)))
                    continue
                if error.retriable() or error.code() in _NO_ANSWER_CODES:
                    self._in_doubt = True
                    self._broker.failed(f"{step}: {error.str()}")
                self._raise_classified(step, error, replaceable)

    def _raise_classified(self, step: str, error: KafkaError, replaceable: bool = True) -> None:
        if error.code() in _FENCING_CODES or (error.fatal() and "fenc" in error.str().lower()):
            raise FencedError(
                f"producer fenced during {step}: another worker started with --worker-id {self._worker_id} "
                "(same transactional id) and took over; this instance stops. Give each worker a unique --worker-id."
            )
        if error.fatal() and not replaceable:
            raise FatalError(f"fatal Kafka error during {step}: {error.str()}")
        if error.fatal():
            self._in_doubt = True  # librdkafka's rule for a fatal error: this producer instance is done
        raise AbortableError(f"{step} failed: {error.str()}")


def _retire(producer: Producer) -> None:
    """Drop a replaced producer's queued records; its last reference goes with this thread."""
    with contextlib.suppress(Exception):
        producer.purge(in_queue=True, in_flight=True, blocking=False)
        producer.flush(0)
