"""Fault injection from the test side: a ``SchemaEngine`` that fails on marked states, and a ``decider`` entry point
that runs with it.

Nothing on CPU fails per state naturally, yet the worker's isolation path (a batch fails -> each state scored alone
-> only the bad one dead-lettered) must run end to end. ``python -m tests.worker.faults MARKER ARGS...`` runs
``decider ARGS...`` with every state whose text contains MARKER failing inside the scoring step, as a device
failure on one state would (an out-of-memory on one huge state).
"""

from __future__ import annotations

import sys

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

        def launch_mixed(self, requests):
            if any(isinstance(row, MarkedRow) for _, row in requests):
                raise InjectedFault(f"injected scoring fault (a state contains {marker!r})")
            return super().launch_mixed(requests)

    return FaultySchemaEngine


if __name__ == "__main__":
    import engine
    from worker.cli import main

    engine.SchemaEngine = failing_on(sys.argv[1])  # the worker loads its engine through engine.SchemaEngine
    main(sys.argv[2:])
