"""Transactions on several transactional ids, one transaction each in turn (--transactional-ids).

Apache Kafka answers a commit (EndTxn) before it has written the transaction's markers, and refuses the same producer's
next transaction (AddPartitionsToTxn, AddOffsetsToTxn: CONCURRENT_TRANSACTIONS) until it has; librdkafka retries after
its backoff. A worker committing back to back (small cycles under a latency budget) waits for the markers at every
commit. On another id the next transaction need not wait: the markers of that id's last transaction were written
while the transaction after it ran. The committer still runs one transaction at a time, in order, and the next begins
only once the last has committed, so nothing about what a read_committed reader sees changes:

- a transaction's records and offsets are atomic as before (each transaction is one id's);
- the offsets of consecutive transactions on two ids may reach the group coordinator's log out of order when the
  markers race, and the coordinator keeps the one whose offset commit was appended last, the later transaction's
  (each commit's offsets are at or past the previous one's);
- every id is initialised at start (fencing that id's older instance and aborting its open transaction), and each
  carries the group metadata of its cycle (zombie fencing), as one id does.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from worker.config import WorkerConfig
from worker.formats.records import OutgoingRecord
from worker.kafka_clients import transactional_producer_config
from worker.ops import liveness
from worker.stream.transactions import Transactions
from worker.stream.watchdog import Watchdog

log = logging.getLogger(__name__)


class TakingTurns:
    """`Transactions`' interface over one `Transactions` per transactional id, each commit on the next id."""

    def __init__(self, turns: Sequence[Transactions], retired: Sequence[Transactions] = ()) -> None:
        """``retired``: the ids the worker does not commit on (`WorkerConfig.retired_transactional_ids`), fenced by
        `init` and closed."""
        if not turns:
            raise ValueError("TakingTurns needs at least one Transactions")
        self._turns = list(turns)
        self._retired = list(retired)
        self._next = 0
        self.last_steps_ms: dict[str, float] = {}
        self.last_outputs: dict[tuple[str, int], int] = {}

    def init(self) -> None:
        """Initialise every id: fences each one's older instance and aborts its open transaction; the same for every
        retired id, whose producer is closed then."""
        for txns in self._turns:
            txns.init()
        retired, self._retired = self._retired, []
        for txns in retired:
            txns.init()
            txns.close()

    def commit(self, records: Sequence[OutgoingRecord], offsets: Sequence[TopicPartition],
               group_metadata: Any = None) -> None:
        """`Transactions.commit` on the next id; the id after it takes the next commit, whatever this one's outcome
        (an aborted transaction's abort markers are written meanwhile, as a commit's are)."""
        txns = self._turns[self._next]
        self._next = (self._next + 1) % len(self._turns)
        txns.commit(records, offsets, group_metadata)
        self.last_steps_ms = txns.last_steps_ms
        self.last_outputs = txns.last_outputs

    def complete_on_every_id(self, offsets: Sequence[TopicPartition], group_metadata: Any) -> None:
        """One transaction on every id, with nothing but ``offsets``: a commit marker of each id reaches the group's
        offsets partition (`complete_hanging_offsets` says why)."""
        for txns in self._turns:
            txns.commit([], offsets, group_metadata)

    def abort(self) -> None:
        """Abort whatever is open on any id (at most one is)."""
        for txns in self._turns:
            txns.abort()

    def close(self) -> None:
        """Close every id's producer; the first failure is raised once all were tried."""
        failure: BaseException | None = None
        for txns in self._turns:
            try:
                txns.close()
            except Exception as exc:  # noqa: BLE001 - the others still close
                failure = failure or exc
        if failure is not None:
            raise failure


