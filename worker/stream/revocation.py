"""What a worker drops when work it has not committed can no longer commit: all of it after an abort or lost
partitions, or only the states of the partitions a rebalance took away from it.

Incremental rebalancing (``worker.stream.assignment``) revokes only the partitions that move to another worker; the
others stay with this one, so their states keep being scored and committed. The states of a revoked partition are
removed from the open cycle and from every cycle in flight (those are scored all the same, as one batch: their
records are simply not produced), and its offset leaves their transactions: the next owner reads the partition from
its committed offset, so a record or an offset of it committed here would score those states twice. The loop first
lets the committer's transaction running end and takes back the cycles handed to it and not begun
(``worker.stream.committer``): no transaction is open while their states are dropped.
"""

from __future__ import annotations

import logging
from typing import Callable, Collection

from confluent_kafka import TopicPartition

from worker.formats.records import SchemaKey
from worker.stream.batcher import Cycle
from worker.stream.inflight import CyclesInFlight

log = logging.getLogger(__name__)

ReleasePin = Callable[[SchemaKey], None]
Partitions = Collection[TopicPartition]


def drop_uncommitted(cycle: Cycle, inflight: CyclesInFlight, why: str, partitions: Partitions | None,
                     release_pin: ReleasePin) -> bool:
    """Drop the uncommitted work of ``partitions`` (None: all of it) from the open ``cycle`` and the cycles
    ``inflight`` (none of them handed to a transaction that may still commit); ``release_pin`` gives back a dropped state's hold on its
    prepared schema. Returns whether nothing uncommitted is left (the caller then starts a fresh cycle)."""
    if partitions is None:
        dropped = len(cycle) + sum(len(f.cycle) for f in inflight)
        for held in [cycle, *(f.cycle for f in inflight)]:
            _release(held.pins(), release_pin)
        inflight.clear()
        _report(why, dropped, None)
        return True
    gone = {(tp.topic, tp.partition) for tp in partitions}
    removed = cycle.forget_partitions(gone)
    _release((p.batch_key for p in removed if p.batch_key is not None), release_pin)
    scored_away, emptied = inflight.forget_partitions(gone)
    for nothing_left in emptied:
        _release(nothing_left.cycle.pins(), release_pin)
    _report(why, len(removed) + scored_away, sorted(p for _, p in gone))
    return not len(cycle) and not inflight


def _release(keys, release_pin: ReleasePin) -> None:
    for key in keys:
        release_pin(key)


def _report(why: str, dropped: int, partitions: list[int] | None) -> None:
    if dropped:
        of = "" if partitions is None else f" of partitions {partitions}"
        log.info("%s: dropped %d uncommitted states%s (they will be read again)", why, dropped, of)
