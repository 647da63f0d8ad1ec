"""Whether the broker answers and whether a call on it is stuck, for ``/readyz`` and ``/healthz`` (``worker.ops.health``)
and for the loop's outage bound; whether a partition stalled (``worker.stream.progress`` reports it here, and reads
the states partitions' ends from here).

The loop's own events cannot say this: while a commit hangs the loop emits nothing. So the clients report here as
they go (module-level, like the Prometheus metrics): the transactional producer around each call, the states
consumer's statistics every 2 s, the schema table's catch-up. The last word wins: a failure marks the broker
unreachable until a later round trip succeeds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Iterator

from worker.exceptions import BrokerOutageError

STUCK_AFTER_S = 5.0
"""A commit (or one call inside it) running this long is stuck: commits normally take milliseconds."""


class BrokerLiveness:
    """The broker's reachability and the calls in progress, from every client's reports."""

    def __init__(self, stuck_after_s: float = STUCK_AFTER_S) -> None:
        self._lock = threading.Lock()
        self._stuck_after_s = stuck_after_s
        self._down_since: float | None = None  # monotonic time of the first failure since the last success
        self._down_why = ""
        self._busy: dict[int, tuple[str, float]] = {}  # per thread: the outermost call in progress and its start
        self._overrun: str | None = None  # the watchdog's warning: a call overran its own timeout

    def succeeded(self) -> None:
        """A round trip to the broker worked."""
        with self._lock:
            self._down_since, self._down_why = None, ""

    def failed(self, why: str) -> None:
        """The broker did not answer (``why``: what failed)."""
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
            self._down_why = why

    def outage_s(self) -> float:
        """Seconds since the broker stopped answering (0 while it answers)."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def check_outage(self, limit_s: float) -> None:
        """Raise ``BrokerOutageError`` once the broker has not answered for longer than ``limit_s``
        (--broker-outage-s): the loop gives up riding the outage out."""
        outage_s = self.outage_s()
        if outage_s > limit_s:
            raise BrokerOutageError(f"the broker has not answered for {outage_s:.0f} s (--broker-outage-s {limit_s:g}); "
                                    "restart the worker (same --worker-id) once it is back: it resumes from the committed "
                                    "offsets")

    @contextlib.contextmanager
    def call(self, step: str) -> Iterator[None]:
        """Mark a blocking broker call (``step``) in progress; nested calls keep the outermost's start."""
        thread = threading.get_ident()
        with self._lock:
            outermost = thread not in self._busy
            if outermost:
                self._busy[thread] = (step, time.monotonic())
        try:
            yield
        finally:
            if outermost:
                with self._lock:
                    self._busy.pop(thread, None)

    def overran(self, message: str | None) -> None:
        """The watchdog's word: a call overran its own timeout and the process exits soon (None: it returned)."""
        with self._lock:
            self._overrun = message

    def on_stats(self, stats_json: str) -> None:
        """A client's librdkafka statistics: the broker answers if a connection to a known broker is up."""
        brokers = json.loads(stats_json).get("brokers", {}).values()
        known = [b for b in brokers if b.get("nodeid", -1) >= 0]
        if any(b.get("state") == "UP" for b in known):
            self.succeeded()
        elif known or brokers:
            self.failed("no connection to any broker (" + ", ".join(f"{b.get('name')}: {b.get('state')}" for b in brokers) + ")")

    def readiness_problem(self) -> str | None:
        """Why the worker cannot do its work now (the broker unreachable, a call stuck), or None."""
        now = time.monotonic()
        with self._lock:
            stuck = [(step, now - start) for step, start in self._busy.values() if now - start >= self._stuck_after_s]
            if stuck:
                step, seconds = stuck[0]
                return f"{step} has not returned for {seconds:.0f} s"
            if self._down_since is not None:
                return f"broker unreachable for {now - self._down_since:.0f} s: {self._down_why}"
        return None

    def liveness_problem(self) -> str | None:
        """Why the process is about to exit (a call overran its timeout: the watchdog ends it), or None."""
        with self._lock:
            return self._overrun


BROKER = BrokerLiveness()
"""This process's view of its broker."""


class ProgressProblems:
    """Stalled partitions (``worker.stream.progress``), for ``/readyz``: the last report wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._problem: str | None = None

    def report(self, problem: str | None) -> None:
        """What is stalled now (None: nothing)."""
        with self._lock:
            self._problem = problem

    def readiness_problem(self) -> str | None:
        with self._lock:
            return self._problem


PROGRESS = ProgressProblems()
"""This process's stalled partitions."""


class PartitionEnds:
    """Each assigned states partition's last stable offset and the committed offset librdkafka knows of (the log's
    start where the group has none), from the states consumer's statistics (every 2 s), for the stall check
    (``worker.stream.progress``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[tuple[str, int], tuple[int, int]] = {}

    def on_stats(self, stats_json: str) -> None:
        found = {}
        for topic, partition, p in assigned_partitions(json.loads(stats_json)):
            # no committed offset yet (a new group): reading starts at the log's start (auto.offset.reset)
            committed = p.get("committed_offset", -1)
            found[(topic, partition)] = (p.get("ls_offset", -1), committed if committed >= 0 else p.get("lo_offset", -1))
        with self._lock:
            self._ends = found

    def snapshot(self) -> dict[tuple[str, int], tuple[int, int]]:
        """{(topic, partition): (last stable offset, committed offset)}; -1 where not known."""
        with self._lock:
            return dict(self._ends)


PARTITION_ENDS = PartitionEnds()
"""The states consumer's view of its partitions' ends."""


def assigned_partitions(stats: dict[str, Any]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(topic, partition, its statistics) of each partition a consumer's librdkafka statistics show it fetching: not
    the internal UA partition (-1), nor one not assigned to it."""
    for topic, info in stats.get("topics", {}).items():
        for partition, p in info.get("partitions", {}).items():
            if partition != "-1" and p.get("fetch_state") not in (None, "none", "stopped"):
                yield topic, int(partition), p