def worker_transactions(config: WorkerConfig, consumer: Consumer) -> TakingTurns:
    """The worker's transactions: one `Transactions` per id of `config.transactional_id_turns`, and one per id of
    `config.retired_transactional_ids` for `TakingTurns.init` to fence; all share one watchdog thread."""
    base, watchdog = transactional_producer_config(config), Watchdog(liveness.BROKER)

    def transactions(tid: str) -> Transactions:
        return Transactions({**base, "transactional.id": tid}, consumer, config.worker_id, watchdog=watchdog,
                            timeout_s=config.transaction_timeout_ms / 1000 / 2, outage_s=config.broker_outage_s)
    log.info("committing on %d transactional id%s in turn: %s; fencing at start the ids it does not use: %s",
             config.transactional_ids, "s" if config.transactional_ids > 1 else "",
             ", ".join(config.transactional_id_turns), ", ".join(config.retired_transactional_ids) or "none")
    return TakingTurns([transactions(tid) for tid in config.transactional_id_turns],
                       [transactions(tid) for tid in config.retired_transactional_ids])


HANGING_CHECK_S = 3.0
"""How long the committed offsets may take to answer at start before `complete_hanging_offsets` steps in."""


def complete_hanging_offsets(config: WorkerConfig, consumer: Consumer, txns: TakingTurns,
                             partitions: list[TopicPartition] | None = None) -> bool:
    """At start, before the group is joined, or when partitions come back after they were lost (``partitions``; else
    all of the states topic's): make the group's committed offsets readable again where a transaction of one of this
    worker's ids left them pending for good; whether it had to.

    Apache Kafka 4.4, restarted after a SIGKILL while a transaction was committing, completes that transaction with
    its markers skipped for the partitions whose leader it does not know yet (`Couldn't find leader endpoint ... likely
    deleted already`, the handling of KAFKA-5202; KAFKA-20734). A skipped offsets partition keeps the transaction's
    offsets pending: a read_committed consumer's committed offsets (asked stable, KIP-447) are refused as unstable
    until a marker of the same producer id reaches that partition, and a restarted worker would read nothing, for
    good. On one id the worker's next transaction is on that producer id, but it must read its offsets first; taking
    turns, it may be any id. So where the states topic's committed offsets do not answer within `HANGING_CHECK_S`,
    every id commits a transaction holding only an offset of the dead-letter topic (which no member of the group
    reads, set to its end): its commit marker applies the pending offsets, as the skipped marker would have, and the
    group's offset of the dead-letter topic is the only trace (the pending offsets of a live transaction of another
    worker answer within the wait). A hanging transaction on an output partition ends with the id's next transaction
    that writes to it; `worker.stream.progress` reports it meanwhile."""
    states = config.topics.states
    if partitions is None:
        partitions = [TopicPartition(states, p) for p in sorted(consumer.list_topics(states, timeout=10).topics[states].partitions)]
    partitions = [TopicPartition(tp.topic, tp.partition) for tp in partitions]  # the stable committed offsets asked
    if _committed_answer(consumer, partitions, HANGING_CHECK_S):
        return False
    log.warning("the committed offsets of %s did not answer within %.0f s: a transaction of this worker's ids may have "
                "left them pending (Apache Kafka restarted mid-commit skips markers: KAFKA-20734); committing a "
                "transaction on each id to complete them", states, HANGING_CHECK_S)
    dead_letter = config.topics.dead_letter
    end = consumer.get_watermark_offsets(TopicPartition(dead_letter, 0), timeout=10)[1]
    txns.complete_on_every_id([TopicPartition(dead_letter, 0, end)], consumer.consumer_group_metadata())
    if not _committed_answer(consumer, partitions, 30.0):
        log.warning("the committed offsets of %s still do not answer: reading starts when they do", states)
    return True


def _committed_answer(consumer: Consumer, partitions: list[TopicPartition], timeout_s: float) -> bool:
    try:
        consumer.committed(partitions, timeout=timeout_s)
        return True
    except KafkaException as exc:
        if exc.args[0].code() not in (KafkaError._TIMED_OUT, KafkaError.UNSTABLE_OFFSET_COMMIT):
            raise
        return False
