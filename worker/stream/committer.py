"""The committer: scored cycles' transactions on a thread of their own, so consuming and launching do not wait for them.

A producer runs one transaction at a time (Kafka's rule), and a transaction is a few broker round trips: on the
embedded broker ~3.5 ms, behind a broker 2 ms away each way (one zone of a replicated cluster) ~16 ms. When the loop
ran them itself, every state consumed meanwhile waited for the commit, and the next cycles closed and reached the GPU
that much later; at 2 ms a full-load worker lost 20% of the GPU to it (run BY). Here the loop hands a scored cycle's
records and offsets over (``hand``) and goes on; the committer thread commits, in one transaction, every cycle handed
since its last transaction began (*group commit*: the cycles are consecutive, so their records and their offsets,
the newest per partition, commit together as they would one by one), and reports each transaction's outcome in order
(``outcomes``) with a wake-up for the loop.

After a failed transaction it takes nothing more until the loop has rewound (``resume``): the cycles handed after the
failed one are uncommitted work the rewind drops. A rebalance ``hold``s it: the transaction running finishes, the
cycles not begun come back to the loop, and nothing begins until ``release``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from confluent_kafka import TopicPartition

from worker.formats.records import OutgoingRecord
from worker.stream.turns import TakingTurns

log = logging.getLogger(__name__)


@dataclass
class Handed:
    """One scored cycle's part of a transaction: its records and the offsets it commits."""

    cycle: Any                              # the loop's ``InFlight``: the committer only hands it back
    records: Sequence[OutgoingRecord]
    offsets: Sequence[TopicPartition]
    group_metadata: Any = None              # the consumer's, when handed (None: asked on the committer's thread)
    handed_at: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    """One transaction's end: the cycles it committed (oldest first), or the error that aborted it."""

    handed: list[Handed]
    error: BaseException | None = None
    committed_at: float | None = None       # monotonic, when its records became visible
    commit_ms: float = 0.0                  # from its begin to its end
    steps_ms: dict[str, float] = field(default_factory=dict)
    outputs: dict[tuple[str, int], int] = field(default_factory=dict)  # newest offset written, per output partition


def merged_offsets(handed: Sequence[Handed]) -> list[TopicPartition]:
    """The offsets of consecutive cycles committed as one: per partition, the newest."""
    newest: dict[tuple[str, int], TopicPartition] = {}
    for part in handed:
        for tp in part.offsets:
            newest[(tp.topic, tp.partition)] = tp
    return list(newest.values())


class Committer:
    """Runs ``txns``' transactions on its own thread; ``wake`` is called after each one ends."""

    def __init__(self, txns: TakingTurns, wake: Callable[[], None], linger_s: float = 0.0) -> None:
        """``linger_s``: how long a handed cycle may wait for later ones to join its transaction when none is running
        (0: it begins at once)."""
        self._txns = txns
        self._wake = wake
        self._linger_s = linger_s
        self._lock = threading.Condition()
        self._queue: list[Handed] = []          # handed, not begun
        self._running: list[Handed] = []        # in the transaction running now
        self._outcomes: list[Outcome] = []      # ended, not yet taken by the loop
        self._failed = False                    # a transaction failed: nothing begins until ``resume``
        self._held = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="decider-committer", daemon=True)
        self._thread.start()

    # ---- the loop's side -----------------------------------------------------------------------------------------
    def hand(self, part: Handed) -> None:
        """Commit ``part`` after every part handed before it. Ignored after a failure the loop has not rewound from
        (the rewind drops it with the rest of the uncommitted work)."""
        with self._lock:
            if not self._failed:
                self._queue.append(part)
                self._lock.notify_all()

    def outcomes(self) -> list[Outcome]:
        """The transactions ended since the last call, oldest first."""
        with self._lock:
            ended, self._outcomes = self._outcomes, []
            return ended

    @property
    def pending(self) -> int:
        """Cycles handed whose transaction has not ended."""
        with self._lock:
            return len(self._queue) + len(self._running)

    def wait_for_outcome(self, timeout: float | None = None) -> None:
        """Wait until an outcome is there to take (or nothing is pending), at most ``timeout`` seconds."""
        with self._lock:
            self._lock.wait_for(lambda: self._outcomes or not (self._queue or self._running), timeout)

    def hold(self) -> list[Handed]:
        """Let the transaction running end, begin no other, and give back the parts not begun (oldest first)."""
        with self._lock:
            self._held = True
            self._lock.wait_for(lambda: not self._running)
            back, self._queue = self._queue, []
            return back

    def release(self) -> None:
        """End a ``hold``."""
        with self._lock:
            self._held = False
            self._lock.notify_all()

    def resume(self) -> None:
        """The loop has rewound after a failed transaction: take parts again."""
        with self._lock:
            self._failed = False
            self._lock.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread once the transaction running, if any, has ended; parts not begun are not committed."""
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._lock.notify_all()
        self._thread.join(timeout_s)

    # ---- the committer's thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or self._takeable())
                if self._linger_s and not self._closing:
                    # A transaction costs the host and the broker about the same however many cycles it carries: let
                    # the cycles handed meanwhile join this one, until its oldest has waited ``linger_s``
                    until = self._queue[0].handed_at + self._linger_s
                    self._lock.wait_for(lambda: self._closing or not self._takeable() or time.monotonic() >= until,
                                        max(0.0, until - time.monotonic()))
                if self._closing:
                    return
                if not self._takeable():
                    continue                    # held or failed while it lingered
                self._running, self._queue = self._queue, []
            outcome = self._commit(self._running)
            with self._lock:
                self._running = []
                self._failed = outcome.error is not None
                if self._failed:
                    self._queue.clear()         # after the failed cycles: the loop's rewind reads them again
                self._outcomes.append(outcome)
                self._lock.notify_all()
            self._wake()

    def _takeable(self) -> bool:
        return bool(self._queue) and not self._held and not self._failed

    def _commit(self, parts: list[Handed]) -> Outcome:
        records = [record for part in parts for record in part.records]
        started = time.perf_counter()
        try:
            self._txns.commit(records, merged_offsets(parts), parts[-1].group_metadata)
        except Exception as exc:  # aborted (the loop rewinds), or fenced, an outage, a bug (the loop raises it)
            log.debug("transaction failed: %r", exc)
            return Outcome(parts, error=exc)
        return Outcome(parts, committed_at=time.monotonic(), commit_ms=(time.perf_counter() - started) * 1000,
                       steps_ms=dict(self._txns.last_steps_ms), outputs=dict(self._txns.last_outputs))
