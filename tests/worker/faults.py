"""Fault injection from the test side: a ``SchemaEngine`` that fails on marked states, or whose scores come late, and
a ``decider`` entry point that runs with it.

Nothing on CPU fails per state naturally, yet the worker's isolation path (a batch fails -> each state scored alone
-> only the bad one dead-lettered) must run end to end. ``python -m tests.worker.faults fail-on=MARKER ARGS...`` runs
``decider ARGS...`` with every state whose text contains MARKER failing inside the scoring step, as a device
failure on one state would (an out-of-memory on one huge state).

Nor does a CPU keep a launched batch busy: its forward runs inside the launch, so the scores are ready when the
launch returns. ``python -m tests.worker.faults scores-late=SECONDS ARGS...`` hands each launched batch's scores over
SECONDS later, as a GPU busy with a large batch would, so that what the loop does meanwhile (open the cycle's
transaction, take a rebalance) runs end to end.
"""

from __future__ import annotations

import sys
import time

from engine import SchemaEngine
from engine.schema_engine import TokenizedState


class InjectedFault(RuntimeError):
    """Raised when a batch holds a marked state."""


class MarkedRow(TokenizedState):
    """A tokenized state whose text carried the marker."""

    __slots__ = ()


def failing_on(marker: str) -> type[SchemaEngine]:
    """A ``SchemaEngine`` class whose ``launch_mixed`` (and so ``score_mixed``) fails for any batch holding a state that
    contains ``marker``."""

    class FaultySchemaEngine(SchemaEngine):
        def tokenize(self, h, context, max_ctx_tokens=None):
            row = super().tokenize(h, context, max_ctx_tokens)
            return MarkedRow(*row) if marker in context else row

        def tokenize_many(self, h, contexts, max_ctx_tokens=None):
            rows = super().tokenize_many(h, contexts, max_ctx_tokens)
            return [MarkedRow(*row) if marker in context else row for row, context in zip(rows, contexts)]

        def launch_mixed(self, requests):
            if any(isinstance(row, MarkedRow) for _, row in requests):
                raise InjectedFault(f"injected scoring fault (a state contains {marker!r})")
            return super().launch_mixed(requests)

    return FaultySchemaEngine


class _LateScores:
    """A launched batch's pending scores, handed over ``seconds`` after they are first asked for."""

    def __init__(self, pending, seconds: float) -> None:
        self._pending, self._seconds = pending, seconds

    def result(self):
        return [state.probabilities for state in self.details()]

    def details(self):
        time.sleep(self._seconds)
        return self._pending.details()


def scores_late(seconds: float) -> type[SchemaEngine]:
    """A ``SchemaEngine`` class whose launched batches' scores are ready ``seconds`` after the launch returns."""

    class LateSchemaEngine(SchemaEngine):
        def launch_mixed(self, requests):
            return _LateScores(super().launch_mixed(requests), seconds)

    return LateSchemaEngine


FAULTS = {"fail-on": failing_on, "scores-late": lambda seconds: scores_late(float(seconds))}


if __name__ == "__main__":
    import engine
    from worker.cli.app import main

    kind, _, value = sys.argv[1].partition("=")
    engine.SchemaEngine = FAULTS[kind](value)  # the worker loads its engine through engine.SchemaEngine
    main(sys.argv[2:])
