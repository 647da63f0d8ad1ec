"""The transactional producer's watchdog: a call on the producer that overruns its own timeout by far ends the
process, so that a restart with the same --worker-id recovers (``worker.stream.transactions`` sets the limits)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from worker.ops import liveness

log = logging.getLogger(__name__)


class Watchdog:
    """Exits the process if one client call overruns its own timeout by far.

    A transactional call blocked inside librdkafka cannot be interrupted from Python. Nothing of the open
    transaction is visible, so exiting is safe, and a restart with the same --worker-id aborts the hung
    transaction in init_transactions. Exit code 5. From the moment the call overruns its own timeout (within
    ``POLL_S``) until it returns, /healthz answers 503 (``worker.ops.liveness``).

    One daemon thread per producer, looking every ``POLL_S`` at the call armed now: arming and disarming only set an
    attribute under a lock. (Waking the thread on each arming cost six wake-ups a transaction, each taking the GIL
    from the threads that launch and read batches; a thread per call would cost three thread starts.)
    """

    EXIT_CODE = 5
    POLL_S = 0.05

    def __init__(self, broker: liveness.BrokerLiveness) -> None:
        self._broker = broker
        self._lock = threading.Lock()
        self._armed: tuple[str, float, float, float] | None = None  # (step, limit_s, overdue at, deadline)
        self._flagged: tuple[str, float, float, float] | None = None  # the armed call /healthz reports overdue
        threading.Thread(target=self._watch, name="decider-txn-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, step: str, timeout_s: float, limit_s: float):
        """Warn (/healthz) once the body runs past ``timeout_s``; exit the process once it runs past ``limit_s``."""
        now = time.monotonic()
        armed = (step, limit_s, now + timeout_s, now + limit_s)
        with self._lock:
            self._armed = armed
        try:
            yield
        finally:
            with self._lock:
                self._armed = None
                if self._flagged is armed:
                    self._flagged = None
                    self._broker.overran(None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                armed = self._armed
                if armed is None:
                    continue
                step, limit_s, overdue, deadline = armed
                now = time.monotonic()
                if now >= deadline:
                    self._fire(step, limit_s)
                if now >= overdue and self._flagged is not armed:
                    self._flagged = armed
                    self._broker.overran(f"{step} overran its timeout; the process exits in {deadline - now:.0f} s "
                                         "unless it returns")

    def _fire(self, step: str, limit_s: float) -> None:
        message = (f"error: {step} did not return within {limit_s:.0f} s; exiting so that a restart with the same "
                   "--worker-id recovers (it aborts the hung transaction)")
        log.critical(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)
