"""The exactly-once commit: output records, dead letters and input offsets in one Kafka transaction.

This module owns every call on the transactional producer. ``commit()`` runs the numbered steps;
``abort()`` is the single abort path. Callers see three outcomes: success, ``AbortableError``
(the transaction was aborted: rewind the consumer to its committed offsets and redo the work), or
``FencedError`` / ``FatalError`` (stop the process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Sequence, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from worker.exceptions import AbortableError, FatalError, FencedError
from worker.records import OutgoingRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

# librdkafka reports fencing as _FENCED (its normalized code) or the broker's codes.
_FENCING_CODES = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}


class _Watchdog:
    """Exits the process if one client call overruns its own timeout by far.

    A transactional call blocked inside librdkafka cannot be interrupted from Python (seen on the embedded
    broker after a restart: send_offsets_to_transaction ignores its timeout). Nothing of the open
    transaction is visible, so exiting is safe, and a restart with the same --worker-id aborts the hung
    transaction in init_transactions. Exit code 5.

    One daemon thread per producer, armed around each call: a thread per call would mean three thread starts per
    transaction, noticeable at hundreds of small transactions per second.
    """

    EXIT_CODE = 5

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[str, float, float] | None = None  # (step, limit_s, monotonic deadline)
        threading.Thread(target=self._watch, name="decider-txn-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, step: str, limit_s: float):
        """Exit the process if the body runs longer than ``limit_s``."""
        with self._cond:
            self._armed = (step, limit_s, time.monotonic() + limit_s)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                step, limit_s, deadline = self._armed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._fire(step, limit_s)
                self._cond.wait(remaining)

    def _fire(self, step: str, limit_s: float) -> None:
        message = (f"error: {step} did not return within {limit_s:.0f} s; exiting so that a restart with the same "
                   "--worker-id recovers (it aborts the hung transaction)")
        log.critical(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)


class Transactions:
    """Runs one transaction at a time on ``producer``, committing ``consumer``'s offsets with it."""

    def __init__(
        self,
        producer_config: dict,
        consumer: Consumer,
        worker_id: str,
        timeout_s: float = 30.0,
    ) -> None:
        # error_cb collects client-level errors (fencing is reported there as a fatal error) instead of
        # letting them surface from flush() in the middle of delivery callbacks.
        self._producer = Producer({**producer_config, "error_cb": self._on_error})
        self._consumer = consumer
        self._fatal: KafkaError | None = None
        self._worker_id = worker_id
        self._timeout_s = timeout_s
        self._open = False
        self._delivery_errors: list[KafkaError] = []
        self._watchdog = _Watchdog()

    def init(self) -> None:
        """Register the transactional id: fences any older instance with the same --worker-id and
        aborts whatever transaction it left open, so its partial output never becomes visible."""
        self._call("init_transactions", self._producer.init_transactions)

    def commit(self, records: Sequence[OutgoingRecord], offsets: Sequence[TopicPartition]) -> None:
        """Publish ``records`` and commit ``offsets`` (next offset to read, per input partition) atomically."""
        try:
            # 1. Begin: nothing produced from here on is visible until step 5 succeeds.
            self._call("begin_transaction", lambda _timeout: self._producer.begin_transaction())
            self._open = True
            # 2. Send the input offsets with the group metadata, so the group coordinator rejects them
            #    if this worker is no longer the group's owner of those partitions (zombie fencing).
            #    First, before any record: if this call hangs (seen on the embedded broker right after a
            #    restart) and the watchdog exits, the stuck transaction holds no output record, so it cannot
            #    hold read_committed readers of the output topics behind it. The order inside a
            #    transaction does not matter for atomicity; and a zombie is rejected before producing.
            if offsets:
                metadata = self._consumer.consumer_group_metadata()
                self._call(
                    "send_offsets_to_transaction",
                    lambda timeout: self._producer.send_offsets_to_transaction(list(offsets), metadata, timeout),
                )
            # 3. Produce every output record and dead letter into the transaction.
            self._delivery_errors.clear()
            for record in records:
                self._produce(record)
            # 4. Flush, then check every delivery report: a lost record must not be committed around.
            remaining = self._flush()
            if self._fatal is not None:
                self._raise_classified("produce", self._fatal)
            if remaining:
                raise AbortableError(f"{remaining} records were not delivered within {self._timeout_s:.0f} s")
            if self._delivery_errors:
                raise AbortableError(f"record delivery failed: {self._delivery_errors[0].str()}")
            # 5. Commit: records and offsets become visible together, or not at all.
            self._call("commit_transaction", self._producer.commit_transaction)
            self._open = False
        except AbortableError:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort the open transaction, if any. The single abort path; safe to call twice."""
        if not self._open:
            return
        self._open = False
        self._call("abort_transaction", self._producer.abort_transaction, abortable=False)
        log.info("transaction aborted")

    def close(self) -> None:
        """Abort whatever is open and release the producer's queue."""
        try:
            self.abort()
        finally:
            self._producer.flush(0)

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
            raise AbortableError(f"flush failed: {exc!r}") from exc

    def _on_error(self, error: KafkaError) -> None:
        if error.fatal():
            self._fatal = error
        else:
            log.debug("producer: %s", error.str())

    def _on_delivery(self, error: KafkaError | None, _message) -> None:
        if error is not None:
            self._delivery_errors.append(error)

    def _call(self, step: str, action: Callable[[float], T], abortable: bool = True) -> T:
        """Run one transactional API call (given the seconds it may take); retry only what librdkafka marks
        retriable, and only within ``timeout_s`` in total, so a broker that never comes back turns into an
        abort (or an exit) instead of a worker that waits forever."""
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                with self._watchdog.guard(step, self._timeout_s * 2 + 1):
                    return action(max(remaining, 0.1))
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                attempt += 1
                if error.retriable() and not error.fatal() and deadline - time.monotonic() > 0.2:
                    log.warning("%s failed (%s), retrying", step, error.str())
                    time.sleep(min(0.05 * 2**attempt, 1.0, max(deadline - time.monotonic() - 0.1, 0)))
                    continue
                if not abortable and not error.fatal():
                    raise FatalError(f"{step} failed: {error.str()}") from exc
                self._raise_classified(step, error)

    def _raise_classified(self, step: str, error: KafkaError) -> None:
        if error.code() in _FENCING_CODES or (error.fatal() and "fenc" in error.str().lower()):
            raise FencedError(
                f"producer fenced during {step}: another worker started with --worker-id {self._worker_id} "
                "(same transactional id) and took over; this instance stops. Give each worker a unique --worker-id."
            )
        if error.fatal():
            raise FatalError(f"fatal Kafka error during {step}: {error.str()}")
        raise AbortableError(f"{step} failed: {error.str()}")
